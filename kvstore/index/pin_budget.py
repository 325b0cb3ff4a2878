"""How much of its pin budget the clients' retention pins have *earned*: the share of ``pin_share`` that new
session pins may fill, learned from what pinned objects are read compared with what the policy keeps.

Why: a client's retention hint carries information the store cannot see (the session will come back), and
the default policy uses it as evidence (the hinted class of ``return_time``). A *pin* goes further: it takes
the object out of the ranking for its TTL. That pays when what clients pin is read more per byte than what
the policy would keep in its place (a repository every coding session reads), and costs hits when it is
not (on the generated mix at 29 GiB, conversation pins of every turn, held by whichever sessions asked
first within a fixed half of DRAM, gave the default 42.5 % token hit where the same hints used as evidence
only gave 54.9 %). Which case holds depends on the traffic and the cache size, so it is measured, not
configured.

Mechanism: at every writer's lookup, the blocks it was served count towards the pinned objects when the
object that made the hit usable (its checkpoint; a pure-MLA run's deepest block) was pinned, towards the
rest otherwise (moving sums over about the last 500 lookups). Their densities, blocks served per byte of
DRAM held (where pins compete), are compared; ``earned`` moves by ``step`` towards 1 while pins are read
at least as densely as the rest and towards 0 otherwise (``step`` 0: a fixed budget). The index grants a
new session pin only while the pinned bytes stay within ``earned`` x ``pin_share`` of the DRAM (and of the
tenant's quota). Pins already granted are never revoked: they stay to their TTL or their session's end.
While nothing is pinned there is no evidence either way, and ``earned`` creeps back up, so pins are tried
again (exploration). One value per index, for every tenant; an operator's pins (no session) are never
budgeted but count as pinned here too.
"""

from __future__ import annotations

import math

RECENT = 0.002  # weight of one lookup in the moving sums (about the last 500 lookups)


class PinBudget:
    """The earned share of the clients' pin budget (module docstring)."""

    __slots__ = ("_recent", "earned", "step")

    def __init__(self, step: float = 0.02) -> None:
        if not (math.isfinite(step) and 0.0 <= step <= 1.0):
            raise ValueError(f"pin budget step must be in [0, 1], got {step!r}")
        self.step = step
        self.earned = 1.0  # clients are trusted first (starting at 0 cost the generated mix 2 points)
        self._recent = [0.0, 0.0]  # moving sums of blocks served: from pinned checkpoints, from the rest

    def lookup(self, served: int, from_pinned: bool, pinned_bytes: int, held_bytes: int) -> None:
        """A writer's lookup was served ``served`` blocks, through a pinned checkpoint or not, while
        ``pinned_bytes`` of the ``held_bytes`` the index holds were pinned."""
        r = self._recent
        r[0] += RECENT * ((served if from_pinned else 0) - r[0])
        r[1] += RECENT * ((0 if from_pinned else served) - r[1])
        if pinned_bytes <= 0:
            self.earned = min(1.0, self.earned + self.step)  # nothing pinned: no evidence, try pins again
            return
        rest = max(held_bytes - pinned_bytes, 1)
        pays = r[0] * rest >= r[1] * pinned_bytes  # r0 / pinned >= r1 / rest, without dividing
        self.earned = min(1.0, max(0.0, self.earned + (self.step if pays else -self.step)))
