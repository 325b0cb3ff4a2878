"""Prefill/decode engines in process over the MemoryStore: exactness vs the no-cache reference, policies,
fallbacks, sampling, batching, key derivation. The same paths over real processes: test_serving_grpc.py."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time

import cbor2
import pytest
import torch
from kvpool.cache.errors import CacheUnitError
from kvpool.cache.units import decode_kda_checkpoint, decode_mla_block
from kvpool.kvstore.keys import KDA_TAG, MLA_TAG, TAIL_TAG, kda_key, mla_key
from kvpool.model.cache_schema import FORMAT_VERSION
from kvpool.model.loader import load_model
from kvpool.model.tokenizer import ByteTokenizer
from kvpool.proto import common_pb2
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.worker.errors import BadRequestError, CacheFetchError
from kvpool.worker.handoff import PrefillRequest
from kvpool.worker.sampling import SamplingParams, StopChecker, sample

from kvpool.colocated import Colocated
from tests.harness.memory_store import MemoryStore

B = 64
GREEDY3 = SamplingParams(max_tokens=3)


@pytest.fixture(scope="module")
def model():
    """1 thread: both sides of every comparison run here, and 1 thread is not slowed by a busy box."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield load_model("tiny")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)


@pytest.fixture(scope="module")
def reference(model):
    ref = Colocated(model, None)
    cache: dict[tuple, object] = {}

    def run(prompt: list[int], sampling: SamplingParams = GREEDY3):
        key = (tuple(prompt), sampling)
        if key not in cache:
            req = PrefillRequest(f"ref-{len(cache)}", prompt, "t", sampling, use_cache=False)
            cache[key] = asyncio.run(ref.complete(req))
        return cache[key]

    return run


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def _complete(colo: Colocated, rid: str, prompt: list[int], sampling=GREEDY3, tenant="t"):
    return asyncio.run(colo.complete(PrefillRequest(rid, prompt, tenant, sampling)))


def test_cached_path_is_bitwise_the_reference(model, reference):
    """24 prompts over 3 shared prefixes (lengths cross block and checkpoint boundaries)."""
    rng = random.Random(1)
    store = MemoryStore()
    colo = Colocated(model, store)
    prefixes = [_rand(rng, n) for n in (64, 100, 150)]
    hits = 0
    for k in range(24):
        prompt = prefixes[k % 3] + _rand(rng, rng.randrange(1, 90))
        got = _complete(colo, f"r{k}", prompt)
        ref = reference(prompt)
        assert torch.equal(got.first_logits, ref.first_logits), k
        assert got.tokens == ref.tokens, k
        assert got.decode.resume.path == "tail"
        assert got.prefill.cached_tokens == got.prefill.fetch.used_blocks * B
        assert got.prefill.computed_tokens == len(prompt) - got.prefill.cached_tokens
        hits += got.prefill.cached_tokens > 0
    assert hits >= 18
    assert not any(k.startswith(TAIL_TAG) for k in store.meta), "tails are deleted after decode"


def test_every_stored_key_is_the_independent_block_hash(model):
    rng = random.Random(2)
    store = MemoryStore()
    colo = Colocated(model, store)
    prompt = _rand(rng, 3 * B + 10)
    _complete(colo, "k", prompt, SamplingParams(max_tokens=2))
    parent = hashlib.sha256(cbor2.dumps([FORMAT_VERSION, model.fingerprint(), "t"], canonical=True)).digest()
    root = parent
    chain = []
    for i in range(3):
        block = prompt[i * B : (i + 1) * B]
        parent = hashlib.sha256(cbor2.dumps([parent, block, None], canonical=True)).digest()
        chain.append(parent)
    schema = model.cache_schema(B)
    mla = sorted(k for k in store.meta if k.startswith(MLA_TAG))
    assert mla == sorted(MLA_TAG + h for h in chain)
    for i, h in enumerate(chain):
        assert decode_mla_block(store.objects[MLA_TAG + h], schema).block_hash == h
        assert decode_mla_block(store.objects[MLA_TAG + h], schema).block_index == i
    assert [k for k in store.meta if k.startswith(KDA_TAG)] == [KDA_TAG + chain[2]]  # end of prompt
    assert decode_kda_checkpoint(store.objects[KDA_TAG + chain[2]], schema).n_tokens == 3 * B
    # decode's pushes: the block closed by the output (prompt + consumed output tokens) and its checkpoint
    out = _complete(colo, "k2", prompt, SamplingParams(max_tokens=60, ignore_eos=True)).tokens
    consumed = prompt + out[:-1]
    parent = root
    for i in range(4):
        parent = hashlib.sha256(
            cbor2.dumps([parent, consumed[i * B : (i + 1) * B], None], canonical=True)
        ).digest()
    assert MLA_TAG + parent in store.meta and KDA_TAG + parent in store.meta
    assert decode_mla_block(store.objects[MLA_TAG + parent], schema).block_hash == parent
    assert (
        decode_kda_checkpoint(store.objects[KDA_TAG + parent], schema, expected_hash=parent).n_tokens == 4 * B
    )


def test_a_requests_whole_push_goes_out_as_one_batch(model):
    """Prefill: its tail, new MLA blocks and checkpoint in one batch_put (one control exchange for the
    request); decode: the blocks its output closed and their checkpoint in one more."""
    store = MemoryStore()
    colo = Colocated(model, store)
    prompt = _rand(random.Random(5), 3 * B + 10)
    _complete(colo, "one", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    kinds = {common_pb2.REQUEST_TAIL, common_pb2.MLA_BLOCK, common_pb2.KDA_CHECKPOINT}
    assert len(store.batches) == 2 and set(store.batches[0]) == kinds
    assert store.batches[0].count(common_pb2.MLA_BLOCK) == 3
    assert set(store.batches[1]) == {common_pb2.MLA_BLOCK, common_pb2.KDA_CHECKPOINT}


def test_second_turn_reuses_the_first(model, reference):
    """Turn 2 resumes from the end-of-output checkpoint decode pushed. Those latents/state come from 1-token
    decode steps, which differ from a prefill of the same tokens by ~1e-7 (overview §7.3), so turn 2 is
    compared to the no-cache reference within tolerance and on greedy tokens, not bitwise."""
    rng = random.Random(3)
    store = MemoryStore()
    colo = Colocated(model, store)
    prompt = _rand(rng, 100)
    t1 = _complete(colo, "turn1", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    consumed = len(prompt) + len(t1.tokens) - 1
    assert t1.decode.blocks_pushed == consumed // B - len(prompt) // B == 1
    assert t1.decode.checkpoint_pushed == (consumed // B) * B == 128
    prompt2 = prompt + t1.tokens + _rand(rng, 12)
    t2 = _complete(colo, "turn2", prompt2)
    assert t2.prefill.cached_tokens == 128
    ref = reference(prompt2)
    assert torch.allclose(t2.first_logits, ref.first_logits, atol=1e-5, rtol=1e-5)
    assert t2.tokens == ref.tokens


def test_junction_checkpoint_makes_the_next_request_hit(model, reference):
    rng = random.Random(4)
    shared = _rand(rng, 2 * B)
    for junction, want in ((True, 2 * B), (False, 0)):
        store = MemoryStore()
        colo = Colocated(model, store, policy=CheckpointPolicy(end_of_prompt=True, junction=junction))
        a = _complete(colo, "a", shared + _rand(rng, 2 * B + 5))  # checkpoint only at 4B
        assert a.prefill.checkpoints_pushed == [4 * B]
        b = _complete(colo, "b", shared + _rand(rng, B + 40))  # shares 2 blocks, no checkpoint there yet
        assert b.prefill.cached_tokens == 0 and b.prefill.lost_to_checkpoint == 2 * B
        assert b.prefill.checkpoints_pushed == ([2 * B, 3 * B] if junction else [3 * B])
        prompt = shared + _rand(rng, 30)
        c = _complete(colo, "c", prompt)
        assert c.prefill.cached_tokens == want
        assert torch.equal(c.first_logits, reference(prompt).first_logits)


def test_block_aligned_prompt_keeps_one_token_to_compute(model, reference):
    rng = random.Random(73)
    store = MemoryStore()
    colo = Colocated(model, store)
    prompt = _rand(rng, 2 * B)  # the tail holds 0 tokens, only the KDA state at L
    first = _complete(colo, "aligned1", prompt)
    again = _complete(colo, "aligned2", prompt)
    assert first.prefill.checkpoints_pushed == [B, 2 * B]
    assert again.prefill.cached_tokens == B and again.prefill.computed_tokens == B  # (L-1)//B blocks at most
    assert again.decode.resume.path == "tail"
    ref = reference(prompt)
    for got in (first, again):
        assert torch.equal(got.first_logits, ref.first_logits) and got.tokens == ref.tokens
    longer = prompt + _rand(rng, 3)
    assert _complete(colo, "aligned3", longer).prefill.cached_tokens == 2 * B


def test_every_n_blocks_policy():
    pol = CheckpointPolicy(end_of_prompt=False, junction=False, every_n_blocks=2)
    got = pol.boundaries(prompt_len=7 * B + 3, block_size=B, start_blocks=2, mla_run_blocks=2)
    assert got == [4 * B, 6 * B]
    pol = CheckpointPolicy()
    got = pol.boundaries(prompt_len=5 * B, block_size=B, start_blocks=1, mla_run_blocks=3, existing=[1])
    assert got == [3 * B, 4 * B, 5 * B]  # 4B: a block-aligned prompt sent again resumes there
    assert CheckpointPolicy.parse("end,every=3") == CheckpointPolicy(True, False, 3, end_of_output=False)
    with pytest.raises(ValueError):
        CheckpointPolicy.parse("sometimes")


def test_corrupt_checkpoint_is_detected_recomputed_and_rewritten(model, reference):
    rng = random.Random(5)
    store = MemoryStore()
    colo = Colocated(model, store)
    prompt = _rand(rng, 3 * B + 20)
    _complete(colo, "w", prompt)
    ck = kda_key(colo.prefill.hashes(prompt, "t")[2])
    store.corrupt(ck)
    got = _complete(colo, "r", prompt)
    assert got.prefill.fetch.corrupt == 1 and got.prefill.recomputed_tokens == 3 * B
    assert got.prefill.cached_tokens == 0
    assert torch.equal(got.first_logits, reference(prompt).first_logits)
    assert got.tokens == reference(prompt).tokens
    decode_kda_checkpoint(store.objects[ck], model.cache_schema(B))  # the recomputed copy replaced it
    again = _complete(colo, "r2", prompt)
    assert again.prefill.cached_tokens == 3 * B


def test_corrupt_mla_block_and_lost_tail_still_give_the_reference(model, reference):
    rng = random.Random(6)
    store = MemoryStore()
    colo = Colocated(model, store)
    prompt = _rand(rng, 2 * B + 30)
    _complete(colo, "w", prompt)
    store.corrupt(mla_key(colo.prefill.hashes(prompt, "t")[1]), offset=4000)
    with pytest.raises(CacheUnitError):
        decode_mla_block(store.objects[mla_key(colo.prefill.hashes(prompt, "t")[1])], model.cache_schema(B))
    got = _complete(colo, "r", prompt)
    assert got.prefill.fetch.corrupt == 1 and got.prefill.cached_tokens == 0
    assert got.tokens == reference(prompt).tokens
    # the decode side: tail lost -> recompute from the best checkpoint, same tokens
    orig = store.batch_put

    async def drop_tails(items):
        await orig([i for i in items if not i.key.startswith(TAIL_TAG)])
        return [None] * len(items)

    store.batch_put = drop_tails  # tail "stored" but gone
    got = _complete(colo, "r3", prompt)
    assert got.decode.resume.path == "recompute" and got.decode.resume.fetched_tokens == 2 * B
    assert got.tokens == reference(prompt).tokens


def test_unreachable_store_serves_without_cache_or_fails_when_asked(model, reference):
    rng = random.Random(7)
    store = MemoryStore()
    store.unreachable = True
    prompt = _rand(rng, B + 10)
    got = _complete(Colocated(model, store), "u", prompt)
    assert got.prefill.cached_tokens == 0 and got.prefill.fetch.error
    assert got.decode.resume.path == "recompute"
    assert got.tokens == reference(prompt).tokens
    with pytest.raises(CacheFetchError):
        _complete(Colocated(model, store, on_cache_error="fail"), "f", prompt)


def test_black_holed_store_costs_one_deadline_per_side(model, reference):
    """A store that never answers: each worker waits out one lookup deadline, then computes; no pushes."""
    rng = random.Random(71)
    store = MemoryStore()
    store.delay_s = 30.0
    colo = Colocated(model, store)
    colo.prefill.timeout_s = colo.decode.timeout_s = 0.2
    prompt = _rand(rng, B + 30)
    t0 = time.perf_counter()
    got = _complete(colo, "hole", prompt)
    assert time.perf_counter() - t0 < 5.0
    assert got.prefill.fetch.error and not got.prefill.handoff.tail_stored
    assert got.decode.resume.path == "recompute" and got.decode.resume.store_error
    assert got.tokens == reference(prompt).tokens and store.puts == 0


def test_cancelled_stream_still_deletes_the_tail(model):
    rng = random.Random(72)
    store = MemoryStore()
    colo = Colocated(model, store)

    async def go():
        req = PrefillRequest("cancel", _rand(rng, 70), "t", SamplingParams(max_tokens=50, ignore_eos=True))
        outcome = await colo.prefill.run(req)
        assert outcome.handoff.tail_stored and outcome.handoff.tail_key in store.meta
        stream = colo.decode.generate(outcome.handoff)
        first = await anext(stream)
        await anext(stream)
        await stream.aclose()  # the client went away after two tokens
        return first, outcome.handoff.tail_key

    first, key = asyncio.run(go())
    assert first.index == 0 and key not in store.meta


def test_no_cache_requests_write_nothing_back(model, reference):
    rng = random.Random(74)
    store = MemoryStore()
    colo = Colocated(model, store)
    prompt = _rand(rng, 2 * B + 9)
    sp = SamplingParams(max_tokens=70, ignore_eos=True)  # output crosses a block boundary
    req = PrefillRequest("nc", prompt, "t", sp, use_cache=False)
    in_memory = asyncio.run(colo.complete(req))  # the colocated reference: state handed over in memory
    assert store.puts == 0 and in_memory.tokens == reference(prompt, sp).tokens

    async def through_the_store():  # disaggregated shape: tail + short-lived blocks, no checkpoint
        outcome = await colo.prefill.run(PrefillRequest("nc2", prompt, "t", sp, use_cache=False))
        assert outcome.handoff.tail_stored and not outcome.handoff.use_cache
        return [e async for e in colo.decode.generate(outcome.handoff)][-1]

    final = asyncio.run(through_the_store())
    assert final.tokens == in_memory.tokens and final.resume.path == "tail"
    assert not any(k.startswith((KDA_TAG, TAIL_TAG)) for k in store.meta)  # tail read and removed
    assert all(m.ttl_ms > 0 for m in store.meta.values()) and len(store.meta) == 2  # 2 blocks, expiring


def test_bad_requests_are_typed(model):
    colo = Colocated(model, MemoryStore())
    for prompt, sampling in (
        ([], SamplingParams()),
        ([5, 5000], SamplingParams()),
        ([5, -1], SamplingParams()),
        ([5], SamplingParams(temperature=-1)),
        ([5], SamplingParams(top_p=0)),
        ([5], SamplingParams(max_tokens=0)),
    ):
        with pytest.raises(BadRequestError):
            _complete(colo, "bad", prompt, sampling)


def test_seeded_sampling_is_reproducible_across_paths(model, reference):
    rng = random.Random(8)
    prompt = _rand(rng, 90)
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=6, ignore_eos=True)
    colo = Colocated(model, MemoryStore())
    a = _complete(colo, "s1", prompt, sp)
    assert a.tokens == reference(prompt, sp).tokens
    other = reference(prompt, SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=8, max_tokens=6))
    assert other.tokens != a.tokens
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1, seed=3), 5) == int(logits.argmax())


def test_stop_strings_cut_the_text():
    tok = ByteTokenizer(1024)
    stop = StopChecker(tok, ("lo w",))
    ids = tok.encode("hello world")[1:]
    ended = [stop.push(t) for t in ids]
    assert ended.index(True) == 6 and stop.text == "hel"


@pytest.mark.parametrize("tokenizer", ["bytes", "tiny-bpe"])
def test_streamed_deltas_add_up_and_never_take_text_back(tokenizer):
    """Held back: a possible stop-string start and an unfinished UTF-8 character ("€" is 3 bytes; with the
    trained tiny's byte-level BPE an emoji spans several tokens too)."""
    from kvpool.model.tiny import tiny_config
    from kvpool.model.tokenizer import load_tokenizer

    tok = ByteTokenizer(1024) if tokenizer == "bytes" else load_tokenizer("tiny", tiny_config())
    for text, stops, want in (
        ("hello world", ("lo w",), "hel"),
        ("a€b lo", (), "a€b lo"),
        ("xyz", ("q",), "xyz"),
        ("def f():\n    return '🙂 ok'", (), "def f():\n    return '🙂 ok'"),
    ):
        stop = StopChecker(tok, stops)
        ids = tok.encode(text)[1:]
        shown, deltas = "", []
        for i, t in enumerate(ids):
            done = stop.push(t) or i == len(ids) - 1
            visible = stop.visible(final=done)
            assert visible.startswith(shown)
            deltas.append(visible[len(shown) :])
            shown = visible
            if done:
                break
        assert "".join(deltas) == stop.text == want
        assert "\ufffd" not in "".join(deltas)


class WordTokenizer:
    """Each id is a word: stop strings then name exact token runs."""

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)


def test_stop_string_ends_generation_in_the_engine(model, reference):
    rng = random.Random(10)
    prompt = _rand(rng, 80)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = reference(prompt, sp).tokens
    colo = Colocated(model, MemoryStore(), tokenizer=WordTokenizer())
    stop = f" {want[3]} {want[4]}"
    got = _complete(colo, "stop", prompt, SamplingParams(max_tokens=8, ignore_eos=True, stop=(stop,)))
    assert got.decode.finish_reason == "stop" and got.tokens == want[:5]
    text = WordTokenizer().decode(want[:5])
    assert got.decode.text == text[: text.find(stop)]


@pytest.mark.parametrize("held_back", [False, True])
def test_prefills_first_text_and_decodes_later_deltas_add_up_to_the_text(model, reference, held_back):
    """The gateway streams token 0's text from the prefill reply, then decode's deltas from token 1 on: the
    two must join without a gap or a repeat, also when token 0's text is held back (a possible stop start)."""
    prompt = _rand(random.Random(11), 80)
    want = reference(prompt, SamplingParams(max_tokens=6, ignore_eos=True)).tokens
    stops = (f" {want[0]} {want[1]} x",) if held_back else ()
    sp = SamplingParams(max_tokens=6, ignore_eos=True, stop=stops)
    colo = Colocated(model, MemoryStore(), tokenizer=WordTokenizer())

    async def go():
        outcome = await colo.prefill.run(PrefillRequest("text", prompt, "t", sp))
        return outcome, [e async for e in colo.decode.generate(outcome.handoff)]

    outcome, (*events, result) = asyncio.run(go())
    assert outcome.first_text == ("" if held_back else f" {want[0]}") == events[0].text
    assert outcome.first_text + "".join(e.text for e in events[1:]) == result.text
    assert result.text == WordTokenizer().decode(want)


def test_concurrent_requests_batch_and_match_sequential(model, reference):
    rng = random.Random(9)
    prompts = [_rand(rng, n) for n in (70, 130, 20, 64)]
    colo = Colocated(model, MemoryStore())
    sp = SamplingParams(max_tokens=5, ignore_eos=True)

    async def all_at_once():
        reqs = [PrefillRequest(f"c{i}", p, "t", sp) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(colo.complete(r) for r in reqs))

    got = asyncio.run(all_at_once())
    for p, g in zip(prompts, got, strict=True):
        assert g.tokens == reference(p, sp).tokens
    assert colo.decode.batcher.max_batch_seen > 1
