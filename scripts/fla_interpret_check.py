"""fla-core's Triton KDA kernels through our switch, on CPU, under Triton's interpreter
(``TRITON_INTERPRET=1``).

Why: the GPU check (``scripts/gpu_check.py``) is the real test of ``KVPOOL_KDA_KERNEL=fla``, but a GPU is
lent rarely. Triton's interpreter runs the same kernel source with numpy on CPU, so the wiring in
``model/kda_backend.py`` (shapes, ``scale=1``, log-space gate, the ``[H, dk, dv]`` state both ways) and the
model's use of it can be checked against our path now, with fla's real kernels rather than its naive
reference. It says nothing about speed, and the interpreter is not the compiler: a GPU run still decides.

Three shims make fla 0.6.0's kernels run under triton 3.6.0's interpreter; each stands in for something
compiled Triton does and changes no arithmetic:

- autotuning benchmarks every config through a GPU driver: here every config "times" the same, so the
  first one runs;
- a loop index is a Python ``int`` in the interpreter but a tensor when compiled (fla calls ``.to`` on it):
  the kernels' ``range`` yields interpreter tensors;
- ``__index__`` of a one-element interpreter tensor fails on its shape ``(1,)``: it takes ``.item()``.

Run (a venv with torch, triton==3.6.0 and the wheels of ``scripts/gpu_wheels.sh``; see
docs/measurements/gpu_check.md)::

    bash scripts/fla_interpret_check.sh

Prints a table and one JSON line; exits 1 when a difference is over its tolerance or greedy tokens differ.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np
import torch

OP_TOL = 1e-5  # fp32, same recurrence in fla's chunked form
MODEL_TOL = 1e-4  # fp32 logits of the tiny model, fla kernels vs ours
KERNEL_MODULES = (  # fla modules whose kernels loop over chunks with `range`
    "fla.ops.common.chunk_delta_h",
    "fla.ops.common.chunk_o",
    "fla.ops.kda.chunk_fwd",
    "fla.ops.kda.chunk_intra",
    "fla.ops.kda.wy_fast",
    "fla.ops.gla.chunk",
)


def install_shims() -> None:
    import triton.language as tl
    from triton.runtime import autotuner, interpreter

    autotuner.Autotuner._bench = lambda self, *a, config, **k: [0.0, 0.0, 0.0]  # type: ignore[method-assign]
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched

    def tensor_range(*bounds: Any) -> Iterator[Any]:
        for i in builtins.range(*(int(b) for b in bounds)):
            yield tl.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

    for name in KERNEL_MODULES:
        importlib.import_module(name).range = tensor_range  # type: ignore[attr-defined]


def kda_inputs(T: int, H: int, d: int) -> tuple[torch.Tensor, ...]:
    from kvpool.model.kda_ops import prepare_qk, softplus_gate

    g = torch.Generator().manual_seed(0)
    q, k = prepare_qk(torch.randn(T, H, d, generator=g), torch.randn(T, H, d, generator=g))
    a_log = torch.log(torch.empty(H).uniform_(1, 16, generator=g))
    gate = softplus_gate(torch.randn(T, H, d, generator=g), a_log, torch.randn(H * d, generator=g) - 3)
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    return q, k, torch.randn(T, H, d, generator=g), gate, beta, torch.randn(H, d, d, generator=g) * 0.1


def md(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def ops(T: int = 128, H: int = 2, d: int = 64, steps: int = 8) -> dict[str, float]:
    from kvpool.model.kda_backend import fla_chunk, fla_recurrent
    from kvpool.model.kda_ops import kda_chunked, kda_recurrent

    x = kda_inputs(T, H, d)
    o1, s1 = kda_chunked(*x)
    o2, s2 = fla_chunk(*x)
    head = tuple(t[:steps] for t in x[:5])
    o3, s3 = kda_recurrent(*head, x[5])
    o4, s4 = fla_recurrent(*head, x[5])
    o5, _ = kda_recurrent(*head, s2)  # fla's chunk state continued by our recurrence
    o6, _ = kda_recurrent(*head, s1)
    return {
        "chunk_o": md(o1, o2), "chunk_state": md(s1, s2), "recurrent_o": md(o3, o4),
        "recurrent_state": md(s3, s4), "ours_from_fla_state": md(o5, o6),
    }  # fmt: skip


def model(n: int = 130, new_tokens: int = 3) -> dict[str, Any]:
    from kvpool.model.kda_backend import set_kda_backend
    from kvpool.model.tiny import build_tiny

    m = build_tiny()
    prompt = torch.randint(3, m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    for backend in ("naive", "fla"):
        set_kda_backend(backend)
        out[backend] = (m.prefill(prompt).logits, m.generate(prompt, new_tokens, eos_ids=()))
    set_kda_backend("naive")
    return {
        "max_abs_logit_diff": md(out["naive"][0], out["fla"][0]),
        "greedy_equal": out["naive"][1] == out["fla"][1],
        "tokens": n,
        "new_tokens": new_tokens,
    }


def main() -> int:
    install_shims()
    import fla
    import triton

    t0 = time.perf_counter()
    report: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__,
                              "fla": getattr(fla, "__version__", "unknown"), "interpreter": True}  # fmt: skip
    report["ops"] = ops()
    report["model"] = model()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    ok = max(report["ops"].values()) <= OP_TOL
    ok = ok and report["model"]["max_abs_logit_diff"] <= MODEL_TOL and report["model"]["greedy_equal"]
    report["ok"] = ok
    for name, value in report["ops"].items():
        print(f"{name:<22} {value:.3g}  (tolerance {OP_TOL:g})")
    print(f"{'model logits':<22} {report['model']['max_abs_logit_diff']:.3g}  (tolerance {MODEL_TOL:g}), "
          f"greedy equal: {report['model']['greedy_equal']}")  # fmt: skip
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
