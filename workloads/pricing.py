"""Prompt-cache pricing: what a user pays with and without the cache, and what the provider saves.

Profiles are data (``workloads/data/pricing.toml``; a user file with the same layout via
``--profile-file``), so a price change is an edit, not a release. The arithmetic, per request:

- ``billable_cached`` = 0 if the prompt is shorter than ``min_cacheable_tokens``, else the cached tokens
  rounded *down* to ``cache_step_tokens`` (OpenAI reports hits in 128-token steps from 1024);
- ``written`` = input tokens written to the cache (default: every uncached token of a cacheable prompt,
  i.e. automatic caching of the whole prompt; explicit ``cache_write_tokens`` overrides), billed at
  ``input x write multiplier``; the remaining uncached tokens at ``input``;
- ``cost = uncached_unwritten x input + written x input x mult + billable_cached x cached_input
  + output x output_price + storage``; ``cost_without_cache = input_tokens x input + output x output``.

Aggregate counts (no per-request detail) are priced as one request: exact for profiles without a
minimum or step, an approximation otherwise (said in the result).

The provider's side (compute a hit saves against memory held) is ``provider_cost``.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.workloads.errors import PricingError

DEFAULT_PROFILES = Path(__file__).resolve().parent / "data" / "pricing.toml"
M = 1_000_000


@dataclass(frozen=True, slots=True)
class PriceProfile:
    name: str
    input: float
    cached_input: float
    output: float
    cache_write: float = 1.0
    write_tiers: dict[str, float] = field(default_factory=dict)
    min_cacheable_tokens: int = 0
    cache_step_tokens: int = 1
    storage_per_mtok_hour: float = 0.0
    description: str = ""

    def write_multiplier(self, tier: str | None) -> float:
        if tier is None:
            return self.cache_write
        try:
            return self.write_tiers[tier]
        except KeyError:
            known = sorted(self.write_tiers) or ["(none)"]
            raise PricingError(f"profile {self.name!r} has no write tier {tier!r}; tiers: {known}") from None


@dataclass(frozen=True, slots=True)
class ProviderDefaults:
    gpu_hour_usd: float = 3.50
    gpu_flops: float = 989e12
    mfu: float = 0.40
    dram_gb_hour_usd: float = 0.004
    ssd_gb_hour_usd: float = 0.0001


_NUMBER_FIELDS = ("input", "cached_input", "output", "cache_write", "storage_per_mtok_hour")
_INT_FIELDS = ("min_cacheable_tokens", "cache_step_tokens")


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise PricingError(f"{where} must be a non-negative number, got {value!r}")
    return float(value)


def _profile(name: str, table: Any, source: str) -> PriceProfile:
    if not isinstance(table, dict):
        raise PricingError(f"{source}: profile {name!r} must be a table")
    unknown = set(table) - {*_NUMBER_FIELDS, *_INT_FIELDS, "write_tiers", "description"}
    if unknown:
        raise PricingError(f"{source}: profile {name!r} has unknown field(s) {sorted(unknown)}")
    for required in ("input", "cached_input", "output"):
        if required not in table:
            raise PricingError(f"{source}: profile {name!r} lacks {required!r}")
    kw: dict[str, Any] = {k: _number(f"{source}: {name}.{k}", table[k]) for k in _NUMBER_FIELDS if k in table}
    for k in _INT_FIELDS:
        if k in table:
            v = table[k]
            low = 1 if k == "cache_step_tokens" else 0
            if type(v) is not int or v < low:
                raise PricingError(f"{source}: {name}.{k} must be an integer >= {low}")
            kw[k] = v
    tiers = table.get("write_tiers", {})
    if not isinstance(tiers, dict):
        raise PricingError(f"{source}: {name}.write_tiers must be a table")
    kw["write_tiers"] = {str(t): _number(f"{source}: {name}.write_tiers.{t}", m) for t, m in tiers.items()}
    return PriceProfile(name=name, description=str(table.get("description", "")), **kw)


def load_profiles(path: str | Path | None = None) -> tuple[dict[str, PriceProfile], ProviderDefaults]:
    """Profiles and provider defaults from a TOML file (default: the shipped one)."""
    p = Path(path) if path is not None else DEFAULT_PROFILES
    try:
        with open(p, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise PricingError(f"{p}: cannot read profile file ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise PricingError(f"{p}: not valid TOML ({e})") from None
    tables = data.get("profiles")
    if not isinstance(tables, dict) or not tables:
        raise PricingError(f"{p}: needs a [profiles.NAME] table per profile")
    profiles = {name: _profile(name, t, str(p)) for name, t in tables.items()}
    prov = data.get("provider", {})
    if not isinstance(prov, dict):
        raise PricingError(f"{p}: [provider] must be a table")
    fields_ = set(ProviderDefaults.__dataclass_fields__)
    if set(prov) - fields_:
        raise PricingError(f"{p}: unknown [provider] field(s) {sorted(set(prov) - fields_)}")
    provider = ProviderDefaults(**{k: _number(f"{p}: provider.{k}", v) for k, v in prov.items()})
    return profiles, provider


def get_profile(name: str, path: str | Path | None = None) -> PriceProfile:
    profiles, _ = load_profiles(path)
    try:
        return profiles[name]
    except KeyError:
        raise PricingError(f"unknown pricing profile {name!r}; choose one of {sorted(profiles)}") from None


@dataclass(slots=True)
class Bill:
    """Priced token counts (USD)."""

    input_tokens: int = 0
    cached_tokens: int = 0  # cache hits as delivered
    billable_cached_tokens: int = 0  # after minimum / step rules
    cache_write_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    cost_without_cache_usd: float = 0.0
    approximate: bool = False

    @property
    def savings_usd(self) -> float:
        return self.cost_without_cache_usd - self.cost_usd

    @property
    def savings_fraction(self) -> float:
        return self.savings_usd / self.cost_without_cache_usd if self.cost_without_cache_usd else 0.0

    def add(self, other: Bill) -> None:
        for name in ("input_tokens", "cached_tokens", "billable_cached_tokens", "cache_write_tokens",
                     "output_tokens", "cost_usd", "cost_without_cache_usd"):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.approximate = self.approximate or other.approximate

    def to_dict(self) -> dict[str, Any]:
        return {
            "cost_usd": round(self.cost_usd, 9),
            "cost_without_cache_usd": round(self.cost_without_cache_usd, 9),
            "savings_usd": round(self.savings_usd, 9),
            "savings_fraction": round(self.savings_fraction, 9),  # 0.36, not 0.36000000000000004
            "input_tokens": self.input_tokens,
            "cached_tokens": self.cached_tokens,
            "billable_cached_tokens": self.billable_cached_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "output_tokens": self.output_tokens,
            "approximate": self.approximate,
        }


def token_count(name: str, value: Any) -> int:
    """``value`` as a token count: an int >= 0 (a bool, float or negative one is a ``PricingError``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PricingError(f"{name} must be an integer number of tokens, got {value!r}")
    if value < 0:
        raise PricingError(f"{name} must be >= 0, got {value}")
    return value


def price(
    profile: PriceProfile,
    input_tokens: int,
    cached_tokens: int,
    output_tokens: int,
    *,
    cache_write_tokens: int | None = None,
    write_tier: str | None = None,
    cached_token_hours: float = 0.0,
    approximate: bool = False,
) -> Bill:
    """Price one request (or an aggregate treated as one; see module docstring)."""
    inp = token_count("input tokens", input_tokens)
    cached = token_count("cached tokens", cached_tokens)
    out = token_count("output tokens", output_tokens)
    if cached > inp:
        raise PricingError(f"cached tokens ({cached}) cannot exceed input tokens ({inp})")
    mult = profile.write_multiplier(write_tier)
    cacheable = inp >= profile.min_cacheable_tokens
    billable = (cached // profile.cache_step_tokens) * profile.cache_step_tokens if cacheable else 0
    if billable < profile.min_cacheable_tokens:
        billable = 0
    uncached = inp - billable
    if cache_write_tokens is None:
        written = uncached if (cacheable and mult != 1.0) else 0
    else:
        written = token_count("cache write tokens", cache_write_tokens)
        if written > uncached:
            raise PricingError(f"cache write tokens ({written}) exceed uncached input tokens ({uncached})")
    storage = _number("cached token hours", cached_token_hours) * profile.storage_per_mtok_hour / M
    cost = (
        (uncached - written) * profile.input
        + written * profile.input * mult
        + billable * profile.cached_input
        + out * profile.output
    ) / M + storage
    without = (inp * profile.input + out * profile.output) / M
    return Bill(inp, cached, billable, written, out, cost, without, approximate)


def price_many(
    profile: PriceProfile,
    inputs: Sequence[int],
    cached: Sequence[int],
    outputs: Sequence[int],
    write_tier: str | None = None,
) -> Bill:
    """Sum of per-request bills (the exact way to apply minimum and step rules)."""
    if not len(inputs) == len(cached) == len(outputs):
        raise PricingError("per-request arrays differ in length")
    total = Bill()
    for i, c, o in zip(inputs, cached, outputs, strict=True):
        total.add(price(profile, i, c, o, write_tier=write_tier))
    return total


def price_result(
    profile: PriceProfile, result: dict[str, Any], write_tier: str | None = None
) -> dict[str, Any]:
    """Price a replay result (``kvpool replay --json`` / ``--out``): per request when it carries
    ``per_request``, else its totals as one aggregate (flagged approximate when rules could bite)."""
    if not isinstance(result, dict):
        raise PricingError("replay result must be a JSON object")
    per = result.get("per_request")
    out: dict[str, Any] = {"profile": profile.name}
    if isinstance(per, dict) and all(k in per for k in ("input", "cached", "output")):
        total = price_many(profile, per["input"], per["cached"], per["output"], write_tier)
        by_wl: dict[str, Bill] = {}
        for w, i, c, o in zip(per.get("workload", ["all"] * len(per["input"])), per["input"], per["cached"],
                              per["output"], strict=True):  # fmt: skip
            by_wl.setdefault(w, Bill()).add(price(profile, i, c, o, write_tier=write_tier))
        out.update(total.to_dict())
        out["workloads"] = {w: b.to_dict() for w, b in sorted(by_wl.items())}
        return out
    try:
        inp, cached, outp = result["input_tokens"], result["cached_tokens"], result["output_tokens"]
    except KeyError as e:
        raise PricingError(f"replay result lacks {e.args[0]!r} (and per_request detail)") from None
    rules = profile.min_cacheable_tokens > 0 or profile.cache_step_tokens > 1 or profile.cache_write != 1.0
    out.update(price(profile, inp, cached, outp, write_tier=write_tier, approximate=rules).to_dict())
    return out
