"""The hybrid policy (and ``depth``, its depth-weighted recency): dead blocks first, and admission control
(ghosts, tickets, the adaptive sampling rate), on the index itself and through the master's PutStart."""

from __future__ import annotations

import contextlib

import pytest
from kvpool.kvstore.index.admission import AdmissionConfig
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import NotAdmittedError, ObjectKind
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.kvstore.master.core import MasterConfig, MasterCore
from kvpool.proto import common_pb2, master_pb2

from tests.harness.chains import chain
from tests.harness.clock import Clock

MLA, KDA = ObjectKind.MLA, ObjectKind.KDA
REFUSE_NEW = AdmissionConfig(initial_rate=0.0, min_rate=0.0)  # only continuations get in


def index(
    cap: int = 1000, admission: AdmissionConfig | None = None, policy: str = "hybrid"
) -> tuple[PrefixIndex, Clock]:
    clock = Clock(100.0)
    idx = PrefixIndex(policy, clock=clock, high_watermark=0.9, low_watermark=0.8, admission=admission)
    idx.add_node("n", cap)
    return idx, clock


def put_chain(idx: PrefixIndex, hs: list[bytes], *, ck_at: tuple[int, ...] = (), size: int = 10) -> None:
    parent = b""
    for i, h in enumerate(hs):
        if mla_key(h) not in idx:
            idx.insert(mla_key(h), MLA, size, node_id="n", parent=parent)
        parent = mla_key(h)
        if i + 1 in ck_at and kda_key(h) not in idx:
            idx.insert(kda_key(h), KDA, size, node_id="n")


def evicted(idx: PrefixIndex) -> list[bytes]:
    return [e.key for e in idx.drain_events() if not e.demoted]


def test_dead_blocks_go_before_any_checkpoint_even_when_newer() -> None:
    idx, clock = index(cap=100)
    old = chain(3, "old")
    put_chain(idx, old, ck_at=(3,))  # 40 bytes, all usable
    clock.t += 50
    new = chain(4, "new")
    put_chain(idx, new, ck_at=(2,))  # blocks 3 and 4 hang past the last checkpoint: dead weight
    clock.t += 1
    idx.insert(b"x", ObjectKind.BLOB, 5, node_id="n")  # 40 + 50 + 5 > 90: evict down to 80
    gone = evicted(idx)
    assert gone == [mla_key(new[3]), mla_key(new[2])]
    assert kda_key(old[2]) in idx and kda_key(new[1]) in idx


def test_a_deeper_checkpoint_may_be_older() -> None:
    # policy depth (the recency side of the default), depth_weight 0.5: 16 blocks deep against 1 block is
    # worth 2 doublings of age (4x as old)
    idx, clock = index(cap=1000, policy="depth")
    deep, shallow = chain(16, "deep"), chain(1, "shallow")
    put_chain(idx, deep, ck_at=(16,), size=5)  # written at t=100
    clock.t = 200.0
    put_chain(idx, shallow, ck_at=(1,), size=5)  # written at t=200
    clock.t = 260.0  # ages 160 s and 60 s: deep is 2.7x older, under 4x
    ranked = idx.eviction_scores([kda_key(deep[-1]), kda_key(shallow[0])])
    assert ranked[0] > ranked[1]  # the shallow one goes first
    clock.t = 1000.0  # ages 900 s and 800 s: both old, deep wins by depth alone
    ranked = idx.eviction_scores([kda_key(deep[-1]), kda_key(shallow[0])])
    assert ranked[0] > ranked[1]
    idx2, clock2 = index(cap=1000, policy="depth")
    put_chain(idx2, deep, ck_at=(16,), size=5)
    clock2.t = 110.0
    put_chain(idx2, shallow, ck_at=(1,), size=5)
    clock2.t = 112.0  # ages 12 s and 2 s: deep is 6x older, over 4x: it goes first
    ranked = idx2.eviction_scores([kda_key(deep[-1]), kda_key(shallow[0])])
    assert ranked[0] < ranked[1]


def test_a_new_chain_sampled_out_is_refused_whole_and_remembered() -> None:
    idx, _ = index(admission=REFUSE_NEW)
    hs = chain(5, "a")
    m = idx.match_prefix(hs[:4], touch=True)  # the writer's fetch: nothing cached, a new chain
    assert m.usable_blocks == 0
    with pytest.raises(NotAdmittedError):
        idx.insert(mla_key(hs[0]), MLA, 10, node_id="n")
    with pytest.raises(NotAdmittedError):
        idx.insert(kda_key(hs[3]), KDA, 10, node_id="n")
    # block 4 was not in the lookup (no ticket): it follows its refused parent
    with pytest.raises(NotAdmittedError):
        idx.insert(mla_key(hs[4]), MLA, 10, node_id="n", parent=mla_key(hs[3]))
    assert len(idx) == 0 and idx.admission is not None and idx.admission.refused == 3
    # an object without a lookup and without a refused parent is admitted (a plain put)
    idx.insert(mla_key(chain(1, "other")[0]), MLA, 10, node_id="n")
    assert len(idx) == 1
    # the same new chain under a client's retention hint: admission does not turn it away
    for i, h in enumerate(hs):
        idx.insert(mla_key(h), MLA, 10, node_id="n", parent=mla_key(hs[i - 1]) if i else b"", admit=False)
    assert len(idx) == 6 and idx.admission.refused == 3


def test_a_continuation_of_a_refused_chain_is_admitted_and_raises_the_rate() -> None:
    idx, _ = index(admission=AdmissionConfig(initial_rate=0.0, min_rate=0.0, step=1.0))
    first = chain(8, "conv")
    idx.match_prefix(first, touch=True)
    for h in first:
        with pytest.raises(NotAdmittedError):
            idx.insert(mla_key(h), MLA, 10, node_id="n")
    assert idx.admission is not None and idx.admission.rate == 0.0
    turn2 = [*first, *chain(2, "turn2")]
    idx.match_prefix(turn2, touch=True)  # walks 8 ghosts of 10 blocks: a continuation
    assert idx.admission.rate == pytest.approx(80 / 1000)  # step x refused bytes / capacity
    put_chain(idx, turn2, ck_at=(10,))
    assert idx.match_prefix(turn2).usable_blocks == 10


def test_unread_evictions_lower_the_rate_and_large_caches_keep_it_at_one() -> None:
    small, clock = index(cap=100, admission=AdmissionConfig(step=1.0))
    for k in range(6):
        clock.t += 1
        hs = chain(2, f"once{k}")
        small.match_prefix(hs, touch=True)
        with contextlib.suppress(NotAdmittedError):
            put_chain(small, hs, ck_at=(2,))
    assert small.admission is not None and small.admission.rate < 1.0
    big, clock = index(cap=10_000, admission=AdmissionConfig(step=1.0))
    for k in range(6):
        clock.t += 1
        hs = chain(2, f"once{k}")
        big.match_prefix(hs, touch=True)
        put_chain(big, hs, ck_at=(2,))
    assert big.admission is not None and big.admission.rate == 1.0 and big.admission.refused == 0


def test_a_ticket_expires_and_the_put_follows_its_chain() -> None:
    idx, clock = index(admission=AdmissionConfig(initial_rate=0.0, min_rate=0.0, ticket_ms=1000))
    hs = chain(2, "late")
    idx.match_prefix(hs, touch=True)
    clock.t += 5  # the puts come long after the lookup: no verdict left, nothing refused before them
    put_chain(idx, hs, ck_at=(2,))
    assert idx.match_prefix(hs).usable_blocks == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"continuation_fraction": 1.5},
        {"step": -0.1},
        {"min_rate": 0.5, "initial_rate": 0.2},
        {"ticket_ms": 0},
        {"ghost_entries": -1},
    ],
)
def test_bad_admission_settings_are_refused_by_name(bad: dict) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name.split("_")[0]):
        MasterConfig(admission=AdmissionConfig(**bad)).validate()


def test_master_answers_not_admitted_as_a_status_and_counts_it() -> None:
    clock = Clock(100.0)
    core = MasterCore(MasterConfig(admission=REFUSE_NEW), clock=clock)
    core.register_node(
        master_pb2.RegisterNodeRequest(
            node=common_pb2.NodeEndpoint(node_id="n1", host="127.0.0.1", grpc_port=9),
            dram_capacity_bytes=10_000,
        )
    )
    hs = chain(2, "m")
    core.match_prefix(master_pb2.MatchPrefixRequest(block_hashes=hs, require_checkpoint=True, acquire=True))
    meta = common_pb2.ObjectMeta(key=mla_key(hs[0]), kind=common_pb2.MLA_BLOCK, size=10)
    reply = core.put_start(master_pb2.PutStartRequest(meta=meta))
    assert reply.status == master_pb2.PutStartReply.NOT_ADMITTED and not reply.put_id
    assert core.stats().counters["puts_not_admitted"] == 1
    assert core.index.get(mla_key(hs[0])) is None
    # the writer's client asked to retain the chain: the same put is started
    reply = core.put_start(master_pb2.PutStartRequest(meta=meta, retain=True))
    assert reply.status == master_pb2.PutStartReply.STARTED and reply.put_id
