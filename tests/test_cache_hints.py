"""The client's cache hints, checked at the gateway (``gateway/cache_hints.py``): what a deployment offers is
accepted and turned into retention spans at message ends; anything else is a 400 naming the allowed values.
The serving path (pins in the store, refusal over budget, session end) runs in test_gateway_cluster.py."""

from __future__ import annotations

import pytest
from kvpool.gateway.cache_hints import CacheHints, HintRules, parse_tiers
from kvpool.gateway.chat_template import TextCodec, render_chat
from kvpool.gateway.errors import InvalidRequest
from kvpool.gateway.schemas import ChatCompletionRequest, CompletionRequest
from kvpool.gateway.tenants import bound_salt
from kvpool.model.tokenizer import ByteTokenizer
from kvpool.worker.handoff import RetainSpan

RULES = HintRules(True, parse_tiers("5m,1h"))


def chat_body(messages: list[dict], **kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": messages, **kw})


def hints_of(body: ChatCompletionRequest, rules: HintRules = RULES) -> tuple[CacheHints, list[list[int]]]:
    ends: list[list[int]] = []
    render_chat(TextCodec(ByteTokenizer(512), 512), body.messages, "", None, ends)
    return rules.from_body(body, body.messages, ends), ends


def test_tiers_parse_and_bad_ones_are_named() -> None:
    assert parse_tiers("5m, 1h,24h") == {"5m": 300_000, "1h": 3_600_000, "24h": 86_400_000}
    for bad in ("", "5x", "0m", "48h"):
        with pytest.raises(ValueError):
            parse_tiers(bad)


def test_breakpoints_fall_at_message_and_part_ends_and_retention_covers_the_prompt() -> None:
    body = chat_body(
        [
            {"role": "system", "content": "be brief", "cache_control": {"type": "ephemeral"}},
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "a long document",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    },
                    {"type": "text", "text": "the question that changes"},
                ],
                "cache_control": None,  # null is no breakpoint
            },
        ],
        prompt_cache_key="conv-7",
        prompt_cache_retention="in-memory",  # the spelling some OpenAI SDKs send
    )
    hints, ends = hints_of(body)
    document_end = ends[0][-1] + len("<|user|>a long document")  # the byte tokenizer: one token a byte
    # per text part its end, then the message's end (after the end tag)
    assert ends[1] == [document_end, document_end + len("the question that changes"), ends[1][-1]]
    assert hints.session == "conv-7" and hints.tier == "1h"
    assert hints.retain == (
        RetainSpan(0, 300_000),
        RetainSpan(ends[0][-1], 300_000),
        RetainSpan(document_end, 3_600_000),
    )
    assert hints_of(chat_body([{"role": "user", "content": "hi"}]))[0] == CacheHints()


def test_a_client_salt_may_not_pose_as_a_bound_tenant() -> None:
    assert bound_salt("acme", "s") == "tenant:acme/s" and bound_salt(None, "s") == "s"
    with pytest.raises(InvalidRequest, match="reserved for API keys bound to tenants"):
        bound_salt(None, "tenant:acme/s")


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "allowed values: in_memory, 5m, 1h"),
        ({"prompt_cache_retention": 5}, "prompt_cache_retention", "valid string"),
        ({"prompt_cache_key": "k" * 257}, "prompt_cache_key", "256"),
        ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "messages[0].cache_control.ttl", "5m, 1h"),
        ({"cache_control": {"type": "persistent"}}, "messages[0].cache_control", "ephemeral"),
        ({"cache_control": {"type": "ephemeral", "scope": "x"}}, "messages[0].cache_control", "Extra inputs"),
    ],
)
def test_bad_hints_are_400s_naming_what_is_allowed(fields: dict, param: str, needle: str) -> None:
    message = {"role": "user", "content": "hi"}
    if "cache_control" in fields:
        message["cache_control"] = fields.pop("cache_control")
    try:
        body = chat_body([message], **fields)
    except ValueError as exc:  # schema-level (a number for a string): FastAPI answers it with a 400 too
        assert needle in str(exc)
        return
    with pytest.raises(InvalidRequest) as err:
        hints_of(body)
    assert err.value.status == 400 and err.value.param == param and needle in err.value.message


def test_more_than_four_breakpoints_and_hints_on_a_deployment_without_them() -> None:
    five = [{"role": "user", "content": "m", "cache_control": {"type": "ephemeral"}}] * 5
    hints, ends = hints_of(chat_body(five))  # the four deepest breakpoints are kept
    assert [s.upto_tokens for s in hints.retain] == [e[-1] for e in ends[1:]]
    off = HintRules(False, parse_tiers("5m"))
    for fields in ({"prompt_cache_key": "k"}, {"prompt_cache_retention": "in_memory"}):
        with pytest.raises(InvalidRequest, match="disabled on this deployment"):
            off.from_body(CompletionRequest.model_validate({"model": "tiny", "prompt": "hi", **fields}))
    with pytest.raises(InvalidRequest, match="disabled"):
        hints_of(chat_body(five[:1]), off)
    assert off.from_body(CompletionRequest.model_validate({"model": "tiny", "prompt": "hi"})) == CacheHints()
