"""Shared pytest fixtures. Kept minimal: only what several owners' tests need."""

from __future__ import annotations

import os

import pytest

# The vLLM connector's tests need vLLM, which lives in its own venv (.venv-vllm: vLLM pins transformers below
# the version our oracle needs); `make test` runs them there with KVPOOL_VLLM_TESTS=1, right after this suite.
collect_ignore = [] if os.environ.get("KVPOOL_VLLM_TESTS") == "1" else ["vllm_connector"]


@pytest.fixture
def torch_deterministic():
    """2 threads, deterministic algorithms, seed 0: bitwise comparisons assume the same kernels on both sides
    (reference overview §7.3 rule 3). Restores the previous settings afterwards."""
    import torch

    threads = torch.get_num_threads()
    was_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    yield torch
    torch.use_deterministic_algorithms(was_det)
    torch.set_num_threads(threads)
