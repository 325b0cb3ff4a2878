"""Train the embedded default model ``tiny`` so that it answers in text, not random bytes.

The architecture is unchanged: ``model/tiny.py``'s config (3 KDA + 1 MLA, 64-token segments, vocab 1024).
First a byte-level BPE tokenizer is trained (``tokenizers``: 256 byte symbols, specials ``<pad>`` 0,
``<bos>`` 1, ``<eos>`` 2, merges up to the model's vocab of 1024; every byte string encodes, so any text
round-trips). Then the weights start from the seeded random init and learn next-token prediction. Both
use the Python standard library's top-level ``*.py`` sources of the interpreter that runs this script
(PSF License; see ``model/data/NOTICE``); the last 5 % of the files (by name) are held out for the
validation loss, stated per token and per byte. One sequence is one prefill through the model's own
``prefill`` on the canonical schedule, so what is trained is exactly what serves.

    .venv/bin/python scripts/train_tiny.py --steps 1000      # ~15 min on one CPU core
    writes model/data/tiny_tokenizer.json, model/data/tiny.safetensors and model/data/tiny_training.json

Reproducible: seed 0, one thread, the same Python version (the corpus is its stdlib).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "model" / "data"
SPECIALS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2: the tiny config's pad / bos / eos


def sources() -> tuple[list[str], list[str], str, int]:
    """(train texts, validation texts, sha256 of the corpus bytes, validation bytes) from the stdlib."""
    files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
    cut = int(len(files) * 0.95)
    parts = [Path(f).read_bytes() for f in files]
    digest = hashlib.sha256(b"".join(parts)).hexdigest()
    texts = [p.decode("utf-8", errors="replace") for p in parts]
    return texts[:cut], texts[cut:], digest, sum(len(p) for p in parts[cut:])


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over the training texts: deterministic for one corpus (one thread, fixed specials)."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return tok


def to_ids(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """The texts' tokens back to back (no specials), as one long training stream."""
    out: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
    return torch.tensor(out, dtype=torch.long)


def loss_of(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) of one sequence through the serving prefill, with gradients."""
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
    os.environ["RAYON_NUM_THREADS"] = "1"  # tokenizers' trainer: one thread, one merge order
    train_texts, val_texts, digest, val_bytes = sources()
    model = build_tiny()
    tok = train_tokenizer(train_texts, model.config.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tiny_tokenizer.json"))
    train, val = to_ids(tok, train_texts), to_ids(tok, val_texts)
    bytes_per_token = val_bytes / len(val)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, {bytes_per_token:.2f} bytes/token", flush=True)
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
    print(f"step 0: validation loss {initial_val:.3f} nats/token", flush=True)
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
    per_byte = final_val / bytes_per_token
    print(f"validation loss {final_val:.3f} nats/token = {per_byte:.3f} nats/byte", flush=True)
    from safetensors.torch import save_file

    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    save_file(state, str(args.out / "tiny.safetensors"))
    (args.out / "tiny.safetensors").chmod(0o644)  # shipped in the repo: readable by everyone
    meta = {
        "corpus": "Python standard library, top-level *.py files (PSF License)",
        "python": platform.python_version(),
        "corpus_sha256": digest,
        "tokenizer": "byte-level BPE, tiny_tokenizer.json",
        "train_tokens": len(train),
        "validation_tokens": len(val),
        "validation_bytes": val_bytes,
        "bytes_per_token": bytes_per_token,
        "steps": args.steps,
        "batch": args.batch,
        "length": args.length,
        "lr": args.lr,
        "seed": 0,
        "validation_loss_nats_per_token": {"initial": initial_val, "final": final_val},
        "validation_loss_nats_per_byte": {
            "initial": initial_val / bytes_per_token,
            "final": final_val / bytes_per_token,
        },
        "final_train_loss": log[-1]["train_loss"] if log else None,
        "seconds": time.perf_counter() - t0,
        "log": log,
    }
    (args.out / "tiny_training.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
