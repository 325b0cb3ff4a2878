"""The runnable disaggregated example (``deploy/vllm/prefill_decode.py``): a ``kv_producer`` engine
prefills, a separate ``kv_consumer`` engine gets every usable chunk from kvpool and generates exactly what
an engine without any connector generates; the consumer writes nothing to the store."""

from __future__ import annotations

import pytest

from tests.vllm_connector.conftest import PD_PROMPTS

pytestmark = pytest.mark.slow


def test_the_consumer_decodes_from_what_the_producer_prefilled(pd_example, baseline) -> None:
    """``pd_example`` started with the suite's first engines (its runs overlap their boots): awaited here."""
    run = pd_example.result(timeout=600)
    assert [p["cached_tokens"] for p in run["produced"]] == [0, 0]
    assert run["stored"] == sum(len(p) // 64 for p in PD_PROMPTS)
    consumed = run["consumed"]
    assert [p["cached_tokens"] for p in consumed] == [(len(p) - 1) // 64 * 64 for p in PD_PROMPTS]
    assert [p["tokens"] for p in consumed] == baseline["pd"]
    assert run["stored_after"] == run["stored"]  # a consumer never saves
