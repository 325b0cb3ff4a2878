"""Which code runs the KDA recurrence: ``naive`` (ours, ``kda_ops``, the reference every test checks) or
``fla`` (fla-core's Triton kernels ``chunk_kda`` / ``fused_recurrent_kda``, CUDA only).

The switch exists so a GPU prefill node can use the fast kernels while our cache units stay the same
bits: both sides take q, k already L2-normalised with the ``dk^-1/2`` scale folded into q (so fla gets
``scale=1``), the log-space gate ``g`` and ``beta`` precomputed, and a state ``S [H, dk, dv]`` fp32 in the
same HKV layout (fla's ``[N, H, K, V]`` with ``state_v_first=False``). Results agree within rounding, not
bitwise: bit-exact resume needs one backend for a whole request, which is why the choice is per process
(``KVPOOL_KDA_KERNEL=fla`` or :func:`set_kda_backend`) and recorded by ``scripts/gpu_check.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .errors import UnsupportedConfigError
from .kda_ops import kda_chunk, kda_recurrent

KdaFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BACKENDS = ("naive", "fla")
_backend = os.environ.get("KVPOOL_KDA_KERNEL", "naive")


T = torch.Tensor


def _on_fla(kernel: KdaFn, q: T, k: T, v: T, g: T, beta: T, state: T) -> tuple[T, T]:
    """Our per-request shapes ``[T, H, d]`` as fla's batch of one, scale already in q, state HKV."""
    o, s = kernel(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                  initial_state=state[None].float().contiguous(), output_final_state=True)  # fmt: skip
    return o[0].float(), s[0].float()


def fla_chunk(q: T, k: T, v: T, g: T, beta: T, state: T) -> tuple[T, T]:
    """``kda_chunk``'s contract on fla's chunked kernel (any ``T``; fla cuts its own 64-token chunks)."""
    from fla.ops.kda import chunk_kda

    return _on_fla(chunk_kda, q, k, v, g, beta, state)


def fla_recurrent(q: T, k: T, v: T, g: T, beta: T, state: T) -> tuple[T, T]:
    """``kda_recurrent``'s contract on fla's fused recurrent kernel (decode)."""
    from fla.ops.kda import fused_recurrent_kda

    return _on_fla(fused_recurrent_kda, q, k, v, g, beta, state)


def set_kda_backend(name: str) -> None:
    """Select the backend for this process; ``fla`` must import (fla-core) and needs CUDA tensors."""
    global _backend
    if name not in BACKENDS:
        raise UnsupportedConfigError(
            f"unknown KDA kernel backend {name!r}; choose one of {', '.join(BACKENDS)}"
        )
    if name == "fla":
        try:
            import fla.ops.kda  # noqa: F401
        except ImportError as e:
            raise UnsupportedConfigError(f"KDA backend 'fla' needs fla-core importable ({e})") from None
    _backend = name


def kda_backend() -> str:
    return _backend


def chunk_fn() -> KdaFn:
    return fla_chunk if _backend == "fla" else kda_chunk


def recurrent_fn() -> KdaFn:
    return fla_recurrent if _backend == "fla" else kda_recurrent
