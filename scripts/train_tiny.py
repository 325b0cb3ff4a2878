"""Train the embedded default model ``tiny`` so that it answers in text, not random bytes.

Architecture and tokenizer are unchanged: ``model/tiny.py``'s config (3 KDA + 1 MLA, 64-token segments),
the byte-level tokenizer (byte b = id b + 3). The weights start from the seeded random init and learn
next-byte prediction on the Python standard library's top-level ``*.py`` sources of the interpreter that
runs this script (PSF License; see ``model/data/NOTICE``). The last 5 % of the files (by name) are held
out for the validation loss. One sequence is one prefill through the model's own ``prefill`` on the
canonical schedule, so what is trained is exactly what serves.

    .venv/bin/python scripts/train_tiny.py --steps 1200      # ~20 min on one CPU core
    writes model/data/tiny.safetensors and model/data/tiny_training.json (the losses, the corpus digest)

Reproducible: seed 0, one thread, the same Python version (the corpus is its stdlib).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "model" / "data"
BYTE_OFFSET = 3


def corpus() -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train ids, validation ids, sha256 of the corpus bytes) from the stdlib's top-level sources."""
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
    cut = int(len(files) * 0.95)
    parts = [Path(f).read_bytes() for f in files]
    digest = hashlib.sha256(b"".join(parts)).hexdigest()
    to_ids = lambda bs: torch.tensor(list(b"".join(bs)), dtype=torch.long) + BYTE_OFFSET  # noqa: E731
    return to_ids(parts[:cut]), to_ids(parts[cut:]), digest


def loss_of(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy (nats) of one sequence through the serving prefill, with gradients."""
    prefill = type(model).prefill.__wrapped__  # the serving path, without its no_grad
    logits = prefill(model, seq.tolist(), logits="all").logits
    return torch.nn.functional.cross_entropy(logits[:-1].float(), seq[1:])


def evaluate(model: torch.nn.Module, ids: torch.Tensor, length: int, n: int) -> float:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        starts = torch.randint(0, len(ids) - length - 1, (n,), generator=gen).tolist()
        return sum(loss_of(model, ids[s : s + length]).item() for s in starts) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--length", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine to a tenth)")
    ap.add_argument("--out", type=Path, default=OUT, help="where the weights and the log go")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from kvpool.model.tiny import build_tiny

    torch.manual_seed(0)
    torch.set_num_threads(1)
    train, val, digest = corpus()
    model = build_tiny()
    model.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
        ),
    )
    gen = torch.Generator().manual_seed(0)
    log: list[dict[str, float]] = []
    t0 = time.perf_counter()
    initial_val = evaluate(model, val, args.length, 32)
    print(f"step 0: validation loss {initial_val:.3f} nats/byte", flush=True)
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for s in torch.randint(0, len(train) - args.length - 1, (args.batch,), generator=gen).tolist():
            loss = loss_of(model, train[s : s + args.length])
            (loss / args.batch).backward()
            total += loss.item() / args.batch
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps:
            elapsed = time.perf_counter() - t0
            eta = elapsed / step * (args.steps - step)
            log.append({"step": step, "train_loss": total, "seconds": elapsed})
            print(
                f"step {step}/{args.steps}: train loss {total:.3f}, {elapsed:.0f} s, ETA {eta:.0f} s",
                flush=True,
            )
    final_val = evaluate(model, val, args.length, 32)
    print(f"validation loss {final_val:.3f} nats/byte ({final_val / math.log(2):.3f} bits/byte)", flush=True)
    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    save_file(state, str(args.out / "tiny.safetensors"))
    (args.out / "tiny.safetensors").chmod(0o644)  # shipped in the repo: readable by everyone
    meta = {
        "corpus": "Python standard library, top-level *.py files (PSF License)",
        "python": platform.python_version(),
        "corpus_sha256": digest,
        "train_bytes": len(train),
        "validation_bytes": len(val),
        "steps": args.steps,
        "batch": args.batch,
        "length": args.length,
        "lr": args.lr,
        "seed": 0,
        "validation_loss_nats_per_byte": {"initial": initial_val, "final": final_val},
        "final_train_loss": log[-1]["train_loss"] if log else None,
        "seconds": time.perf_counter() - t0,
        "log": log,
    }
    (args.out / "tiny_training.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
