"""``kvpool report``: one self-contained HTML page (plots embedded as base64 PNG). It opens with a
summary (``workloads/report_summary.py``: chosen capacity, token hit per workload, share of the offline
reference, dollars saved per profile, cheapest DRAM + SSD mix), then per trace: its statistics, hit rate
vs capacity per eviction policy against the offline reference and bound, the sampled LRU curve against
the exact one with the band its salts span (what ``--sample`` costs in accuracy), checkpoint policies in the
spec's bytes, price-vs-capacity curves (DRAM only and DRAM + SSD), and user prices under every profile.
CSV and PNG files are also written next to the page for further use.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads.checkpoints import parse_checkpoints
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.pricing import load_profiles, price_result
from kvpool.workloads.progress import PointProgress
from kvpool.workloads.provider_cost import ProviderInputs
from kvpool.workloads.report_summary import SSD_RATIO, plot_price_curves, price_curves, summary_row
from kvpool.workloads.sampled import SampleBand, sample_band
from kvpool.workloads.sim import effective_block_size
from kvpool.workloads.sim_config import SimConfig
from kvpool.workloads.specs import get_spec
from kvpool.workloads.stats import trace_stats
from kvpool.workloads.sweep import (
    auto_capacities,
    capacity_sweep,
    checkpoint_sweep,
    plot_rows,
    sweep_range,
    unique_blocks,
    write_csv,
)
from kvpool.workloads.trace import Request, read_trace, resolve_trace

DEFAULT_POLICY = "hybrid"
BAND_RATE, BAND_SALTS = 0.1, 3  # the sampled-curve band: a rate the bundled traces keep enough roots at
USER_PROFILE = "moonshot-k3"  # the user bill drawn in the price curves (falls back to the first profile)
CHECKPOINT_POLICIES = ("prompt", "prompt,junction", "prompt,output,junction", "prompt,junction,every=16")

_CSS = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}.note{color:#555}"""


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


FOLD_ROWS = 8  # tables longer than this open folded (click to expand)


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["<table><tr>", *(f"<th>{html.escape(h)}</th>" for h in head), "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>")
    out.append("</table>")
    table = "".join(out)
    if len(rows) > FOLD_ROWS:
        return f"<details><summary>{len(rows)} rows</summary>{table}</details>"
    return table


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
    jobs: int | None = None,
) -> Path:
    """Run everything and write ``out`` (HTML) plus CSV/PNG files beside it; returns ``out``. ``jobs``:
    sweep points at once in a process pool (None: the machine's cores; 1: one after the other)."""
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
        "/ prompt blocks. <i>reference</i> is a feasible offline schedule and <i>bound</i> an upper bound, "
        "both paying checkpoint bytes; <i>optimum</i> is offline MIN on MLA blocks with checkpoints free. "
        "See docs/design/eviction.md, docs/design/workloads.md and docs/design/pricing.md.</p>",
    ]
    summary: list[dict[str, Any]] = []
    user_profile = profiles.get(USER_PROFILE) or profiles[sorted(profiles)[0]]
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
        cks = [parse_checkpoints(c) for c in CHECKPOINT_POLICIES]
        tally = PointProgress((len(policies) + len(cks) + 2) * len(caps) + 1, show_points)
        prow = capacity_sweep(reqs, spec, caps, "bytes", policies, CheckpointPolicy(), bs, progress, tally,
                              jobs=jobs)  # fmt: skip
        crow = checkpoint_sweep(reqs, spec, caps, "bytes", "hybrid", cks, bs, progress, tally, jobs)
        for name, rows, group in (("policy", prow, "policy"), ("checkpoints", crow, "checkpoints")):
            write_csv(rows, out.parent / f"{stem}_{name}.csv")
            plot_rows(rows, out.parent / f"{stem}_{name}.png", group, "token_hit_rate",
                      f"{stem}: token hit rate vs capacity ({spec.name})")  # fmt: skip
        curves = price_curves(reqs, spec, caps, provider, user_profile, bs, DEFAULT_POLICY, tally, jobs)
        plot_price_curves(curves, out.parent / f"{stem}_price.png", f"{stem}: cost vs capacity ({spec.name})")
        row, res = summary_row(stem, reqs, spec, curves, prow, profiles, bs, DEFAULT_POLICY)
        summary.append(row)
        chosen = row["capacity_bytes"]
        bills = {n: price_result(p, res, None) for n, p in sorted(profiles.items())}
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
        parts.append(_band_html(reqs, spec_name, bs, points, out.parent / f"{stem}_sampled.png", stem, tally))
        parts.append(
            f"<h3>Checkpoint policies ({DEFAULT_POLICY})</h3>" + _img(out.parent / f"{stem}_checkpoints.png")
        )
        parts.append(_table(
            ["checkpoints", "capacity GiB", "token hit", "lost to checkpoints", "checkpoints written",
             "KDA GiB written", "MLA GiB written"],
            [[r["checkpoints"], f"{float(r['capacity_bytes']) / 2**30:.1f}", _pct(r["token_hit_rate"]),
              _pct(r["lost_token_fraction"]), r["checkpoints_written"],
              f"{float(r['kda_bytes_written']) / 2**30:.1f}", f"{float(r['mla_bytes_written']) / 2**30:.1f}"]
             for r in crow],
        ))  # fmt: skip
        parts.append(
            f"<h3>Price vs capacity ({DEFAULT_POLICY}; DRAM only and over a {SSD_RATIO}x SSD tier; user bill "
            f"under {html.escape(user_profile.name)})</h3>" + _img(out.parent / f"{stem}_price.png")
        )
        parts.append(_table(
            ["DRAM GiB", "SSD GiB", "token hit", "from SSD", "TTFT p90 ms", "provider $", "user $"],
            [[f"{r['dram_bytes'] / 2**30:.1f}", f"{r['ssd_bytes'] / 2**30:.1f}", _pct(r["token_hit_rate"]),
              _pct(r["ssd_token_hit_rate"]), f"{r['ttft_ms']:.0f}", f"{r['total_usd']:.2f}",
              f"{r['user_cost_usd']:.2f}"] for r in curves["rows"]],
        ))  # fmt: skip
        parts.append(
            f"<h3>User prices at {chosen / 2**30:.0f} GiB ({DEFAULT_POLICY}, the provider's cheapest "
            f"DRAM-only capacity; token hit {_pct(res['token_hit_rate'])})</h3>"
        )
        parts.append(_table(
            ["profile", "cost $", "without cache $", "savings $", "saved"],
            [[n, f"{b['cost_usd']:.2f}", f"{b['cost_without_cache_usd']:.2f}", f"{b['savings_usd']:.2f}",
              _pct(b["savings_fraction"])] for n, b in bills.items()],
        ))  # fmt: skip
        best = curves["best"]
        parts.append(
            f"<p>Provider view ({DEFAULT_POLICY}; DRAM ${provider.dram_gb_hour_usd}/GB-h, SSD "
            f"${provider.ssd_gb_hour_usd}/GB-h, GPU ${provider.gpu_hour_usd}/h at {provider.gpu_flops:.3g} "
            f"FLOP/s x MFU {provider.mfu}): cheapest DRAM only <b>{chosen / 2**30:.0f} GiB</b> "
            f"(${summary[-1]['provider_usd']:.2f}); cheapest of the grid DRAM "
            f"{best['dram_bytes'] / 2**30:.0f} GiB + SSD {best['ssd_bytes'] / 2**30:.0f} GiB "
            f"(${best['total_usd']:.2f}, token hit "
            f"{_pct(best['token_hit_rate'])}).</p>"
        )
    parts.insert(2, _summary_html(summary, sorted(profiles)))
    out.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return out


def _band_html(
    reqs: Sequence[Request], spec_name: str, bs: int, points: int, png: Path, stem: str, tally: PointProgress
) -> str:
    """The sampled curve (``--sample``) against the exact one-pass LRU curve on this trace, with the band
    its salts span: what sampling would cost in accuracy here, measured rather than assumed."""
    tally.begin()
    mla = get_spec(spec_name, pure_mla=True)
    cfg = SimConfig(spec=mla, policy="lru", capacity_unit="blocks", block_size=bs, hints=False,
                    high_watermark=1.0, low_watermark=1.0)  # fmt: skip
    u = unique_blocks(reqs, mla, bs)
    head = f"<h3>Sampled LRU curve (R = {BAND_RATE}, {BAND_SALTS} salts) against the exact one</h3>"
    try:
        band = sample_band(reqs, cfg, auto_capacities(u, points, max(1, u // 20)), bs, BAND_RATE, BAND_SALTS)
    except ReplayError as e:
        tally.finished("sampled LRU band (not drawn)", None)
        return head + f"<p class=note>Not drawn: {html.escape(str(e))}.</p>"
    tally.finished(f"sampled LRU band, {len(band.rows)} capacities up to", band.rows[-1]["capacity_bytes"])
    _plot_band(band, png, f"{stem}: sampled vs exact LRU ({mla.name}, evict to fit)")
    rows = [
        [f"{r['capacity_bytes'] / 2**30:.1f}", *(_pct(r[k]) for k in ("exact", "mean", "lo", "hi"))]
        for r in band.rows
    ]
    note = (
        f"<p class=note>{mla.name}, LRU evicting to fit; the sample keeps whole chains by root (tenant + "
        f"first blocks) at R = {BAND_RATE} and runs at R x each capacity. Token-hit error over "
        f"{len(band.rows)} capacities x {band.salts} salts: mean {band.mean_abs_err:.4f}, max "
        f"{band.max_abs_err:.4f}.</p>"
    )
    return (
        head
        + note
        + _img(png)
        + _table(["capacity GiB", "exact token hit", "sampled mean", "least", "greatest"], rows)
    )


def _plot_band(band: SampleBand, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["capacity_bytes"] / 2**30 for r in band.rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    ax.plot(x, [r["exact"] for r in band.rows], marker="o", color="black", label="exact (one pass)")
    ax.plot(x, [r["mean"] for r in band.rows], linestyle="--", label=f"sampled, mean of {band.salts} salts")
    ax.fill_between(x, [r["lo"] for r in band.rows], [r["hi"] for r in band.rows], alpha=0.3,
                    label="sampled, least to greatest")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (GiB)")
    ax.set_ylabel("token hit rate")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _summary_html(rows: Sequence[dict[str, Any]], profile_names: Sequence[str]) -> str:
    head = ["trace", "capacity GiB", "token hit", "per workload", "of reference", "cheapest DRAM + SSD",
            *(f"saved $ {n}" for n in profile_names)]  # fmt: skip
    body = []
    for r in rows:
        wl = ", ".join(f"{w} {_pct(h)}" for w, h in r["workloads"].items())
        ref = "not swept" if r["of_reference"] is None else _pct(r["of_reference"])
        m = r["mix"]
        mix = (f"{m['dram_bytes'] / 2**30:.0f} + {m['ssd_bytes'] / 2**30:.0f} GiB, "
               f"{_pct(m['token_hit_rate'])}, ${m['total_usd']:.2f} "
               f"(DRAM only ${r['provider_usd']:.2f})")  # fmt: skip
        cap = f"{r['capacity_bytes'] / 2**30:.1f}"
        body.append([r["trace"], cap, _pct(r["token_hit_rate"]), wl, ref, mix,
                     *(f"{r['savings_usd'][n]:.2f}" for n in profile_names)])  # fmt: skip
    return (
        f"<h2>Summary</h2><p class=note>Policy {DEFAULT_POLICY} at the provider's cheapest DRAM-only "
        "capacity (prefill compute + DRAM GB-hours over the trace); the reference at the same capacity; "
        "the cheapest DRAM + SSD mix of the grid at no lower token hit; dollars users save per profile."
        "</p>" + _table(head, body)
    )
