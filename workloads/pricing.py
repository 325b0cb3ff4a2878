"""Prompt-cache pricing: what a user pays with and without the cache, and what the provider saves.

Profiles are data (``workloads/data/pricing.toml``; a user file with the same layout via
``--profile-file``), so a price change is an edit, not a release. The arithmetic, per request:

- ``billable_cached`` = 0 if the prompt is shorter than ``min_cacheable_tokens``, else the cached tokens
  rounded *down* to ``cache_step_tokens`` (OpenAI reports hits in 128-token steps from 1024);
- ``written`` = input tokens written to the cache (default: every uncached token of a cacheable prompt,
  i.e. automatic caching of the whole prompt; explicit ``cache_write_tokens`` overrides), billed at
  ``input x write multiplier``: the request's own retention tier when it has one (a retained prefix's
  written tokens at the prefix's tier), else ``--write-tier``, else ``cache_write``; the remaining uncached
  tokens at ``input``;
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
        """The multiplier of ``tier`` (None: the profile's ``cache_write``); an unknown one is refused."""
        if tier is None:
            return self.cache_write
        try:
            return self.write_tiers[tier]
        except KeyError:
            known = sorted(self.write_tiers) or ["(none)"]
            raise PricingError(f"profile {self.name!r} has no write tier {tier!r}; tiers: {known}") from None

    def request_tier(self, tier: str | None, default: str | None) -> str | None:
        """The tier a request's written tokens are priced at: its own retention tier when it has one, else
        ``default`` (``--write-tier``). A profile that sells no tiers (OpenAI-style: retention is not
        priced) prices a request's own tier at its ``cache_write``; one that sells tiers refuses a tier it
        does not sell (``write_multiplier``)."""
        if tier is None:
            return default
        return tier if self.write_tiers else None


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
    prefix_tokens: int = 0,
    prefix_tier: str | None = None,
    tail_written: bool = True,
) -> Bill:
    """Price one request (or an aggregate treated as one; see module docstring). With ``prefix_tokens``
    the written tokens among the prompt's first ``prefix_tokens`` are priced at ``prefix_tier`` (a
    retained prefix: Anthropic prices each cache breakpoint's segment at its own TTL), the rest at
    ``write_tier``; ``tail_written=False``: the tokens after the prefix are not written at all (the client
    set a breakpoint there and asked nothing for the rest, as with Anthropic's explicit caching)."""
    inp = token_count("input tokens", input_tokens)
    cached = token_count("cached tokens", cached_tokens)
    out = token_count("output tokens", output_tokens)
    if cached > inp:
        raise PricingError(f"cached tokens ({cached}) cannot exceed input tokens ({inp})")
    mult = profile.write_multiplier(write_tier)
    prefix_mult = profile.write_multiplier(prefix_tier) if prefix_tokens else mult
    cacheable = inp >= profile.min_cacheable_tokens
    billable = (cached // profile.cache_step_tokens) * profile.cache_step_tokens if cacheable else 0
    if billable < profile.min_cacheable_tokens:
        billable = 0
    uncached = inp - billable
    if cache_write_tokens is None:
        written = uncached if (cacheable and (mult != 1.0 or prefix_mult != 1.0)) else 0
    else:
        written = token_count("cache write tokens", cache_write_tokens)
        if written > uncached:
            raise PricingError(f"cache write tokens ({written}) exceed uncached input tokens ({uncached})")
    # the uncached tokens start after the billable cached run: those before prefix_tokens are the prefix's
    in_prefix = min(written, max(0, token_count("prefix tokens", prefix_tokens) - billable))
    if not tail_written:
        written = in_prefix
    storage = _number("cached token hours", cached_token_hours) * profile.storage_per_mtok_hour / M
    cost = (
        (uncached - written) * profile.input
        + (written - in_prefix) * profile.input * mult
        + in_prefix * profile.input * prefix_mult
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
    tiers: Sequence[str | None] | None = None,
    prefixes: Sequence[tuple[int, str | None]] | None = None,
) -> Bill:
    """Sum of per-request bills (the exact way to apply minimum and step rules). ``tiers``: each request's
    own retention tier (None: ``write_tier``); ``prefixes``: each one's retained prefix (tokens, tier)."""
    return _per_request(profile, inputs, cached, outputs, write_tier, tiers, prefixes)[0]


def _per_request(
    profile: PriceProfile,
    inputs: Sequence[int],
    cached: Sequence[int],
    outputs: Sequence[int],
    write_tier: str | None,
    tiers: Sequence[str | None] | None,
    prefixes: Sequence[tuple[int, str | None]] | None,
) -> tuple[Bill, list[Bill]]:
    n = len(inputs)
    tiers = [None] * n if tiers is None else tiers
    prefixes = [(0, None)] * n if prefixes is None else prefixes
    if not n == len(cached) == len(outputs) == len(tiers) == len(prefixes):
        raise PricingError("per-request arrays differ in length")
    total, each = Bill(), []
    for i, c, o, t, (pt, ptier) in zip(inputs, cached, outputs, tiers, prefixes, strict=True):
        bill = price(
            profile,
            i,
            c,
            o,
            write_tier=profile.request_tier(t, write_tier),
            prefix_tokens=pt if ptier is not None else 0,
            prefix_tier=profile.request_tier(ptier, write_tier),
            # a client that retained a prefix and asked nothing for its whole prompt writes only the prefix
            tail_written=not (t is None and ptier is not None and profile.write_tiers),
        )
        total.add(bill)
        each.append(bill)
    return total, each


def price_result(
    profile: PriceProfile, result: dict[str, Any], write_tier: str | None = None
) -> dict[str, Any]:
    """Price a replay result (``kvpool replay --json`` / ``--out``): per request when it carries
    ``per_request`` (a request's own retention tiers, columns ``write_tier``, ``prefix_tokens`` and
    ``prefix_tier``, price its written tokens; ``write_tier`` is the default), else its totals as one
    aggregate (flagged approximate when rules could bite)."""
    if not isinstance(result, dict):
        raise PricingError("replay result must be a JSON object")
    per = result.get("per_request")
    out: dict[str, Any] = {"profile": profile.name}
    if isinstance(per, dict) and all(k in per for k in ("input", "cached", "output")):
        n = len(per["input"])
        tiers = per.get("write_tier")
        prefixes = None
        if "prefix_tier" in per:
            prefixes = list(zip(per.get("prefix_tokens", [0] * n), per["prefix_tier"], strict=True))
        total, each = _per_request(
            profile, per["input"], per["cached"], per["output"], write_tier, tiers, prefixes
        )
        by_wl: dict[str, Bill] = {}
        for w, bill in zip(per.get("workload", ["all"] * n), each, strict=True):
            by_wl.setdefault(w, Bill()).add(bill)
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
