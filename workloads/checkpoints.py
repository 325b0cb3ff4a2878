"""Where the simulator writes KDA checkpoints: the block counts one request writes them at under the
workers' own ``CheckpointPolicy`` (the prefill's prompt-side rules plus decode's end-of-output snapshot;
``sim`` stores them; overview §3)."""

from __future__ import annotations

from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads.chains import Chain
from kvpool.workloads.errors import ReplayError


def parse_checkpoints(text: str) -> CheckpointPolicy:
    """``CheckpointPolicy.parse`` for the workloads' commands: a bad part is a ``ReplayError`` (one line and
    exit code 2 there, not a traceback)."""
    try:
        return CheckpointPolicy.parse(text)
    except ValueError as exc:
        raise ReplayError(str(exc)) from None


def checkpoint_positions(
    policy: CheckpointPolicy,
    end_of_output: bool,
    prompt_len: int,
    bs: int,
    chain: Chain,
    run: int,
    usable: int,
) -> list[int]:
    """Block counts c (checkpoint keyed by h_{c-1}) this request writes, ascending: the prefill's own
    boundaries over (usable, last full prompt block], then decode's end-of-output snapshot (the last block
    boundary crossed while decoding, i.e. the last block of prompt + reply[:-1], if past the prompt's)."""
    out = [
        b // bs
        for b in policy.boundaries(
            prompt_len=prompt_len,
            block_size=bs,
            start_blocks=usable,
            mla_run_blocks=min(run, chain.full_prompt_blocks),
        )
    ]
    total = len(chain.hashes)
    if end_of_output and total > chain.prompt_blocks and total > usable:
        out.append(total)
    return out
