"""The table of scripts/repeat_tests.sh: which test cases failed in how many of N pytest runs.

Why a separate helper: the shell script only runs pytest N times (each run with ``--junitxml``); counting
failures per case across runs, per module, and naming the first line of each failure needs the JUnit XML
parsed, which is a few lines of stdlib Python and unreadable in bash. Standard library only, so any venv's
interpreter (``.venv``, ``.venv-vllm``) runs it.

    python scripts/repeat_tests_report.py DIR N

reads ``DIR/run-<i>.xml`` (and ``run-<i>.rc``, pytest's exit status) for i = 1..N and prints

- per case that failed or errored in at least one run: how many of the N runs, and the first failure's
  message (its first line);
- per module: cases, runs, failures (case-runs that failed);
- one summary line: modules, cases, runs, total failures.

Exit 1 when any case failed at least once or a run left no report (pytest killed or stopped before
collecting), else 0.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Case:
    """One test case over the runs: in how many runs it ran, which runs failed it, the first message."""

    module: str
    name: str
    ran: int = 0
    failed_runs: list[int] = field(default_factory=list)
    first_message: str = ""


def module_of(classname: str) -> str:
    """``tests.test_x.TestY`` -> ``tests.test_x``: a JUnit classname is the module path plus any classes."""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("Test"):
            return ".".join(parts[:i]) or classname
    return classname


def first_line(problem: ET.Element) -> str:
    """The first non-empty line of a failure/error: its message attribute, else its text."""
    for text in (problem.get("message") or "", problem.text or ""):
        for line in text.splitlines():
            if line.strip():
                return line.strip()[:160]
    return problem.tag


def read_runs(run_dir: Path, runs: int) -> tuple[dict[tuple[str, str], Case], list[str], float]:
    """Every case of every run's report; the runs that left no report (with pytest's exit status); the
    summed wall time of the runs' suites in seconds."""
    cases: dict[tuple[str, str], Case] = {}
    missing: list[str] = []
    seconds = 0.0
    for i in range(1, runs + 1):
        report = run_dir / f"run-{i}.xml"
        rc_file = run_dir / f"run-{i}.rc"
        rc = rc_file.read_text().strip() if rc_file.exists() else "?"
        try:
            root = ET.parse(report).getroot()
        except (OSError, ET.ParseError) as e:
            missing.append(f"run {i}: no readable report (pytest rc {rc}): {e}")
            continue
        for suite in root.iter("testsuite"):
            seconds += float(suite.get("time") or 0.0)
        for tc in root.iter("testcase"):
            module = module_of(tc.get("classname") or "?")
            name = tc.get("name") or "?"
            case = cases.setdefault((module, name), Case(module, name))
            case.ran += 1
            problem = tc.find("failure")
            if problem is None:
                problem = tc.find("error")
            if problem is not None:
                case.failed_runs.append(i)
                if not case.first_message:
                    case.first_message = first_line(problem)
    return cases, missing, seconds


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} DIR N", file=sys.stderr)
        return 2
    run_dir, runs = Path(argv[1]), int(argv[2])
    cases, missing, seconds = read_runs(run_dir, runs)

    failing = sorted(
        (c for c in cases.values() if c.failed_runs), key=lambda c: (-len(c.failed_runs), c.module, c.name)
    )
    print()
    if failing:
        print("failed in  case (which runs), then its first failure")
        for c in failing:
            which = ",".join(map(str, c.failed_runs))
            print(f"{len(c.failed_runs):>3} of {runs:<3} {c.module}::{c.name} (runs {which})")
            print(f"{'':>10}{c.first_message}")
    else:
        print("no case failed in any run")

    per_module: dict[str, list[Case]] = defaultdict(list)
    for c in cases.values():
        per_module[c.module].append(c)
    print()
    print(f"{'module':<48} {'cases':>5} {'runs':>4} {'failures':>8}")
    for module in sorted(per_module):
        mcases = per_module[module]
        fails = sum(len(c.failed_runs) for c in mcases)
        module_runs = max(c.ran for c in mcases)
        print(f"{module:<48} {len(mcases):>5} {module_runs:>4} {fails:>8}")

    for line in missing:
        print(line)
    total = sum(len(c.failed_runs) for c in cases.values())
    print(
        f"\n{len(per_module)} modules, {len(cases)} cases, {runs} runs ({seconds:.0f} s of tests): "
        f"{total} failures in {len(failing)} cases"
        + (f", {len(missing)} runs without a report" if missing else "")
    )
    return 1 if failing or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
