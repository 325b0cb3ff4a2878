"""Where the simulator writes KDA checkpoints: the prefill's prompt-side rules plus decode's end-of-output
snapshot, and the block counts one request writes them at (``sim`` stores them; overview §3)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.worker.checkpoint_policy import CheckpointPolicy as PrefillCheckpointPolicy
from kvpool.workloads.chains import Chain
from kvpool.workloads.errors import ReplayError


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Where KDA checkpoints are written (overview §3): the prompt-side rules are the prefill's own
    :class:`kvpool.worker.checkpoint_policy.CheckpointPolicy` (end of prompt, junction, every N blocks), the
    output rule is the decode engine's end-of-output checkpoint. ``interval_blocks`` 0 disables the
    interval."""

    end_of_prompt: bool = True
    end_of_output: bool = True
    junctions: bool = True
    interval_blocks: int = 0

    @classmethod
    def parse(cls, text: str) -> CheckpointPolicy:
        """``"prompt,output,junction,every=16"``, any subset (``end`` = ``prompt``, the workers' spelling);
        ``"none"`` for no checkpoints at all."""
        flags = {"prompt": False, "output": False, "junction": False}
        interval = 0
        for part in filter(None, (p.strip() for p in text.split(","))):
            if part == "none":
                continue
            if part.startswith("every="):
                try:
                    interval = int(part[6:])
                except ValueError:
                    raise ReplayError(f"bad checkpoint interval {part!r}") from None
                if interval <= 0:
                    raise ReplayError("checkpoint interval must be a positive number of blocks")
            elif part in flags or part == "end":
                flags["prompt" if part == "end" else part] = True
            else:
                raise ReplayError(
                    f"unknown checkpoint policy part {part!r}; use prompt, output, junction, every=N or none"
                )
        return cls(flags["prompt"], flags["output"], flags["junction"], interval)

    @property
    def label(self) -> str:
        parts = [
            n
            for n, on in (
                ("prompt", self.end_of_prompt),
                ("output", self.end_of_output),
                ("junction", self.junctions),
            )
            if on
        ]
        if self.interval_blocks:
            parts.append(f"every={self.interval_blocks}")
        return ",".join(parts) or "none"

    def prefill_policy(self) -> PrefillCheckpointPolicy:
        """The prefill engine's policy object with the same prompt-side switches."""
        return PrefillCheckpointPolicy(self.end_of_prompt, self.junctions, self.interval_blocks)


def checkpoint_positions(
    prefill_policy: PrefillCheckpointPolicy,
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
        for b in prefill_policy.boundaries(
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
