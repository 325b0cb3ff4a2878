"""Checkpoint policy: where a prefill stores KDA checkpoints (overview §3; docs/design/checkpoint_policy.md).

A checkpoint costs as much as ~32 MLA blocks on K3, so they are sparse; each rule is one switch:

* ``end_of_prompt``: at the last block boundary of the prompt, so the same prompt (or a continuation of it,
  e.g. the next chat turn) resumes there (a block-aligned prompt also one block earlier: the same prompt
  again must compute at least its last token);
* ``junction``: when the lookup matched MLA blocks past the last usable checkpoint, the blocks up to the
  end of that run are shared with another request but unusable for a hybrid model; checkpoint at the end
  of the run *this time* so the next request with that prefix hits it (the "tokens lost" become hits);
* ``every_n_blocks``: an optional fixed interval (0 = off) for long prompts with unpredictable branching;
* ``end_of_output``: decode's snapshot at the last block boundary its output crosses, so the next chat turn
  resumes after this answer. The replay simulator reads it; a decode worker's switch is its
  ``--no-end-checkpoint`` flag (the prefill's ``--checkpoint-policy`` carries only the prompt-side rules).

One class for the workers and the simulator, so a simulated policy is the served one by construction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointPolicy:
    end_of_prompt: bool = True
    junction: bool = True
    every_n_blocks: int = 0
    end_of_output: bool = True

    def boundaries(
        self,
        *,
        prompt_len: int,
        block_size: int,
        start_blocks: int,
        mla_run_blocks: int,
        existing: Iterable[int] = (),
    ) -> list[int]:
        """Token positions (block ends in ``(start, L]``) to checkpoint while computing from
        ``start_blocks``; ``existing`` block counts already have a checkpoint and are skipped."""
        n_full = prompt_len // block_size
        have = set(existing)
        chosen: set[int] = set()
        if self.end_of_prompt:
            chosen.add(n_full)
            # a block-aligned prompt sent again can reuse at most L-1 tokens (one must be computed for the
            # logits), so it also gets the boundary before L (rare: 1 prompt in B, so the cost is small)
            chosen.add((prompt_len - 1) // block_size)
        if self.junction and mla_run_blocks > start_blocks:
            chosen.add(min(mla_run_blocks, n_full))
        if self.every_n_blocks > 0:
            chosen.update(range(self.every_n_blocks, n_full + 1, self.every_n_blocks))
        return sorted(c * block_size for c in chosen if start_blocks < c <= n_full and c not in have)

    @classmethod
    def parse(cls, spec: str) -> CheckpointPolicy:
        """``"end,junction,output,every=4"`` / ``"none"`` (CLI form; ``prompt`` is ``end``): a rule not
        named is off. ``ValueError`` names a bad part."""
        rules = {"end": False, "junction": False, "output": False}
        every = 0
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if part.startswith("every="):
                try:
                    every = int(part.removeprefix("every="))
                except ValueError:
                    every = -1
                if every < 0:
                    raise ValueError(f"bad checkpoint interval {part!r}: every=N takes blocks >= 0")
            elif part in ("end", "prompt", "junction", "output"):
                rules["end" if part == "prompt" else part] = True
            elif part != "none":
                raise ValueError(
                    f"unknown checkpoint policy part {part!r}; use end, junction, output, every=N or none"
                )
        return cls(rules["end"], rules["junction"], every, rules["output"])

    @property
    def label(self) -> str:
        """The policy in the simulator's spelling (``prompt,output,junction,every=N`` or ``none``)."""
        rules = [("prompt", self.end_of_prompt), ("output", self.end_of_output), ("junction", self.junction)]
        parts = [name for name, on in rules if on]
        if self.every_n_blocks:
            parts.append(f"every={self.every_n_blocks}")
        return ",".join(parts) or "none"
