"""Whether speculation pays: `AcceptanceWatch`, pure Python (no torch).

A draft head that cannot belong to the target (its embedding zeroed, another model's head,
a tokenizer it was not trained with) drafts tokens the target rarely accepts: every verify
costs a draft loop and a wider forward for nothing, and the output is still correct, so
nothing fails. The watch reads the speculative worker's cumulative figures after every
engine step and judges them over windows of `window_passes` verify passes: the acceptance
of a window is the drafts accepted per verify pass as a fraction of the draft depth (1.0:
every draft position accepted; the fixture's head reaches about 0.6 on held-out code, one
with a zeroed embedding 0.0). A window is low when it falls below `floor`, or below `drop`
times the first window's (what the head showed on this workload at first).

The first low window is one WARNING record `spec_acceptance_low` with the figures, and the
problem `spec_acceptance_low` (status, doctor) while it lasts; a later window that is not
low again ends it with one INFO record `spec_acceptance_recovered`. The engine's warm-up
runs a few verify passes, far fewer than a window, and its figures are forgotten (`reset`).
"""

from __future__ import annotations

import logging

log = logging.getLogger("specd.spec")

WINDOW_PASSES = 256  # verify passes per judgement (all requests together)
FLOOR = 0.10  # of the draft depth, accepted per verify pass
DROP = 1 / 3  # of the first window's acceptance


class AcceptanceWatch:
    """Judges acceptance by windows (module docstring); `observe` after every step with the
    cumulative figures, `problems()` for status."""

    def __init__(self, depth: int, window_passes: int = WINDOW_PASSES, floor: float = FLOOR,
                 drop: float = DROP) -> None:
        if window_passes < 1 or not 0 <= floor < 1 or not 0 < drop < 1:
            raise ValueError(f"need window_passes >= 1, 0 <= floor < 1, 0 < drop < 1; got "
                             f"{window_passes}, {floor}, {drop}")
        self.depth = depth  # the most drafts one verify pass can accept (0: no speculation)
        self.window_passes = window_passes
        self.floor = floor
        self.drop = drop
        self.first = 0.0  # the first window's acceptance (0.0: none judged yet)
        self.num_windows = 0
        self._start = (0, 0)  # (verify passes, accepted drafts) when the window began
        self.low = ""  # the problem while the last window was low ("": none)

    def reset(self) -> None:
        """Forget every window (the figures were zeroed: after warm-up)."""
        self.first, self.num_windows, self._start, self.low = 0.0, 0, (0, 0), ""

    def observe(self, num_verify_passes: int, num_accepted: int) -> None:
        """The worker's cumulative figures after a step; judges a window once it is full."""
        passes = num_verify_passes - self._start[0]
        if self.depth < 1 or passes < self.window_passes:
            return
        accepted = num_accepted - self._start[1]
        self._start = (num_verify_passes, num_accepted)
        rate = accepted / (passes * self.depth)
        self.num_windows += 1
        if self.num_windows == 1:
            self.first = rate
        is_low = rate < self.floor or rate < self.drop * self.first
        if is_low and not self.low:
            self.low = (f"the draft head's drafts are rarely accepted: {rate:.1%} of the "
                        f"{self.depth} draft positions per verify over the last {passes} "
                        f"verifies, against {self.first:.1%} over its first "
                        f"{self.window_passes} and a floor of {self.floor:.0%}")
            log.warning("%s; speculation costs more than it gives", self.low, extra={
                "event": "spec_acceptance_low", "acceptance": round(rate, 4),
                "first_acceptance": round(self.first, 4), "floor": self.floor,
                "num_verify_passes": passes, "num_accepted": accepted,
                "depth": self.depth})
        elif not is_low and self.low:
            self.low = ""
            log.info("draft acceptance recovered: %.1f%% of the %d draft positions per verify",
                     100 * rate, self.depth, extra={
                         "event": "spec_acceptance_recovered", "acceptance": round(rate, 4),
                         "first_acceptance": round(self.first, 4)})

    def problems(self) -> dict[str, str]:
        """`{"spec_acceptance_low": why}` while the last window was low, else {}."""
        return {"spec_acceptance_low": self.low} if self.low else {}
