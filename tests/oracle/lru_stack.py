"""The plain-Python LRU stack pass: the oracle of ``workloads/lru_stack.pyx`` (same arguments, same tallies).

Mattson's stack as written first: a Fenwick tree of capacity units by reference position over every
reference of the trace, nothing ever dropped or renumbered. The compiled pass drops keys past the largest
capacity and renumbers; tests hold both to equal tallies on random traces.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

NEVER = 1 << 62
TALLIES = ("hit_blocks", "run_blocks", "hit_tokens", "cached_tokens", "written_bytes", "written_objects")


class NotAStack(ValueError):
    def __init__(self, request: int, why: str) -> None:
        super().__init__(f"request {request} {why}")
        self.request = request
        self.why = why


def stack_pass(
    offsets: Any,
    keys: Any,
    tokens: Any,
    caps: Any,
    prompts: Any,
    n_keys: int,
    ceffs: Any,
    bytes_per_token: int,
    unit_bytes: bool,
) -> dict[str, np.ndarray]:
    offsets, keys, tokens = list(map(int, offsets)), list(map(int, keys)), list(map(int, tokens))
    ceffs = list(map(int, ceffs))
    n_pos = len(keys)
    tree = [0] * (n_pos + 1)
    pos = [0] * (n_keys + 1)
    unit_of = [0] * (n_keys + 1)
    tokens_of = [0] * (n_keys + 1)
    parent_of = [0] * (n_keys + 1)
    total = 0
    tallies = {name: [0] * len(ceffs) for name in TALLIES}
    base = 1

    def unit(t: int) -> int:
        return t * bytes_per_token if unit_bytes else 1

    def add(p: int, w: int) -> None:
        while p <= n_pos:
            tree[p] += w
            p += p & -p

    for r in range(len(caps)):
        a, b = offsets[r], offsets[r + 1]
        ids, toks = keys[a:b], tokens[a:b]
        n, cap, prompt = b - a, int(caps[r]), int(prompts[r])
        run_max, dists, m = [], [], 0
        for k in ids:
            p = pos[k]
            if p:
                s, i = 0, p - 1
                while i:
                    s += tree[i]
                    i &= i - 1
                d = total - s
            else:
                d = NEVER
            m = max(m, d)
            dists.append(d)
            run_max.append(m)
        cum = [0]
        for t in toks:
            cum.append(cum[-1] + t)
        for c, ceff in enumerate(ceffs):
            held = bisect.bisect_right(run_max, ceff)
            run = bisect.bisect_right(run_max[:cap], ceff)
            extra = held - run
            full = run + min(extra, prompt - cap)
            tallies["hit_blocks"][c] += full
            tallies["run_blocks"][c] += run
            tallies["hit_tokens"][c] += cum[full]
            tallies["cached_tokens"][c] += cum[run]
            tallies["written_bytes"][c] += (cum[n] - cum[held]) * bytes_per_token
            tallies["written_objects"][c] += n - held
        for j, (k, t) in enumerate(zip(ids, toks, strict=True)):
            p = pos[k]
            if p >= base:
                raise NotAStack(r, "names one block twice in its chain")
            up = ids[j - 1] + 1 if j else 0
            if p and dists[j] <= max(ceffs, default=-1):
                if tokens_of[k] != t:
                    raise NotAStack(r, f"puts a block held at {tokens_of[k]} tokens with {t}")
                if parent_of[k] != up:
                    raise NotAStack(
                        r, "puts a held block under another parent (its trace ids are not chained)"
                    )
            parent_of[k] = up
            if p:
                add(p, -unit_of[k])
                total -= unit_of[k]
            total += unit(t)
            unit_of[k] = unit(t)
            tokens_of[k] = t
            pos[k] = base + n - 1 - j
            add(pos[k], unit(t))
        base += n
    out = {name: np.array(v, np.int64) for name, v in tallies.items()}
    newest_first = sorted((p, k) for k, p in enumerate(pos) if p)[::-1]
    held_bytes, held_objects = [], []
    for ceff in ceffs:
        acc = real = count = 0
        for _, k in newest_first:
            acc += unit_of[k]
            if acc > ceff:
                break
            real += tokens_of[k] * bytes_per_token
            count += 1
        held_objects.append(count)
        held_bytes.append(real)
    out["held_objects"] = np.array(held_objects, np.int64)
    out["held_bytes"] = np.array(held_bytes, np.int64)
    return out
