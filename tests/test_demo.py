"""`make demo` runs `kvpool demo`: the cluster part and the exactness part must both work end to end."""

import json
import subprocess
import sys


def test_demo_runs_cluster_chats_and_resumes_bitwise() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "demo", "--json", "--turns", "2", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["resume_bitwise"] is True
    assert summary["continuation_identical"] is True
    assert 0 < summary["reused_tokens"] < summary["prompt_tokens"]
    table = summary["cluster_hit_table"]
    for workload in ("chat", "agent", "rag"):
        assert workload in table
    # turn 2 of the chat reuses turn 1: the chat row's hit rate is positive
    chat_row = next(line for line in table.splitlines() if line.startswith("chat"))
    assert float(chat_row.split()[4].rstrip("%")) > 0
