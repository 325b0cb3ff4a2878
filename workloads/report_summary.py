"""The opening of ``kvpool report``: one line per trace that answers the user's questions first, and the
price-vs-capacity curves (DRAM only, and DRAM over an SSD tier) behind the provider's choice.

The chosen capacity is the provider's cheapest DRAM-only capacity for the default policy (least
prefill compute + DRAM GB-hours over the trace; ``workloads/provision.py``). At that capacity the summary
gives the token hit per workload label, the share of the offline reference reached at the same capacity
(when the reference was swept), the dollars users save under every profile, and the cheapest DRAM + SSD
mix at no worse a hit rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.workloads.pricing import PriceProfile, price_result
from kvpool.workloads.progress import PointProgress
from kvpool.workloads.provider_cost import ProviderInputs
from kvpool.workloads.provision import Target, provision
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import ModelSpec
from kvpool.workloads.trace import Request

SSD_RATIO = 4  # SSD capacity under each DRAM point of the DRAM + SSD curve


def price_curves(
    requests: Sequence[Request],
    spec: ModelSpec,
    caps: Sequence[int],
    provider: ProviderInputs,
    profile: PriceProfile,
    block_size: int,
    policy: str,
    points: PointProgress | None = None,
    jobs: int | None = 1,
) -> dict[str, Any]:
    """Provider cost and user bill at every DRAM capacity, without and with a ``SSD_RATIO`` x SSD tier."""
    return provision(requests, spec, caps, [0, SSD_RATIO], provider, Target(token_hit=0.0), None, policy,
                     block_size, profile, points, jobs=jobs)  # fmt: skip


def summary_row(
    trace: str,
    requests: Sequence[Request],
    spec: ModelSpec,
    curves: dict[str, Any],
    policy_rows: Sequence[dict[str, Any]],
    profiles: dict[str, PriceProfile],
    block_size: int,
    policy: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the summary says about one trace (see the module docstring), and the simulation at the chosen
    capacity it was read from (``to_dict(per_request=True)``), for the report's price table."""
    chosen = curves["best_dram_only"]
    cap = int(chosen["dram_bytes"])
    res = simulate(requests, SimConfig(spec=spec, policy=policy, capacity=cap, block_size=block_size))
    d = res.to_dict(per_request=True)
    ref = [r for r in policy_rows if r["policy"] == "reference" and int(r["capacity_bytes"]) == cap]
    ref_hit = float(ref[0]["token_hit_rate"]) if ref else None
    mixes = [r for r in curves["rows"] if r["token_hit_rate"] >= d["token_hit_rate"]]
    mix = min(mixes, key=lambda r: r["total_usd"]) if mixes else chosen
    row = {
        "trace": trace,
        "capacity_bytes": cap,
        "token_hit_rate": d["token_hit_rate"],
        "workloads": {w: v["token_hit_rate"] for w, v in d["workloads"].items()},
        "reference_token_hit_rate": ref_hit,
        "of_reference": d["token_hit_rate"] / ref_hit if ref_hit else None,
        "savings_usd": {n: price_result(p, d)["savings_usd"] for n, p in sorted(profiles.items())},
        "provider_usd": chosen["total_usd"],
        "mix": {k: mix[k] for k in ("dram_bytes", "ssd_bytes", "token_hit_rate", "total_usd")},
    }
    return row, d


def plot_price_curves(curves: dict[str, Any], path: Path, title: str) -> None:
    """Two panels over DRAM capacity (log x): the provider's total cost and the user's bill, one line
    for DRAM only and one for DRAM over the SSD tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for ratio, label in ((0, "DRAM only"), (SSD_RATIO, f"DRAM + {SSD_RATIO}x SSD")):
        rows = sorted((r for r in curves["rows"] if r["ssd_ratio"] == ratio), key=lambda r: r["dram_bytes"])
        xs = [r["dram_bytes"] / 2**30 for r in rows]
        axes[0].plot(xs, [r["total_usd"] for r in rows], marker="o", label=label)
        axes[1].plot(xs, [r["user_cost_usd"] for r in rows], marker="o", label=label)
    for ax, ylabel in ((axes[0], "provider: prefill + memory $"), (axes[1], "user bill $")):
        ax.set_xscale("log")
        ax.set_xlabel("DRAM capacity (GiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
