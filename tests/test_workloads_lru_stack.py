"""The compiled LRU stack pass (``workloads/lru_stack.pyx``) equals its plain-Python oracle
(``tests/oracle/lru_stack.py``) tally for tally, on random chained traces in blocks and in bytes, with the
tree small enough that keys are dropped and renumbered every few requests; bad arrays are ``ValueError``
before any work, and a key twice in one chain is ``NotAStack`` naming the request."""

from __future__ import annotations

import random

import numpy as np
import pytest
from kvpool.workloads.lru_stack import NotAStack, stack_pass
from oracle import lru_stack as oracle

BPT = 7  # bytes per token


def _trace(rng: random.Random, n_req: int) -> dict:
    """Prompts that extend or repeat earlier ones (chained keys); each key one size, the last block of a
    prompt sometimes partial (a key that is always a tail)."""
    paths: list[list[int]] = []
    size: dict[int, int] = {}
    nxt = 1
    offsets, keys, tokens, caps, prompts = [0], [], [], [], []
    for _ in range(n_req):
        reuse = paths and rng.random() < 0.7
        ids = list(rng.choice(paths))[: rng.randint(1, 8)] if reuse else []
        for _ in range(rng.randint(0 if ids else 1, 4)):
            ids.append(nxt)
            size[nxt] = rng.choice((16, 16, 16, 5))
            nxt += 1
        paths.append(ids)
        n = len(ids)
        prompt = rng.randint(max(1, n - 2), n)
        offsets.append(offsets[-1] + n)
        keys += ids
        tokens += [size[k] for k in ids]
        caps.append(rng.randint(0, prompt))
        prompts.append(prompt)
    return {
        "offsets": np.array(offsets, np.int64),
        "keys": np.array(keys, np.int32),
        "tokens": np.array(tokens, np.int32),
        "caps": np.array(caps, np.int32),
        "prompts": np.array(prompts, np.int32),
        "n_keys": nxt - 1,
    }


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("unit_bytes", [False, True])
def test_compiled_pass_equals_the_oracle(seed: int, unit_bytes: bool) -> None:
    rng = random.Random(seed)
    t = _trace(rng, rng.randint(5, 400))
    unit = 16 * BPT if unit_bytes else 1
    ceffs = np.array(
        sorted(rng.randint(0, rng.choice((10, 60))) * unit for _ in range(rng.randint(1, 6))), np.int64
    )
    want = oracle.stack_pass(*t.values(), ceffs, BPT, unit_bytes)
    for positions in (0, 1, 2, 5, 65536):  # renumbered every request or two, now and then, never
        got = stack_pass(*t.values(), ceffs, BPT, unit_bytes, initial_positions=positions)
        assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in want.items()}, positions


@pytest.mark.parametrize("seed", range(30))
def test_a_key_put_at_another_size_or_parent_is_refused_alike(seed: int) -> None:
    """Traces whose keys now and then come back at another size or under another parent: the compiled
    pass refuses the same request as the oracle (only while some capacity holds the key), or neither does
    and the tallies agree."""
    rng = random.Random(seed)
    t = _trace(rng, rng.randint(20, 200))
    keys, tokens = t["keys"].copy(), t["tokens"].copy()
    for _ in range(3):
        i = rng.randrange(len(keys))
        if rng.random() < 0.5:
            tokens[np.flatnonzero(keys == keys[i])[-1]] += 1  # its last reference at another size
        else:
            keys[i] = rng.randint(1, t["n_keys"])  # another key here: other parents (or a repeat)
    t = {**t, "keys": keys, "tokens": tokens}
    ceffs = np.array(sorted(rng.randint(0, 40) for _ in range(3)), np.int64)
    outcomes = []
    for run in (oracle.stack_pass, stack_pass):
        try:
            outcomes.append({k: v.tolist() for k, v in run(*t.values(), ceffs, BPT, False).items()})
        except (oracle.NotAStack, NotAStack) as exc:
            outcomes.append((exc.request, exc.why))
    assert outcomes[0] == outcomes[1]


def test_a_key_twice_in_one_chain_names_the_request() -> None:
    t = _trace(random.Random(1), 5)
    keys = np.concatenate([t["keys"], [1, 1]]).astype(np.int32)
    offsets = np.concatenate([t["offsets"], [len(keys)]]).astype(np.int64)
    tokens = np.concatenate([t["tokens"], [16, 16]]).astype(np.int32)
    caps = np.concatenate([t["caps"], [0]]).astype(np.int32)
    prompts = np.concatenate([t["prompts"], [2]]).astype(np.int32)
    args = (offsets, keys, tokens, caps, prompts, t["n_keys"], np.array([10], np.int64), BPT, False)
    with pytest.raises(NotAStack) as caught:
        stack_pass(*args)
    assert caught.value.request == 5
    with pytest.raises(oracle.NotAStack):
        oracle.stack_pass(*args)


def test_bad_arrays_are_value_errors() -> None:
    t = _trace(random.Random(2), 20)
    ceffs = np.array([5, 9], np.int64)

    def call(**change: object) -> None:
        args = {**t, **change}
        arrays = [args[name] for name in ("offsets", "keys", "tokens", "caps", "prompts", "n_keys")]
        stack_pass(*arrays, args.get("ceffs", ceffs), BPT, False)

    bad_offsets = t["offsets"].copy()
    bad_offsets[3] = bad_offsets[4] + 1
    cases = {
        "offsets": {"offsets": t["offsets"][:-1]},
        "go back": {"offsets": bad_offsets},
        "out of": {"n_keys": int(t["keys"].max()) - 1},
        "cap": {"caps": t["prompts"] + 1},
        "ascending": {"ceffs": np.array([9, 5], np.int64)},
        "negative": {"tokens": -t["tokens"]},
        "below 2": {"ceffs": np.array([5, 1 << 62], np.int64)},
    }
    for words, change in cases.items():
        with pytest.raises(ValueError, match=words):
            call(**change)
    with pytest.raises(ValueError, match="overflow"):
        stack_pass(
            *(t[name] for name in ("offsets", "keys", "tokens", "caps", "prompts", "n_keys")),
            ceffs,
            1 << 58,
            True,
        )
