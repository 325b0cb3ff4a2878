"""The prepared GPU check (run by ``scripts/gpu_check.sh``): prefill on the GPU, verified and timed in one
short run. Writes ``gpu_check.json`` and ``gpu_check.txt`` (a table) into ``--out``.

Steps, each recorded even when another fails (its error goes to ``errors``):

1. **equality**: the tiny model and a K3-layer-shaped config (K3's KDA heads x dims and MLA latent dims,
   4 layers, small hidden and vocab) on the device against the same weights on CPU: last-prompt logits in
   fp32 within ``LOGIT_TOL``, greedy tokens identical.
2. **resume**: under ``torch.use_deterministic_algorithms(True)``, prefill(0..L) on the device equals
   prefill(0..p) -> checkpoint and latents encoded as cache units, decoded -> prefill(p..L), bitwise.
3. **kernels**: fla-core's ``chunk_kda`` / ``fused_recurrent_kda`` (``model/kda_backend.py``) against our
   chunked / recurrent path at K3 head shapes, within ``KERNEL_TOL``; the state fla returns feeds our
   recurrence (same layout); the whole model under ``fla`` against ``naive``.
4. **speed**: KDA op tokens/s at 1k/8k/32k tokens and model prefill tokens/s, ours vs fla; decode ms/token.
5. **push**: MLA + checkpoint bytes the prefill produces per second, against HBM copy speed and
   device-to-host copies (pinned, pageable), and the push's staging (``stage_to_host``: chunked D2H into
   pinned memory on a side stream, overlapped with the next chunk's compute, #18): ``staged_equal`` (the
   staged bytes and their store checksum as a put ``Payload`` equal the device's; also checked on CPU).

``GPU_CHECK_DRY=1`` runs every step it can on CPU with tiny sizes (no fla: its fields are null with a
reason) so ``make test`` proves the script and its JSON schema never rot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LOGIT_TOL = 2e-3  # fp32 logits, device vs CPU (different GEMM kernels and reduction orders)
KERNEL_TOL = 5e-3  # fla vs ours, fp32 inputs (fla's chunked form uses tf32-free fp32 but other orders)
FIELDS = ("date", "dry", "device", "equality", "resume", "kernels", "speed", "push", "errors", "seconds")


def k3_shaped(dry: bool) -> Any:
    """4 layers (3 KDA + 1 MLA) at K3's KDA heads x head dim (96 x 128) and MLA latent (512 + 64)."""
    from kvpool.model.tiny import tiny_config

    base = tiny_config(4)
    if dry:
        return dataclasses.replace(base, kda_num_heads=8, kv_lora_rank=128, qk_rope_head_dim=32)
    return dataclasses.replace(
        base, vocab_size=4096, hidden_size=2048, intermediate_size=4096, kda_num_heads=96, kda_head_dim=128,
        num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    )  # fmt: skip


_MODELS: dict[tuple[str, str], Any] = {}


def model_on(name: str, cfg: Any, dev: torch.device) -> Any:
    """One seeded model per (config, device), built once: weights are made on CPU, so every device holds
    the same bytes."""
    from kvpool.model.tiny import build_tiny

    key = (name, str(dev))
    if key not in _MODELS:
        _MODELS[key] = build_tiny(config=cfg, device=dev)
    return _MODELS[key]


def ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], dev: torch.device, repeat: int = 3) -> float:
    """Best of ``repeat`` wall times (s) after one warm-up."""
    fn()
    sync(dev)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


def equality(dev: torch.device, models: dict[str, Any], n: int, new_tokens: int) -> dict[str, Any]:
    out = {}
    for name, cfg in models.items():
        cpu, gpu = model_on(name, cfg, torch.device("cpu")), model_on(name, cfg, dev)
        prompt = ids(n, cfg.vocab_size)
        diff = (cpu.prefill(prompt).logits - gpu.prefill(prompt).logits.cpu()).abs().max().item()
        a, b = cpu.generate(prompt, new_tokens, eos_ids=()), gpu.generate(prompt, new_tokens, eos_ids=())
        out[name] = {"max_abs_logit_diff": diff, "tolerance": LOGIT_TOL, "within": diff <= LOGIT_TOL,
                     "greedy_equal": a == b, "tokens": new_tokens}  # fmt: skip
    return out


def resume(dev: torch.device, models: dict[str, Any], n: int) -> dict[str, Any]:
    """Bitwise resume through the cache units' bytes, on the device, deterministic algorithms on."""
    from kvpool.cache.units import decode_kda_checkpoint, encode_kda_checkpoint
    from kvpool.model.state import KDACheckpoint, PrefixState

    torch.use_deterministic_algorithms(True)
    out = {}
    for name, cfg in models.items():
        model = model_on(name, cfg, dev)
        prompt, cut = ids(n, cfg.vocab_size, 1), (n // 2) // 64 * 64
        full = model.prefill(prompt, boundaries=[cut], logits="all")
        schema = model.cache_schema(64)
        taken = full.checkpoints[cut]
        host = KDACheckpoint(cut, {i: dataclasses.replace(s, recurrent=s.recurrent.cpu(), conv=s.conv.cpu())
                                   for i, s in taken.layers.items()})  # fmt: skip
        blob = bytes(encode_kda_checkpoint(schema, host))
        ck = decode_kda_checkpoint(blob, schema)
        ck.layers = {i: dataclasses.replace(s, recurrent=s.recurrent.to(dev), conv=s.conv.to(dev))
                     for i, s in ck.layers.items()}  # fmt: skip
        start = PrefixState(cut, ck, {i: rows[:cut].clone() for i, rows in full.mla.items()})
        rest = model.prefill(prompt[cut:], start=start, logits="all")
        same = torch.equal(rest.logits, full.logits[cut:]) and all(
            torch.equal(rest.final.layers[i].recurrent, full.final.layers[i].recurrent)
            for i in full.final.layers
        )
        out[name] = {"bitwise": same, "tokens": n, "cut": cut, "checkpoint_bytes": len(blob)}
    torch.use_deterministic_algorithms(False)
    return out


def _kda_inputs(T: int, H: int, d: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    from kvpool.model.kda_ops import prepare_qk

    gen = torch.Generator(device=dev).manual_seed(5)  # made on the device: 32k x 96 x 128 is GBs
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q, k = prepare_qk(r(T, H, d), r(T, H, d))
    g = -torch.nn.functional.softplus(r(T, H, d)) * 0.1
    beta = torch.sigmoid(r(T, H))
    return q, k, r(T, H, d), g, beta, torch.zeros(H, d, d, device=dev)


def kernels(dev: torch.device, cfg: Any, T: int, fla_ok: bool) -> dict[str, Any]:
    if not fla_ok:
        return {"skipped": "fla-core's Triton kernels need CUDA and an importable fla"}
    from kvpool.model.kda_backend import fla_chunk, fla_recurrent, set_kda_backend
    from kvpool.model.kda_ops import kda_chunked, kda_recurrent

    q, k, v, g, beta, s0 = _kda_inputs(T, cfg.kda_num_heads, cfg.kda_head_dim, dev)
    o1, s1 = kda_chunked(q, k, v, g, beta, s0)
    o2, s2 = fla_chunk(q, k, v, g, beta, s0)
    steps = 16
    o3, s3 = kda_recurrent(q[:steps], k[:steps], v[:steps], g[:steps], beta[:steps], s1)
    o4, s4 = fla_recurrent(q[:steps], k[:steps], v[:steps], g[:steps], beta[:steps], s1)
    o5, _ = kda_recurrent(q[:steps], k[:steps], v[:steps], g[:steps], beta[:steps], s2)  # fla's state, ours
    md = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    res = {
        "chunk": {"max_abs_o": md(o1, o2), "max_abs_state": md(s1, s2), "tokens": T},
        "recurrent": {"max_abs_o": md(o3, o4), "max_abs_state": md(s3, s4), "steps": steps},
        "state_layout": {"max_abs_o_ours_from_fla_state": md(o3, o5)},
        "tolerance": KERNEL_TOL,
    }
    model, prompt = model_on("k3_shaped", cfg, dev), ids(512, cfg.vocab_size, 4)
    ours = model.prefill(prompt).logits
    set_kda_backend("fla")
    try:
        res["model"] = {"max_abs_logit_diff": md(ours, model.prefill(prompt).logits), "tokens": 512}
    finally:
        set_kda_backend("naive")
    res["within"] = all(
        v <= KERNEL_TOL
        for part in ("chunk", "recurrent", "state_layout")
        for key, v in res[part].items()
        if key.startswith("max_abs")
    )
    res["model"]["within"] = res["model"]["max_abs_logit_diff"] <= LOGIT_TOL  # fmt: skip
    return res


def speed(dev: torch.device, cfg: Any, lengths: list[int], fla_ok: bool) -> dict[str, Any]:
    from kvpool.model.kda_backend import fla_chunk, set_kda_backend
    from kvpool.model.kda_ops import kda_chunked

    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    op: dict[str, dict[str, float | None]] = {}
    for T in lengths:
        x = _kda_inputs(T, H, d, dev)
        op[str(T)] = {"ours": T / timed(lambda x=x: kda_chunked(*x), dev, 2),
                      "fla": T / timed(lambda x=x: fla_chunk(*x), dev, 2) if fla_ok else None}  # fmt: skip
    model = model_on("k3_shaped", cfg, dev)
    pre: dict[str, dict[str, float | None]] = {}
    decode: dict[str, float | None] = {}
    for backend in ("naive", "fla"):
        if backend == "fla" and not fla_ok:
            decode["fla"] = None
            continue
        set_kda_backend(backend)
        key = "ours" if backend == "naive" else "fla"
        for T in lengths:
            prompt = ids(T, cfg.vocab_size, 2)
            pre.setdefault(str(T), {"ours": None, "fla": None})[key] = T / timed(
                lambda p=prompt: model.prefill(p), dev, 1)  # fmt: skip
        decode[key] = _decode_ms(model, cfg, dev)
    set_kda_backend("naive")
    return {"kda_op_tokens_per_s": op, "prefill_tokens_per_s": pre, "decode_ms_per_token": decode,
            "layers": {"kda": len(cfg.kda_layers), "mla": len(cfg.mla_layers)}}  # fmt: skip


def _decode_ms(model: Any, cfg: Any, dev: torch.device, steps: int = 16) -> float:
    from kvpool.model.decode_state import DecodeState

    state = DecodeState.from_prefill(model.prefill(ids(256, cfg.vocab_size, 3)))
    model.decode_step(5, state.clone())
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        _, state = model.decode_step(5, state)
    sync(dev)
    return (time.perf_counter() - t) / steps * 1000


def push(dev: torch.device, cfg: Any, prefill_tok_s: float | None, mib: int) -> dict[str, Any]:
    """What the store must absorb from one prefill GPU, and what the copies out of the GPU can give."""
    schema = model_on("k3_shaped", cfg, dev).cache_schema(64)
    mla_per_token = schema.mla_block_bytes(64) // 64
    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    gbps = lambda s: n / s / 1e9  # noqa: E731
    out: dict[str, Any] = {
        "mla_bytes_per_token": mla_per_token,
        "checkpoint_bytes": schema.kda_checkpoint_bytes(),
        "produced_mla_bytes_per_s": mla_per_token * prefill_tok_s if prefill_tok_s else None,
        "hbm_copy_gbps": 2 * gbps(timed(lambda: src.clone(), dev)),  # read + write
    }
    torch.manual_seed(18)
    src.random_(0, 256)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    out["staged_equal"] = _staged_equal(src, host)
    if dev.type != "cuda":
        out.update(d2h_pinned_gbps=None, d2h_pageable_gbps=None, overlap=None)
        return out
    pageable = torch.empty(n, dtype=torch.uint8)
    out["d2h_pinned_gbps"] = gbps(timed(lambda: host.copy_(src, non_blocking=True), dev))
    out["d2h_pageable_gbps"] = gbps(timed(lambda: pageable.copy_(src), dev))
    out["overlap"] = _overlap(src, host, dev)
    return out


def stage_to_host(
    src: torch.Tensor,
    dst: torch.Tensor,
    chunks: int,
    compute: Callable[[], object] | None = None,
    stream: Any = None,
) -> None:
    """The push's device side: copy ``src`` into host ``dst`` (pinned on CUDA) chunk by chunk. With a CUDA
    ``stream``, each chunk's copy runs on it while ``compute()`` (the next chunk's work) runs on the default
    stream; on CPU it is a plain chunked copy, so the same code is checked for equality there."""
    part = -(-src.numel() // chunks)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())  # src was produced on the default stream
    for c in range(chunks):
        if compute is not None:
            compute()
        piece = slice(c * part, min((c + 1) * part, src.numel()))
        if stream is not None:
            with torch.cuda.stream(stream):
                dst[piece].copy_(src[piece], non_blocking=True)
        else:
            dst[piece].copy_(src[piece])
    if stream is not None:
        stream.synchronize()


def _staged_equal(src: torch.Tensor, host: torch.Tensor) -> bool:
    """Staged bytes equal the device's, and the store's checksum of them as a put's Payload is the one of
    the source (the parts a prefill hands to ``batch_put`` are exactly what the device held)."""
    import xxhash
    from kvpool.kvstore.transport.base import Payload

    stream = torch.cuda.Stream() if src.device.type == "cuda" else None
    stage_to_host(src, host, 8, stream=stream)
    want = src.cpu()
    return bool(torch.equal(host, want)) and Payload([host]).xxh3() == xxhash.xxh3_64_intdigest(want.numpy())


def _overlap(src: torch.Tensor, pinned: torch.Tensor, dev: torch.device, chunks: int = 8) -> dict[str, float]:
    """Copy ``src`` to pinned host in chunks on a side stream while the default stream computes the next
    chunk (a matmul of the same duration as one chunk's copy, roughly): overlap = time hidden / shorter."""
    a = torch.randn(4096, 4096, device=dev)
    copy_stream = torch.cuda.Stream()

    def compute() -> None:
        for _ in range(chunks):
            a @ a

    def copy() -> None:
        stage_to_host(src, pinned, chunks)

    def both() -> None:
        stage_to_host(src, pinned, chunks, compute=lambda: a @ a, stream=copy_stream)

    tc, tx, tb = timed(compute, dev), timed(copy, dev), timed(both, dev)
    return {"compute_s": tc, "copy_s": tx, "both_s": tb, "overlap_fraction": (tc + tx - tb) / min(tc, tx),
            "d2h_gbps_alone": src.numel() / tx / 1e9}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/gpu_check"))
    args = ap.parse_args()
    dry = os.environ.get("GPU_CHECK_DRY") == "1"
    t0 = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    try:
        import fla  # noqa: F401

        fla_version: str | None = getattr(sys.modules["fla"], "__version__", "unknown")
    except ImportError as e:
        fla_version, fla_error = None, str(e)
    else:
        fla_error = None
    fla_ok = fla_version is not None and dev.type == "cuda"
    from kvpool.model.tiny import tiny_config

    models = {"tiny": tiny_config(4), "k3_shaped": k3_shaped(dry)}
    lengths = [256, 512] if dry else [1024, 8192, 32768]
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry": dry,
                              "errors": {}}  # fmt: skip
    report["device"] = {
        "type": dev.type, "name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "fla": fla_version, "fla_error": fla_error,
        "hbm_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if dev.type == "cuda" else None,
    }  # fmt: skip
    steps: dict[str, Callable[[], Any]] = {
        "equality": lambda: equality(dev, models, 200 if dry else 1000, 8 if dry else 32),
        "resume": lambda: resume(dev, models, 256 if dry else 2048),
        "kernels": lambda: kernels(dev, models["k3_shaped"], 256 if dry else 4096, fla_ok),
        "speed": lambda: speed(dev, models["k3_shaped"], lengths, fla_ok),
    }
    for name, step in steps.items():
        report[name] = _guarded(report, name, step)
    pre = (report.get("speed") or {}).get("prefill_tokens_per_s", {}).get(str(lengths[-1]), {})
    best = max((v for v in pre.values() if v), default=None)
    report["push"] = _guarded(
        report, "push", lambda: push(dev, models["k3_shaped"], best, 16 if dry else 1024)
    )
    report["seconds"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    (out / "gpu_check.txt").write_text(table(report), encoding="utf-8")
    print(table(report))
    print(json.dumps(report))
    return 0 if not report["errors"] else 1


def _guarded(report: dict[str, Any], name: str, step: Callable[[], Any]) -> Any:
    try:
        return step()
    except Exception as e:  # one failing step must not lose the others' figures
        report["errors"][name] = f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3)[-600:]}"
        return None


def table(r: dict[str, Any]) -> str:
    """The readable half: one line per figure."""
    lines = [f"kvpool GPU check {r['date']} on {r['device']['name']} (dry={r['dry']}), {r['seconds']:.0f} s"]

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            lines.append(f"  {prefix:<58} {v:.4g}" if isinstance(v, float) else f"  {prefix:<58} {v}")

    for part in ("equality", "resume", "kernels", "speed", "push", "errors"):
        walk(part, r.get(part))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
