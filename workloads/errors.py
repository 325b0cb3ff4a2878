"""Typed errors of the workloads package, so the CLI maps every bad input to exit code 2 with one line.

Each error carries a message written for the person who typed the command: what was wrong and where
(file and line for traces), never a traceback.
"""

from __future__ import annotations


class WorkloadError(ValueError):
    """Base class: bad input to a workloads tool (trace, generator parameter, pricing, replay option)."""


class TraceFormatError(WorkloadError):
    """A trace file or record does not follow its format; names the file and the 1-based line."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None) -> None:
        self.path = path
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        elif line is not None:
            where = f"line {line}: "
        super().__init__(f"{where}{message}")


class GeneratorParamError(WorkloadError):
    """A workload generator was given parameters outside their domain."""


class SpecError(WorkloadError):
    """Unknown model spec or an inconsistent capacity request."""


class PricingError(WorkloadError):
    """Unknown or malformed pricing profile, or token counts that cannot be priced."""


class ReplayError(WorkloadError):
    """A replay (simulated or live) cannot run with the given options."""


class NotYetAvailableError(ReplayError):
    """The feature depends on a component that is not built yet (e.g. the gateway for live replay)."""
