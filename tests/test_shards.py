"""Master shards: the routing function (rendezvous hashing of a chain's root) and the simulator's sharded
replay. The properties here are the ones docs/design/sharding.md relies on: a chain lives on one shard,
adding a shard moves routes only onto the new shard, and bad parameters name both values."""

from __future__ import annotations

import hashlib
import json

import pytest
from kvpool.kvstore.shards import DEFAULT_DEPTH, MAX_SHARDS, ShardSet, ShardSetError
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import bundled_trace, read_mooncake

from kvpool.commands.main import main

# fixed routes (SHA-256 outputs, as real chain hashes are): a random draw made the balance bound below a
# 4-sigma event that did fail once in a fresh clone's run
ROUTES = [hashlib.sha256(b"route-%d" % i).digest() for i in range(4000)]


def test_one_shard_is_one_master() -> None:
    one = ShardSet()
    assert not one.sharded and one.depth == DEFAULT_DEPTH
    assert {one.shard_of_route(r) for r in ROUTES[:50]} == {0}


def test_route_is_the_hash_closing_the_first_depth_blocks() -> None:
    chain = [bytes([i]) * 32 for i in range(5)]
    s = ShardSet(4, depth=2)
    assert s.route_of_chain(chain) == chain[1]
    assert s.route_of_chain(chain[:1]) == chain[0]  # a chain shorter than the depth: its last block
    assert s.route_of_chain([]) == b""
    # every prefix of at least `depth` blocks goes where the whole chain goes: one chain, one shard
    assert {s.shard_of_chain(chain[:n]) for n in range(2, 6)} == {s.shard_of_chain(chain)}


def test_rendezvous_spreads_routes_and_adding_a_shard_moves_only_onto_it() -> None:
    for count in (2, 3, 7):
        before, after = ShardSet(count), ShardSet(count + 1)
        moved = 0
        per_shard = [0] * count
        for r in ROUTES:
            old, new = before.shard_of_route(r), after.shard_of_route(r)
            per_shard[old] += 1
            if old != new:
                assert new == count, "a route moved between two old shards"
                moved += 1
        share = moved / len(ROUTES)
        assert abs(share - 1 / (count + 1)) < 0.05, (count, share)
        mean = len(ROUTES) / count
        assert max(abs(n - mean) / mean for n in per_shard) < 0.15, per_shard


@pytest.mark.parametrize(
    ("count", "depth", "message"),
    [(0, 2, "shard count"), (MAX_SHARDS + 1, 2, "shard count"), (2, 0, "shard depth"), (True, 2, "count")],
)
def test_bad_shard_parameters(count: int, depth: int, message: str) -> None:
    with pytest.raises(ShardSetError, match=message):
        ShardSet(count, depth)


def test_parse_and_disagreement_name_both_values() -> None:
    assert ShardSet.parse("3x2") == ShardSet(3, 2) and ShardSet.parse("4") == ShardSet(4, DEFAULT_DEPTH)
    assert str(ShardSet(3, 1)) == "3x1"
    with pytest.raises(ShardSetError, match="COUNT or COUNTxDEPTH"):
        ShardSet.parse("three")
    with pytest.raises(ShardSetError, match="master has 3 shards at depth 2, client has 2 shards at depth 2"):
        ShardSet(3).require_same(ShardSet(2), "master", "client")
    ShardSet(3).require_same(ShardSet(3), "master", "client")


def test_sharded_simulation_routes_each_chain_to_one_shard() -> None:
    """Unbounded capacity: a chain on one shard loses nothing against one master except prefixes shorter
    than the depth that a longer chain later extends (those route by a different hash)."""
    reqs = read_mooncake(bundled_trace("conversation"))[:1500]
    spec = get_spec("k3")
    one = simulate(reqs, SimConfig(spec=spec))
    depth1 = simulate(reqs, SimConfig(spec=spec, shards=ShardSet(3, depth=1)))
    depth2 = simulate(reqs, SimConfig(spec=spec, shards=ShardSet(3, depth=2)))
    # depth 1: every chain sharing block 0 shares a shard, so nothing is lost with unbounded capacity
    assert depth1.total.cached_tokens == one.total.cached_tokens
    assert depth2.total.cached_tokens <= one.total.cached_tokens
    assert depth2.total.cached_tokens >= 0.97 * one.total.cached_tokens
    shards = depth2.shards()
    assert sum(shards["lookups"]) == 1500 and len(shards["bytes_written"]) == 3
    assert 0 <= shards["lookup_cv"] < 0.2


def test_replay_shards_flag_compares_with_one_master(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "synthetic", "--limit", "300", "--capacity-bytes", "50GiB", "--shards", "2", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    d = out["shards"]
    assert d["count"] == 2 and d["depth"] == DEFAULT_DEPTH and sum(d["lookups"]) == 300
    assert d["token_hit_loss"] == pytest.approx(d["one_master_token_hit_rate"] - out["token_hit_rate"])
    assert 0 < d["one_master_token_hit_rate"] <= 1
    for extra, message in ((["--shards", "0"], "shard count"), (["--shard-depth", "0"], "shard depth")):
        assert main(["replay", "synthetic", "--limit", "20", *extra]) == 2
        assert message in capsys.readouterr().err
