"""``kvpool report``: one self-contained HTML page (plots embedded as base64 PNG) gathering, per trace,
its statistics, hit rate vs capacity per eviction policy against the offline optimum, checkpoint
policies in the spec's bytes, user prices under every profile, and the provider's cheapest capacity.
CSV and PNG files are also written next to the page for further use.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool.workloads.pricing import ProviderInputs, best_capacity, load_profiles, price_result
from kvpool.workloads.progress import PointProgress
from kvpool.workloads.sim import CheckpointPolicy, SimConfig, effective_block_size, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.stats import trace_stats
from kvpool.workloads.sweep import (
    auto_capacities,
    capacity_sweep,
    checkpoint_sweep,
    plot_rows,
    sweep_range,
    write_csv,
)
from kvpool.workloads.trace import read_trace, resolve_trace

CHECKPOINT_POLICIES = ("prompt", "prompt,junction", "prompt,output,junction", "prompt,junction,every=16")

_CSS = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}.note{color:#555}"""


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["<table><tr>", *(f"<th>{html.escape(h)}</th>" for h in head), "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _pct(x: Any) -> str:
    return f"{float(x):.2%}"


def build_report(
    traces: Sequence[str],
    out: Path,
    spec_name: str = "k3",
    limit: int | None = None,
    points: int = 6,
    policies: Sequence[str] = ("hybrid", "lru", "reference", "bound"),
    profile_file: str | None = None,
    progress: Callable[[str], Any] | None = None,
    show_points: bool = True,
) -> Path:
    """Run everything and write ``out`` (HTML) plus CSV/PNG files beside it; returns ``out``."""
    spec = get_spec(spec_name)
    profiles, provider_defaults = load_profiles(profile_file)
    provider = ProviderInputs(**{k: getattr(provider_defaults, k) for k in ProviderInputs.__slots__})
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = [
        f"<!doctype html><meta charset=utf-8><title>kvpool workload report</title><style>{_CSS}</style>",
        "<h1>kvpool workload report</h1>",
        f"<p class=note>Spec <b>{html.escape(spec.name)}</b>: {html.escape(spec.description)}; "
        f"MLA {spec.mla_bytes_per_token:,} B/token, KDA checkpoint {spec.kda_bytes_per_checkpoint:,} B. "
        "Token hit = usable prefix (joint MLA + checkpoint rule) / prompt tokens; block hit = MLA prefix run "
        "/ prompt blocks. The optimum is offline MIN on MLA blocks (checkpoints free): an upper bound. "
        "See docs/design/workloads.md and docs/design/pricing.md.</p>",
    ]
    for trace in traces:
        reqs = read_trace(resolve_trace(trace), workload=trace if "/" not in trace else None)
        if limit:
            reqs = sorted(reqs, key=lambda r: r.arrival_ms)[:limit]
        stem = Path(trace).name.split(".")[0]
        st = trace_stats(reqs)
        bs = effective_block_size(reqs, spec, None)
        full_block = spec.mla_bytes_per_token * bs
        lo, hi = sweep_range(reqs, spec, bs)
        caps = [c * full_block for c in auto_capacities(hi, points, lo)]
        cks = [CheckpointPolicy.parse(c) for c in CHECKPOINT_POLICIES]
        points = PointProgress((len(policies) + len(cks)) * len(caps), show_points)
        prow = capacity_sweep(reqs, spec, caps, "bytes", policies, CheckpointPolicy(), bs, progress, points)
        crow = checkpoint_sweep(reqs, spec, caps, "bytes", "hybrid", cks, bs, progress, points)
        for name, rows, group in (("policy", prow, "policy"), ("checkpoints", crow, "checkpoints")):
            write_csv(rows, out.parent / f"{stem}_{name}.csv")
            plot_rows(rows, out.parent / f"{stem}_{name}.png", group, "token_hit_rate",
                      f"{stem}: token hit rate vs capacity ({spec.name})")  # fmt: skip
        mid = caps[len(caps) // 2]
        res = simulate(reqs, SimConfig(spec=spec, capacity=mid, block_size=bs)).to_dict(per_request=True)
        bills = {n: price_result(p, res, None) for n, p in sorted(profiles.items())}
        lru_rows = [r for r in prow if r["policy"] == "lru"]
        best = best_capacity(spec, provider, lru_rows, "dram")["best"] if lru_rows else None
        parts.append(f"<h2>{html.escape(stem)}</h2>")
        parts.append(_table(
            ["requests", "mean input", "mean output", "blocks", "unique blocks", "span s", "inf. block hit",
             "inf. token hit"],
            [[st["requests"], f"{st['mean_input']:.0f}", f"{st['mean_output']:.0f}", st["blocks"],
              st["unique_blocks"], f"{st['duration_s']:.0f}", _pct(st["infinite_block_hit_rate"]),
              _pct(st["infinite_token_hit_rate"])]],
        ))  # fmt: skip
        parts.append(
            "<h3>Eviction policies vs offline optimum</h3>" + _img(out.parent / f"{stem}_policy.png")
        )
        parts.append(_table(
            ["policy", "capacity GiB", "block hit", "token hit", "lost to checkpoints", "evicted GiB"],
            [[r["policy"], f"{float(r['capacity_bytes']) / 2**30:.1f}", _pct(r["block_hit_rate"]),
              _pct(r["token_hit_rate"]), _pct(r["lost_token_fraction"] or 0),
              f"{float(r['bytes_evicted'] or 0) / 2**30:.1f}"] for r in prow],
        ))  # fmt: skip
        parts.append("<h3>Checkpoint policies (LRU)</h3>" + _img(out.parent / f"{stem}_checkpoints.png"))
        parts.append(_table(
            ["checkpoints", "capacity GiB", "token hit", "lost to checkpoints", "checkpoints written",
             "KDA GiB written", "MLA GiB written"],
            [[r["checkpoints"], f"{float(r['capacity_bytes']) / 2**30:.1f}", _pct(r["token_hit_rate"]),
              _pct(r["lost_token_fraction"]), r["checkpoints_written"],
              f"{float(r['kda_bytes_written']) / 2**30:.1f}", f"{float(r['mla_bytes_written']) / 2**30:.1f}"]
             for r in crow],
        ))  # fmt: skip
        parts.append(
            f"<h3>User prices at {mid / 2**30:.0f} GiB (LRU, token hit {_pct(res['token_hit_rate'])})</h3>"
        )
        parts.append(_table(
            ["profile", "cost $", "without cache $", "savings $", "saved"],
            [[n, f"{b['cost_usd']:.2f}", f"{b['cost_without_cache_usd']:.2f}", f"{b['savings_usd']:.2f}",
              _pct(b["savings_fraction"])] for n, b in bills.items()],
        ))  # fmt: skip
        if best is not None:
            parts.append(
                f"<p>Provider view (LRU, DRAM at ${provider.dram_gb_hour_usd}/GB-h, "
                f"GPU ${provider.gpu_hour_usd}/h "
                f"at {provider.gpu_flops:.3g} FLOP/s x MFU {provider.mfu}): cheapest capacity "
                f"<b>{best['capacity_gb']:.0f} GB</b>, prefill ${best['compute_spent_usd']:.2f} + memory "
                f"${best['storage_usd']:.2f} over {best['hours']:.2f} h.</p>"
            )
    out.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return out
