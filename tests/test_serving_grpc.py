"""Disaggregated serving over real processes: master + storage node + prefill + decode workers on loopback
(``tests.harness.clusters.worker_cluster``), compared with the colocated no-cache reference computed in this
process."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvpool.cache.hashing import hash_blocks, root_hash
from kvpool.kvstore.client.async_client import AsyncStoreClient
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.model.loader import load_model
from kvpool.proto import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from kvpool.worker.client import DisaggClient
from kvpool.worker.handoff import PrefillRequest
from kvpool.worker.sampling import SamplingParams
from kvpool.worker.wire import request_to_pb

from kvpool.colocated import Colocated
from tests.harness.clusters import worker_cluster

B = 64
GREEDY3 = SamplingParams(max_tokens=3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with worker_cluster(tmp_path_factory.mktemp("serving")) as c:
        yield c


@pytest.fixture(scope="module")
def model():
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)  # the cluster's workers run --threads 1: same kernels on both sides
    torch.use_deterministic_algorithms(True)
    yield load_model("tiny")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)


@pytest.fixture(scope="module")
def reference(model):
    ref = Colocated(model)

    def run(prompt, sampling=GREEDY3):
        return asyncio.run(ref.complete(PrefillRequest("ref", prompt, "t", sampling, use_cache=False)))

    return run


def workers(cluster) -> tuple[str, str]:
    """The cluster's prefill and decode addresses."""
    return cluster.address("prefill-0"), cluster.address("decode-0")


def remote(where: tuple[str, str], requests):
    """``requests`` completed one after another through the prefill and decode workers at ``where``."""

    async def go():
        client = DisaggClient(*where, timeout_s=60)
        try:
            return [await client.complete(r) for r in requests]
        finally:
            await client.close()

    return asyncio.run(go())


class PolicySim:
    """Independent model of what the store holds after each request (default policy: end of prompt +
    junction), to predict the cached tokens the workers must report."""

    def __init__(self) -> None:
        self.blocks: set[tuple] = set()
        self.ckpts: set[tuple] = set()

    def run(self, prompt: list[int]) -> int:
        L = len(prompt)
        n_full, cap = L // B, (L - 1) // B
        run = 0
        while run < cap and tuple(prompt[: (run + 1) * B]) in self.blocks:
            run += 1
        usable = max([c for c in range(1, run + 1) if tuple(prompt[: c * B]) in self.ckpts], default=0)
        for c in range(1, n_full + 1):
            self.blocks.add(tuple(prompt[: c * B]))
        for end in {n_full, cap}:  # end of prompt (and one block earlier when L is block-aligned)
            if end > usable:
                self.ckpts.add(tuple(prompt[: end * B]))
        if run > usable:
            self.ckpts.add(tuple(prompt[: min(run, n_full) * B]))
        return usable * B


def test_fifty_prompts_bitwise_equal_to_the_no_cache_reference(cluster, reference):
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 1000) for _ in range(n)] for n in (64, 110, 150, 200)]
    prompts = []
    for k in range(52):
        head = prefixes[k % 4][: rng.choice((64, 128, 200))]
        prompts.append(head + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 80))])
    requests = [PrefillRequest(f"p50-{k}", p, "t50", GREEDY3) for k, p in enumerate(prompts)]
    t0 = time.perf_counter()
    got = remote(workers(cluster), requests)
    elapsed = time.perf_counter() - t0
    sim = PolicySim()
    identical = 0
    for k, (p, g) in enumerate(zip(prompts, got, strict=True)):
        ref = reference(p)
        assert torch.equal(g.first_logits, ref.first_logits), k
        assert g.tokens == ref.tokens, k
        identical += g.tokens == ref.tokens
        assert g.prefill.cached_tokens == sim.run(p), k
        assert g.decode.resume_path == "tail", (k, g.decode.resume_reason)
        assert g.prefill.cached_tokens + g.prefill.computed_tokens == len(p)
    assert identical == len(prompts)
    assert sum(g.prefill.cached_tokens > 0 for g in got) >= 30
    print(f"52 disaggregated requests in {elapsed:.1f}s")


def test_stored_keys_are_the_independent_hash_chain(cluster, model):
    rng = random.Random(12)
    prompt = [rng.randrange(3, 1000) for _ in range(3 * B + 7)]
    remote(workers(cluster), [PrefillRequest("keys", prompt, "tk", GREEDY3)])
    hashes = hash_blocks(prompt, B, root_hash(model.fingerprint(), "tk"))

    async def probe():
        async with AsyncStoreClient(cluster.master_address, "tcp") as c:
            return await c.batch_exists([*map(mla_key, hashes), *map(kda_key, hashes)])

    exists = asyncio.run(probe())
    assert exists == [True, True, True, False, False, True]  # 3 blocks; checkpoint at end of prompt only


def test_second_turn_hits_the_first_turns_output(cluster, reference):
    """Decode pushed the output's blocks + an end-of-output checkpoint computed by 1-token steps; turn 2
    resumes there. Those bits differ from a prefill of the same tokens by ~1e-7 (overview §7.3), so turn 2
    is checked against the reference with a tolerance and on its greedy tokens."""
    rng = random.Random(13)
    prompt = [rng.randrange(3, 1000) for _ in range(90)]
    sp = SamplingParams(max_tokens=45, ignore_eos=True)
    (t1,) = remote(workers(cluster), [PrefillRequest("turn1", prompt, "tt", sp)])
    assert t1.tokens == reference(prompt, sp).tokens
    assert t1.decode.checkpoint_pushed == 128 and t1.decode.blocks_pushed == 1
    prompt2 = prompt + t1.tokens + [rng.randrange(3, 1000) for _ in range(20)]
    (t2,) = remote(workers(cluster), [PrefillRequest("turn2", prompt2, "tt", GREEDY3)])
    assert t2.prefill.cached_tokens == 128
    ref = reference(prompt2)
    assert torch.allclose(t2.first_logits, ref.first_logits, atol=1e-5, rtol=1e-5)
    assert t2.tokens == ref.tokens


def test_corrupt_stored_object_is_detected_and_recomputed(cluster, reference, model):
    """A unit with a valid store checksum but wrong contents (another block's checkpoint under this key)."""
    rng = random.Random(14)
    prompt = [rng.randrange(3, 1000) for _ in range(2 * B + 30)]
    other = [rng.randrange(3, 1000) for _ in range(2 * B + 30)]
    remote(workers(cluster), [PrefillRequest("other", other, "tc", GREEDY3)])
    hashes = hash_blocks(prompt, B, root_hash(model.fingerprint(), "tc"))
    other_hashes = hash_blocks(other, B, root_hash(model.fingerprint(), "tc"))

    async def plant():
        async with AsyncStoreClient(cluster.master_address, "tcp") as c:
            good = await c.batch_get(
                [mla_key(other_hashes[0]), mla_key(other_hashes[1]), kda_key(other_hashes[1])]
            )
            # blocks copied under this prompt's keys: wrong hash in their headers
            await c.put(mla_key(hashes[0]), good[0], kind=1, tenant="tc")
            await c.put(mla_key(hashes[1]), good[1], kind=1, parent=mla_key(hashes[0]), tenant="tc")
            await c.put(kda_key(hashes[1]), good[2], kind=2, parent=mla_key(hashes[1]), tenant="tc")

    asyncio.run(plant())
    (got,) = remote(workers(cluster), [PrefillRequest("victim", prompt, "tc", GREEDY3)])
    assert got.prefill.cached_tokens == 0 and got.prefill.recomputed_tokens == 2 * B
    ref = reference(prompt)
    assert torch.equal(got.first_logits, ref.first_logits) and got.tokens == ref.tokens
    (again,) = remote(workers(cluster), [PrefillRequest("victim2", prompt, "tc", GREEDY3)])
    assert again.prefill.cached_tokens == 2 * B, "the bad units were removed and rewritten"
    assert torch.equal(again.first_logits, ref.first_logits)


def test_bad_requests_are_invalid_argument(cluster):
    async def go():
        async with grpc.aio.insecure_channel(cluster.address("prefill-0")) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            codes = []
            for prompt, sp in (([], GREEDY3), ([5, 99999], GREEDY3), ([5], SamplingParams(top_p=2.0))):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Prefill(request_to_pb(PrefillRequest("bad", prompt, "t", sp)), timeout=10)
                codes.append(info.value.code())
            health = health_pb2_grpc.HealthStub(ch)
            status = await health.Check(health_pb2.HealthCheckRequest(service="kvpool.v1.Prefill"), timeout=5)
            reply = await stub.Prefill(
                request_to_pb(PrefillRequest("ok", [5, 6, 7], "t", GREEDY3)), timeout=30
            )
        async with grpc.aio.insecure_channel(cluster.address("decode-0")) as ch:
            bad = handoff_to_pb_with_wrong_hash(reply.handoff)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in decode_pb2_grpc.DecodeStub(ch).Generate(
                    decode_pb2.GenerateRequest(handoff=bad), timeout=10
                ):
                    pass
            codes.append(info.value.code())
        return codes, status

    codes, status = asyncio.run(go())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_sampling_stop_strings_and_deadlines_over_grpc(cluster, reference):
    rng = random.Random(16)
    prompt = [rng.randrange(3, 1000) for _ in range(120)]
    sp = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=5, max_tokens=8, ignore_eos=True)
    (got,) = remote(workers(cluster), [PrefillRequest("sampled", prompt, "ts", sp)])
    assert got.tokens == reference(prompt, sp).tokens  # prefill draws step 0, decode steps 1.. (seeded)
    text = "".join(c.text for c in got.chunks[:-1])
    assert text == got.text
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    (full,) = remote(workers(cluster), [PrefillRequest("nostop", prompt, "ts", greedy)])

    async def too_short():
        client = DisaggClient(*workers(cluster), timeout_s=0.001)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete(PrefillRequest("late", prompt, "ts", greedy))
            return info.value.code()
        finally:
            await client.close()

    assert asyncio.run(too_short()) == grpc.StatusCode.DEADLINE_EXCEEDED
    (after,) = remote(workers(cluster), [PrefillRequest("after-deadline", prompt, "ts", greedy)])
    assert after.tokens == full.tokens


def handoff_to_pb_with_wrong_hash(handoff):
    bad = type(handoff)()
    bad.CopyFrom(handoff)
    bad.prompt_ids[0] = (bad.prompt_ids[0] + 1) % 1000  # prompt no longer matches the (empty) hash list
    bad.block_hashes.append(b"\0" * 32)
    return bad


def test_killing_the_storage_node_mid_request_still_gives_the_reference(cluster, reference):
    """Deterministic cut: prefill stored the tail, the node dies, decode must recompute. Plus four concurrent
    requests with the node killed while they run (fetch, push or tail read fails somewhere)."""
    rng = random.Random(15)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (150, 200, 170, 140)]
    remote(workers(cluster), [PrefillRequest(f"warm{k}", p, "tkill", GREEDY3) for k, p in enumerate(prompts)])
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    cut = [rng.randrange(3, 1000) for _ in range(100)]

    async def go():
        client = DisaggClient(*workers(cluster), timeout_s=60)
        try:
            reply = await client.prefill(PrefillRequest("cut", cut, "tkill", sp))
            assert reply.handoff.tail_stored
            jobs = [
                asyncio.create_task(client.complete(PrefillRequest(f"kill{k}", p + [7] * k, "tkill", sp)))
                for k, p in enumerate(prompts)
            ]
            await asyncio.sleep(0.05)
            cluster.services["node-0"].kill()
            chunks = [
                c
                async for c in client.decode_stub.Generate(
                    decode_pb2.GenerateRequest(handoff=reply.handoff), timeout=60
                )
            ]
            return reply, chunks, await asyncio.gather(*jobs)
        finally:
            await client.close()

    try:
        reply, chunks, got = asyncio.run(go())
        assert chunks[-1].usage.resume_path == "recompute" and chunks[-1].usage.recomputed_tokens == 100
        assert [reply.first_token, *(c.token_id for c in chunks[:-1])] == reference(cut, sp).tokens
        for k, (p, g) in enumerate(zip(prompts, got, strict=True)):
            ref = reference(p + [7] * k, sp)
            assert torch.equal(g.first_logits, ref.first_logits), k
            assert g.tokens == ref.tokens, k
        # with the node gone for good the workers serve without cache
        (late,) = remote(workers(cluster), [PrefillRequest("after", prompts[0], "tkill", sp)])
        assert late.tokens == reference(prompts[0], sp).tokens
        assert late.prefill.cached_tokens == 0
    finally:
        cluster.restart("node-0")


@pytest.mark.slow  # starts three more worker processes (~15 s on 2 busy cores)
def test_unreachable_store_serves_without_cache_or_fails_when_asked(tmp_path, reference):
    """Workers whose master does not answer: default policy serves from scratch, `fail` refuses."""
    from concurrent.futures import ThreadPoolExecutor

    from kvpool.runtime.spawn import spawn

    common = ["--master", "127.0.0.1:9", "--model", "tiny", "--store-timeout", "1", "--threads", "1"]
    specs = [
        ("prefill", [*common]),
        ("decode", [*common]),
        ("prefill", [*common, "--on-cache-error", "fail"]),
    ]
    with ThreadPoolExecutor(3) as pool:
        children = list(pool.map(lambda s: spawn(s[0], ["kvpool", s[0], *s[1]], tmp_path), specs))
    try:
        prompt = list(range(3, 3 + 150))
        (got,) = remote(
            (children[0].address, children[1].address),
            [PrefillRequest("nostore", prompt, "t", GREEDY3)],
        )
        assert got.prefill.cached_tokens == 0 and got.prefill.cache_error
        assert got.decode.resume_path == "recompute"
        assert got.tokens == reference(prompt).tokens

        async def refused():
            async with grpc.aio.insecure_channel(children[2].address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await prefill_pb2_grpc.PrefillStub(ch).Prefill(
                        request_to_pb(PrefillRequest("f", prompt, "t", GREEDY3)), timeout=30
                    )
                return info.value

        err = asyncio.run(refused())
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "CacheFetchError" in err.details()
    finally:
        for child in children:
            child.stop()


def test_verify_against_given_workers(cluster):
    """`kvpool verify --prefill/--decode` path: the fixed prompt set against this module's workers, held to
    what test_verify.py asked of `kvpool verify --json` on its own cluster of the same shape (that launcher
    path stays tested by test_model_dsa_verify.py, `kvpool verify --model tiny-dsa-fp8 --json`)."""
    from kvpool.verify import prompt_set, run_verify

    report = asyncio.run(run_verify("tiny", *workers(cluster), tenant="given"))
    n = len(prompt_set()) + sum(c.follow_up is not None for c in prompt_set())
    assert report.requests == report.identical == n and report.ok
    assert report.max_logit_diff <= 1e-4 and report.cached_tokens_verified
    assert report.cached_tokens > report.prompt_tokens // 3
    assert all(r.bitwise_logits for r in report.rows if not r.name.endswith("turn2"))
    assert all(r.cached_tokens > 0 for r in report.rows if r.name.endswith("turn2"))


def test_colocated_worker_serves_both_contracts(cluster, reference, tmp_path):
    """`kvpool decode --colocated`: one process, one model thread, Prefill + Decode on one port."""
    from kvpool.runtime.spawn import spawn

    child = spawn(
        "colocated",
        ["kvpool", "decode", "--colocated", "--master", cluster.master_address, "--threads", "1"],
        tmp_path,
    )
    try:
        assert child.ready["role"] == "prefill+decode"
        rng = random.Random(17)
        head = [rng.randrange(3, 1000) for _ in range(130)]
        prompts = [head + [rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40)]
        where = (child.address, child.address)
        got = remote(where, [PrefillRequest(f"colo{k}", p, "tcolo", GREEDY3) for k, p in enumerate(prompts)])
        for p, g in zip(prompts, got, strict=True):
            ref = reference(p)
            assert torch.equal(g.first_logits, ref.first_logits) and g.tokens == ref.tokens
        assert got[1].prefill.cached_tokens == 128
    finally:
        child.stop()
