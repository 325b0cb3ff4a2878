"""Sampled LRU curves (SHARDS, Waldspurger et al., FAST'15): the one-pass curve of a spatially sampled trace,
at capacities scaled by the sampling rate, estimates the curve of the whole trace.

Sampling is by **chain root**, never by block: a request is kept iff ``hash(root, salt) < R`` (as a
fraction of 2**64), where its root is (``by="root"``, the default) its tenant and first ``depth + 1`` blocks
(hash ids, or prompt tokens; depth 1 by default, since a trace whose requests all open with one system
prompt has a single first block), or (``by="session"``) its conversation, else its session key.
Every request of a kept root is kept whole, so the prefix chains (and the prefix rule over them) survive;
sampling blocks would cut chains and count hits that no request could use. A cache of C units serves the
sample as one of about R x C units serves the whole trace (the sample sees about R of the distinct blocks
between two uses of one), so the sample runs at ``scaled(C) = floor(R x C)`` units (at least 1) and its hit
rates (token- and block-weighted) are the estimates. R = 1 keeps everything at the same capacities: the
exact curve. The error against the exact curve is measured, not assumed (docs/measurements/workloads.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.workloads.errors import ReplayError
from kvpool.workloads.lru_curve import lru_curve, refusal
from kvpool.workloads.sim import simulate
from kvpool.workloads.sim_config import SimConfig
from kvpool.workloads.trace import Request

SAMPLE_NOTE = (
    "figures are estimates from a spatial sample by chain root (SHARDS): hit rates of the sampled "
    "requests at capacities scaled by the rate"
)


SAMPLE_BY = ("root", "session")


MEASURED_ERROR = (
    "at R = 0.1 by root, salts 0-2 (bench/sampled_curve_bench.py, 2026-12-06): mean absolute token-hit "
    "error 0.020-0.033 (max 0.054) over 6 capacities of a generated chat trace (3,000 requests, 40 "
    "tenants), 0.009-0.041 (max 0.056) on the Mooncake conversation trace; by session 0.068-0.092; more "
    "in docs/measurements/workloads.md"
)


def check_rate(rate: float) -> float:
    """``0 < rate <= 1`` or a ReplayError naming ``--sample``."""
    if not isinstance(rate, int | float) or not 0 < rate <= 1:  # NaN fails both comparisons
        raise ReplayError(f"--sample takes a rate in (0, 1], got {rate!r}")
    return float(rate)


def chain_root(req: Request, by: str = "root", depth: int = 1) -> bytes:
    """What a request is sampled by: by ``root``, its tenant and first ``depth + 1`` blocks (hash ids, or
    prompt tokens); by ``session``, its conversation, else its session key, else as by root."""
    if by == "session" and req.conversation_id is not None:
        return b"c\0" + req.tenant.encode() + b"\0" + req.conversation_id.encode()
    if by == "session" and req.cache_key is not None:
        return b"s\0" + req.tenant.encode() + b"\0" + req.cache_key.encode()
    if req.hash_ids:
        d = min(depth, len(req.hash_ids) - 1)
        return b"h\0" + req.tenant.encode() + b"\0" + ",".join(map(str, req.hash_ids[: d + 1])).encode()
    first = (req.tokens or [])[: req.block_size * (depth + 1)]
    return b"t\0" + req.tenant.encode() + b"\0" + ",".join(map(str, first)).encode()


def kept(root: bytes, rate: float, salt: int) -> bool:
    """``hash(root, salt) < rate`` as a fraction of 2**64 (BLAKE2b, 8 bytes): the same root, rate and salt
    always decide the same way, in any process."""
    if rate >= 1.0:
        return True
    digest = hashlib.blake2b(root, digest_size=8, salt=salt.to_bytes(16, "little", signed=True)).digest()
    return int.from_bytes(digest, "little") < int(rate * 2**64)


def sample(
    requests: Sequence[Request], rate: float, salt: int = 0, by: str = "root", depth: int = 1
) -> list[Request]:
    """The requests whose chain root (:func:`chain_root`) passes the filter, in their order."""
    rate = check_rate(rate)
    if by not in SAMPLE_BY:
        raise ReplayError(f"--sample-by takes one of {', '.join(SAMPLE_BY)}, got {by!r}")
    if type(depth) is not int or depth < 0:
        raise ReplayError(f"--sample-depth takes an integer >= 0, got {depth!r}")
    memo: dict[bytes, bool] = {}
    out = []
    for r in requests:
        root = chain_root(r, by, depth)
        keep = memo.get(root)
        if keep is None:
            keep = memo[root] = kept(root, rate, salt)
        if keep:
            out.append(r)
    return out


def scaled(capacity: int, rate: float) -> int:
    """The sample's capacity for ``capacity`` units of the whole trace: ``floor(rate x capacity)``, >= 1."""
    return capacity if rate >= 1.0 else max(1, int(rate * capacity))


@dataclass(slots=True)
class SampledCurve:
    """Per capacity of the whole trace: the sample's point (a row dict) at the scaled capacity."""

    rate: float
    salt: int
    by: str
    depth: int
    requests: int  # of the whole trace
    sampled_requests: int
    points: dict[int, dict[str, Any]] = field(default_factory=dict)
    simulated: list[int] = field(default_factory=list)  # capacities the one pass could not take

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_rate": self.rate,
            "sample_salt": self.salt,
            "sample_by": self.by,
            "sample_depth": self.depth,
            "requests": self.requests,
            "sampled_requests": self.sampled_requests,
            "note": SAMPLE_NOTE,
            "points": [self.points[c] for c in sorted(self.points)],
            "simulated_capacities": self.simulated,
        }


def sampled_lru_curve(
    requests: Sequence[Request],
    config: SimConfig,
    capacities: Sequence[int],
    block_size: int,
    rate: float,
    salt: int = 0,
    by: str = "root",
    depth: int = 1,
) -> SampledCurve:
    """The sampled curve: the one-pass LRU curve of :func:`sample` at :func:`scaled` capacities. A scaled
    capacity the pass cannot take (below the largest sampled request) is simulated on the sample (cheap:
    R of the trace). ``config`` must take the one-pass path on the whole trace, else a ReplayError naming
    ``--sample``."""
    rate = check_rate(rate)
    why = refusal(config, requests)
    if why is not None:
        raise ReplayError(f"--sample needs the one-pass LRU curve, which does not apply here: {why}")
    picked = sample(requests, rate, salt, by, depth)
    out = SampledCurve(rate, salt, by, depth, len(requests), len(picked))
    if not picked:
        raise ReplayError(f"--sample {rate}: no request kept (salt {salt}); raise the rate")
    want = {c: scaled(c, rate) for c in capacities}
    curve, _ = lru_curve(picked, config, sorted(set(want.values())), block_size)
    full_block = config.spec.mla_bytes_per_token * block_size
    for cap, small in want.items():
        point = curve.get(small)
        if point is None:
            d = simulate(picked, replace(config, capacity=small)).to_dict()
            out.simulated.append(cap)
        else:
            d = point.to_dict()
        d = {k: v for k, v in d.items() if not isinstance(v, dict | list)}
        d.update(
            capacity=cap,
            capacity_unit=config.capacity_unit,
            capacity_bytes=cap * full_block if config.capacity_unit == "blocks" else cap,
            sampled_capacity=small,
            sample_rate=rate,
            sample_salt=salt,
            estimate=rate < 1.0,
        )
        out.points[cap] = d
    return out


def curve_error(
    exact: dict[int, dict[str, Any]], sampled: dict[int, dict[str, Any]], metric: str = "token_hit_rate"
) -> tuple[float, float]:
    """(mean, max) absolute difference of ``metric`` over the capacities both curves have."""
    diffs = [abs(float(sampled[c][metric]) - float(exact[c][metric])) for c in exact if c in sampled]
    if not diffs:
        return 0.0, 0.0
    return sum(diffs) / len(diffs), max(diffs)


@dataclass(slots=True)
class SampleBand:
    """How far the sampled curve strays on a trace whose exact curve is known: per capacity the exact
    value of ``metric`` and the estimates of several salts (their mean, least and greatest), and the mean
    and largest absolute error over every (capacity, salt). What the report draws, so a user sees on their
    own trace what ``--sample`` would cost them in accuracy before trusting it on a larger one."""

    rate: float
    by: str
    metric: str
    salts: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # capacity, exact, mean, lo, hi
    mean_abs_err: float = 0.0
    max_abs_err: float = 0.0


def sample_band(
    requests: Sequence[Request],
    config: SimConfig,
    capacities: Sequence[int],
    block_size: int,
    rate: float,
    salts: int = 3,
    by: str = "root",
    metric: str = "token_hit_rate",
) -> SampleBand:
    """The exact one-pass curve at ``capacities`` (those the pass takes exactly; the others are left out)
    against the sampled curves of salts ``0 .. salts - 1``. ``config`` must take the one-pass path, as
    for :func:`sampled_lru_curve`; a salt whose sample keeps nothing is a ReplayError."""
    if salts < 1:
        raise ReplayError(f"a sample band needs at least one salt, got {salts}")
    curve, _ = lru_curve(requests, config, capacities, block_size)
    if not curve:
        raise ReplayError("no capacity of the band takes the exact one-pass curve")
    exact = {c: p.to_dict() for c, p in curve.items()}
    runs = [
        sampled_lru_curve(requests, config, sorted(exact), block_size, rate, s, by).points
        for s in range(salts)
    ]
    band = SampleBand(rate, by, metric, salts)
    errors: list[float] = []
    for cap in sorted(exact):
        want = float(exact[cap][metric])
        got = [float(run[cap][metric]) for run in runs]
        errors += [abs(g - want) for g in got]
        band.rows.append(
            {
                "capacity": cap,
                "capacity_bytes": exact[cap]["capacity_bytes"],
                "exact": want,
                "mean": sum(got) / len(got),
                "lo": min(got),
                "hi": max(got),
            }
        )
    band.mean_abs_err = sum(errors) / len(errors)
    band.max_abs_err = max(errors)
    return band
