"""What every workloads command shares: sizes and token counts as typed arguments, the error guard
(a ``WorkloadError`` becomes ``kvpool <cmd>: error: <message>`` and exit 2), JSON output, trace loading and
progress.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from kvpool.workloads.errors import ReplayError, WorkloadError

EXIT_BAD_INPUT = 2


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtp]i?b?|b)?\s*$", re.IGNORECASE)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "p": 10**15,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
}


def parse_size(text: str) -> int:
    """``"512GiB"``, ``"1.5TB"``, ``"4e9"`` -> bytes (int, > 0)."""
    m = _SIZE.match(text)
    if not m:
        raise ReplayError(f"not a size: {text!r} (examples: 4e9, 512GiB, 1.5TB)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ReplayError(f"size must be > 0: {text!r}")
    return value


def guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except WorkloadError as e:
            print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except BrokenPipeError:  # output piped into `head`: stop quietly, as other CLI tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    run.__doc__ = fn.__doc__
    return run


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=None, separators=(", ", ": "), default=str)
    sys.stdout.write("\n")


def load_requests(trace: str, limit: int | None) -> list:
    """The whole trace as a list (the first ``limit`` by arrival). A file that would not fit in memory
    is refused with a message, or, with ``limit``, read only as far as needed."""
    from kvpool.workloads.trace import arrival_ordered, read_trace, resolve_trace

    path = resolve_trace(trace)
    if limit is not None and limit <= 0:
        raise ReplayError("--limit must be > 0")
    need, have = memory_estimate(path), available_memory()
    if have is not None and need > 0.8 * have:
        if limit is None:
            raise ReplayError(
                f"{trace}: about {need / 2**30:.1f} GiB once loaded, {have / 2**30:.1f} GiB available. "
                "This command needs the whole trace in memory (a sweep, an offline policy, a live replay): "
                "use --limit N, or a single online-policy `kvpool replay --sim`, which streams the file"
            )
        reqs = list(itertools.islice(arrival_ordered(stream_requests(trace)), limit))
    else:
        reqs = read_trace(path, workload=_workload_name(trace))
        if limit is not None:
            reqs = sorted(reqs, key=lambda r: r.arrival_ms)[:limit]
    if not reqs:
        raise ReplayError(f"{trace}: no requests")
    return reqs


def stream_requests(trace: str) -> Iterator:
    """The trace's records one at a time, as they are read (for a streamed simulation)."""
    from kvpool.workloads.trace import iter_trace, resolve_trace

    return iter_trace(resolve_trace(trace), workload=_workload_name(trace))


def _workload_name(trace: str) -> str | None:
    return trace if trace in ("conversation", "synthetic") else None


STREAM_ABOVE_BYTES = 256 * 2**20  # estimated in-memory size above which a single simulation streams


def memory_estimate(path: str | os.PathLike) -> int:
    """Bytes a loaded trace takes, roughly: 8x its text (Python ints and lists of hash ids), the text
    size read from a gzip trailer (mod 4 GiB, so never below 4x the compressed size); a Parquet trace's
    from its own metadata (its file is compressed columns, ~6x smaller than the JSONL)."""
    from kvpool.workloads.trace_columnar import is_parquet, parquet_memory_estimate

    if is_parquet(path):
        return parquet_memory_estimate(path)
    size = os.path.getsize(path)
    text = size
    if str(path).endswith(".gz"):
        with open(path, "rb") as fh:
            fh.seek(max(0, size - 4))
            isize = int.from_bytes(fh.read(4), "little")
        text = max(isize, 4 * size)
    return 8 * text


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def progress_factory(args: argparse.Namespace) -> Callable[[str], Any]:
    from kvpool.workloads.progress import Progress

    enabled = None if args.progress is None else args.progress
    return lambda label: Progress(label, enabled)


def add_jobs_flag(p: argparse.ArgumentParser) -> None:
    """``--jobs N``: sweep points at once in a process pool (default: the machine's cores)."""
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=None,
        help="sweep points run side by side in this many processes (default: the machine's cores; 1: "
        "one after the other, with per-request progress bars)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_progress_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="force the progress bar"
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="never draw the progress bar")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def tokens_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    return value  # sign checked by pricing, so the message names the field


PROVIDER_FLAGS = ("gpu-hour-usd", "gpu-flops", "mfu", "dram-gb-hour-usd", "ssd-gb-hour-usd")


def add_provider_flags(p: argparse.ArgumentParser) -> None:
    """The provider's assumptions, each defaulting to the profile file's [provider] table."""
    for name in PROVIDER_FLAGS:
        p.add_argument(f"--{name}", type=float, help="provider assumption (default from the profile file)")


def provider_inputs(args: argparse.Namespace, defaults: Any) -> Any:
    """``ProviderInputs`` from the profile file's defaults, overridden by the flags given."""
    from kvpool.workloads.provider_cost import ProviderInputs

    values = {}
    for flag in PROVIDER_FLAGS:
        name = flag.replace("-", "_")
        given = getattr(args, name)
        values[name] = getattr(defaults, name) if given is None else given
    return ProviderInputs(**values)


def add_tier_flags(p: argparse.ArgumentParser, with_compute: bool) -> None:
    """Bandwidths of the TTFT estimate (``workloads/ttft.py``), and its compute rate unless the command
    takes that from the provider flags."""
    flags = [("--dram-gbps", "DRAM tier read, GB/s (default 200)"),
             ("--ssd-gbps", "SSD tier read, GB/s (default 7)"),
             ("--net-gbps", "network into a prefill GPU, GB/s (default 50)")]  # fmt: skip
    if with_compute:
        flags += [("--gpu-flops", "prefill GPU FLOP/s (default 989e12)"),
                  ("--mfu", "prefill model FLOPs utilisation (default 0.40)")]  # fmt: skip
    for flag, what in flags:
        p.add_argument(flag, type=float, help=f"TTFT estimate: {what}")


def ttft_model(args: argparse.Namespace) -> Any:
    """``TtftModel`` defaults overridden by the tier (and compute) flags given."""
    from kvpool.workloads.ttft import TtftModel

    d = TtftModel()
    given = {"dram_gbps": args.dram_gbps, "ssd_gbps": args.ssd_gbps, "network_gbps": args.net_gbps,
             "gpu_flops": getattr(args, "gpu_flops", None), "mfu": getattr(args, "mfu", None)}  # fmt: skip
    return TtftModel(**{k: getattr(d, k) if v is None else v for k, v in given.items()})
