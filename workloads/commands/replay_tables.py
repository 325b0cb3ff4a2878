"""The tables ``kvpool replay`` prints when no ``--json`` is asked (the JSON carries the same numbers)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from kvpool.workloads.commands.common import fmt_bytes


def print_sim_table(d: dict[str, Any]) -> None:
    """One simulated (or offline) replay: its settings, a row per workload and ALL, TTFT and evictions."""
    cfg = d["config"]
    if cfg["capacity"] is None:
        cap = "unbounded"
    elif cfg["capacity_unit"] == "bytes":
        cap = fmt_bytes(cfg["capacity"]) + (
            f" + SSD {fmt_bytes(cfg['ssd_capacity'])}" if cfg["ssd_capacity"] else ""
        )
    else:
        cap = f"{cfg['capacity']} blocks"
    print(
        f"spec {cfg['spec']}  policy {cfg['policy']}  capacity {cap}  block {cfg['block_size']}  "
        f"checkpoints {cfg['checkpoints'] if cfg['hybrid'] else 'n/a (pure MLA)'}"
    )
    head = (
        f"{'workload':<14}{'requests':>9}{'block hit':>11}{'token hit':>11}{'MLA hit':>9}{'lost':>8}"
        f"{'MLA written':>14}{'KDA written':>14}{'evicted':>14}"
    )
    print(head)
    print("-" * len(head))
    rows = [*d["workloads"].items(), ("ALL", d)]
    for name, w in rows:
        print(
            f"{name:<14}{w['requests']:>9}{w['block_hit_rate']:>11.2%}{w['token_hit_rate']:>11.2%}"
            f"{w['mla_token_hit_rate']:>9.2%}{w['lost_token_fraction']:>8.2%}"
            f"{fmt_bytes(w['mla_bytes_written']):>14}{fmt_bytes(w['kda_bytes_written']):>14}"
            f"{fmt_bytes(w['bytes_evicted']):>14}"
        )
    if "ttft_est_ms_mean" in d:
        print(
            f"TTFT estimate (ms, docs/design/workloads.md): with the cache p50 {d['ttft_est_ms_p50']:.1f} "
            f"p90 {d['ttft_est_ms_p90']:.1f} mean {d['ttft_est_ms_mean']:.1f}; recomputing everything "
            f"p50 {d['ttft_nocache_ms_p50']:.1f} p90 {d['ttft_nocache_ms_p90']:.1f} "
            f"mean {d['ttft_nocache_ms_mean']:.1f}"
        )
    hints = d.get("hints") or {}
    if hints.get("pins") or hints.get("sessions_ended"):
        print(
            f"client hints: {hints['pins']} pins ({hints['pins_refused']} refused by the pin budget), "
            f"{hints['sessions_ended']} sessions ended, {hints['objects_released']} objects released"
        )
    shards = d.get("shards")
    if shards and shards["count"] > 1:
        print(
            f"{shards['count']} master shards (depth {shards['depth']}): lookups {shards['lookups']} "
            f"(CV {shards['lookup_cv']:.3f}), bytes written CV {shards['bytes_cv']:.3f}"
            + (
                f"; token hit {d['token_hit_rate']:.2%} vs {shards['one_master_token_hit_rate']:.2%} on one "
                f"master ({shards['token_hit_loss']:+.2%} lost)"
                if "one_master_token_hit_rate" in shards
                else ""
            )
        )
    if "objects_evicted" in d:  # offline schedules report hits only
        print(
            f"evicted {d['objects_evicted']} objects / {fmt_bytes(d['bytes_evicted'])}; "
            f"held at end {fmt_bytes(d['bytes_held'])}"
        )


def print_sweep_rows(rows: Sequence[dict[str, Any]], group: str) -> None:
    """A sweep: one row per ``group`` value (policy or checkpoint rule) and capacity."""
    head = f"{group:<28}{'capacity':>14}{'GiB':>10}{'block hit':>11}{'token hit':>11}{'lost':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r[group]:<28}{r['capacity']!s:>14}{float(r['capacity_bytes']) / 2**30:>10.1f}"
            f"{float(r['block_hit_rate']):>11.2%}{float(r['token_hit_rate']):>11.2%}"
            f"{float(r['lost_token_fraction'] or 0):>8.2%}"
        )


def print_live_table(s: dict[str, Any]) -> None:
    """A live replay against a gateway: requests, errors, token hit and TTFT per workload."""
    print(
        f"{'workload':<14}{'requests':>9}{'errors':>8}{'token hit':>11}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
    )
    for name, w in [*s["workloads"].items(), ("ALL", s)]:
        print(
            f"{name:<14}{w['requests']:>9}{w['errors']:>8}{w['token_hit_rate']:>11.2%}"
            f"{w['ttft_ms_p50']:>10.1f}{w['ttft_ms_p90']:>9.1f}{w['ttft_ms_p99']:>9.1f}"
        )
    for err in s["first_errors"]:
        print(f"error: {err}", file=sys.stderr)
