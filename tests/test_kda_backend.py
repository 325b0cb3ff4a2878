"""The KDA kernel switch (``model/kda_backend.py``), proven on CPU so a GPU run can only fail in the kernels.

fla's Triton kernels need CUDA, but fla-core's pure-torch ``naive.py`` takes the same arguments in the
same layout. Feeding it through our fla wrapper checks everything the wrapper does (batch of one,
``scale=1`` with the scale folded into q, log-space gate, state ``[H, dk, dv]``) and, with the naive
functions standing in for the kernels, that the model's call sites hand the switch the right tensors.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest
import torch
from kvpool.model import kda_backend
from kvpool.model.errors import UnsupportedConfigError
from kvpool.model.kda_ops import kda_chunk, kda_recurrent, prepare_qk, softplus_gate
from kvpool.model.tiny import build_tiny, tiny_config

from tests.harness.fla_naive import load_fla_naive

pytestmark = pytest.mark.usefixtures("torch_deterministic")
TOL = 1e-5  # fp32, same recurrence in a different summation order


def _inputs(T: int, H: int = 4, dk: int = 32, dv: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    q, k = prepare_qk(torch.randn(T, H, dk, generator=g), torch.randn(T, H, dk, generator=g))
    a_log = torch.log(torch.empty(H).uniform_(1, 16, generator=g))
    gate = softplus_gate(torch.randn(T, H, dk, generator=g), a_log, torch.randn(H * dk, generator=g) - 3)
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    return q, k, torch.randn(T, H, dv, generator=g), gate, beta, torch.randn(H, dk, dv, generator=g) * 0.1


@pytest.fixture
def fla_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable, Callable], None]]:
    """Install ``fla.ops.kda`` with the given stand-ins for ``chunk_kda`` / ``fused_recurrent_kda`` (fla's
    own package needs triton to import), so the backend's public functions run exactly as on a GPU up to
    the kernel call. Puts the backend back to ``naive`` afterwards."""

    def install(chunk: Callable, recurrent: Callable) -> None:
        kda = ModuleType("fla.ops.kda")
        kda.chunk_kda, kda.fused_recurrent_kda = chunk, recurrent  # type: ignore[attr-defined]
        for name in ("fla", "fla.ops"):
            monkeypatch.setitem(sys.modules, name, ModuleType(name))
        monkeypatch.setitem(sys.modules, "fla.ops.kda", kda)

    yield install
    kda_backend.set_kda_backend("naive")


def test_the_fla_wrapper_gives_fla_its_layout_and_returns_ours(fla_kernels) -> None:
    nv = load_fla_naive()
    fla_kernels(nv.naive_chunk_kda, nv.naive_recurrent_kda)
    x = _inputs(64)
    for fla_fn, ours in ((kda_backend.fla_recurrent, kda_recurrent), (kda_backend.fla_chunk, kda_chunk)):
        o_f, s_f = fla_fn(*x)
        o, s = ours(*x)
        assert o_f.shape == o.shape and s_f.shape == s.shape and o_f.dtype == s_f.dtype == torch.float32
        assert (o_f - o).abs().max().item() < TOL, fla_fn.__name__
        assert (s_f - s).abs().max().item() < TOL, fla_fn.__name__


def test_a_state_from_the_fla_side_resumes_on_ours(fla_kernels) -> None:
    """Same state bits in both directions: fla's final state feeds our recurrence and vice versa."""
    nv = load_fla_naive()
    fla_kernels(nv.naive_chunk_kda, nv.naive_recurrent_kda)
    q, k, v, g, beta, s0 = _inputs(48)
    _, s_fla = kda_backend.fla_recurrent(q[:32], k[:32], v[:32], g[:32], beta[:32], s0)
    _, s_ours = kda_recurrent(q[:32], k[:32], v[:32], g[:32], beta[:32], s0)
    tail = (q[32:], k[32:], v[32:], g[32:], beta[32:])
    o_a, _ = kda_recurrent(*tail, s_fla)
    o_b, _ = kda_backend.fla_recurrent(*tail, s_ours)
    assert (o_a - o_b).abs().max().item() < TOL


def test_an_unknown_backend_is_a_typed_error_naming_the_choices() -> None:
    with pytest.raises(UnsupportedConfigError, match="naive, fla"):
        kda_backend.set_kda_backend("cuda")
    assert kda_backend.kda_backend() == "naive"


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="triton present: fla may import")
def test_choosing_fla_where_its_kernels_cannot_import_is_a_typed_error() -> None:
    with pytest.raises(UnsupportedConfigError, match="fla-core"):
        kda_backend.set_kda_backend("fla")
    assert kda_backend.kda_backend() == "naive"


def test_the_model_under_the_fla_switch_matches_ours(fla_kernels) -> None:
    """Prefill (chunk calls) and decode (recurrent calls) through the switch, fla's naive math in the
    kernels' place: logits within rounding, greedy tokens identical."""
    nv = load_fla_naive()
    model = build_tiny(config=tiny_config(4))
    prompt = torch.randint(3, model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    ours_logits = model.prefill(prompt.tolist()).logits
    ours_tokens = model.generate(prompt.tolist(), 6, eos_ids=())
    calls: list[int] = []

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(a[0].shape[1])  # fla's q: [batch of one, T, H, dk]
        return nv.naive_recurrent_kda(*a, **kw)

    fla_kernels(counted, counted)
    kda_backend.set_kda_backend("fla")
    fla_logits = model.prefill(prompt.tolist()).logits
    fla_tokens = model.generate(prompt.tolist(), 6, eos_ids=())
    assert calls and max(calls) == 64  # the chunked prefill went through the switch, 64-token segments
    assert (fla_logits - ours_logits).abs().max().item() < 1e-4
    assert fla_tokens == ours_tokens
