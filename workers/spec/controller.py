"""Whether the next engine step speculates: `SpecController`, pure Python (no torch).

Modes: "on" always speculates, "off" never, "auto" decides per step from the running batch
size with hysteresis: speculation turns off when the batch grows above `threshold` and turns
on again only when it has shrunk to `resume_at` or below (default: three quarters of the
threshold), so a batch hovering around the threshold does not flap.

Each change of state is returned as one `SpecEvent` (the engine logs it as one structured
record): what changed, why, and the figures behind the decision.
"""

from __future__ import annotations

from dataclasses import dataclass

SPEC_MODES = ("on", "off", "auto")


@dataclass(frozen=True)
class SpecEvent:
    """One transition: enabled is the new state; cause one of
    "batch_above_threshold", "batch_at_or_below_resume_mark", "mode_set"."""

    step: int
    enabled: bool
    cause: str
    mode: str
    batch_size: int
    threshold: int
    resume_at: int

    def as_dict(self) -> dict[str, int | bool | str]:
        return {"event": "spec_on" if self.enabled else "spec_off", "step": self.step,
                "cause": self.cause, "mode": self.mode, "batch_size": self.batch_size,
                "threshold": self.threshold, "resume_at": self.resume_at}


def default_resume_at(threshold: int) -> int:
    """The lower mark: three quarters of the threshold (at least 1)."""
    return max(1, threshold * 3 // 4)


class SpecController:
    """Decides per step whether to speculate; all state is set here and only changed by
    `update` and `set_mode`.

    threshold: in auto, speculation turns off when the batch size exceeds it (>= 1).
    resume_at: in auto, it turns back on when the batch size is at most this (1..threshold;
    None = `default_resume_at(threshold)`).
    """

    def __init__(self, mode: str, threshold: int, resume_at: int | None = None) -> None:
        _check(mode, threshold, resume_at)
        self.mode = mode
        self.threshold = threshold
        self.resume_at = default_resume_at(threshold) if resume_at is None else resume_at
        self.enabled = mode != "off"
        self.num_steps = 0
        self.num_steps_on = 0
        self.num_transitions = 0
        self.last_batch_size = 0

    def update(self, batch_size: int) -> SpecEvent | None:
        """Decide for the coming step with `batch_size` running sequences; then read
        `enabled`. Returns the event when the state changed, else None."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        self.num_steps += 1
        self.last_batch_size = batch_size
        event = None
        if self.mode == "auto":
            if self.enabled and batch_size > self.threshold:
                event = self._switch(False, "batch_above_threshold")
            elif not self.enabled and batch_size <= self.resume_at:
                event = self._switch(True, "batch_at_or_below_resume_mark")
        self.num_steps_on += int(self.enabled)
        return event

    def set_mode(self, mode: str, threshold: int | None = None,
                 resume_at: int | None = None) -> SpecEvent | None:
        """Change mode (and the marks; a new threshold without resume_at takes the default
        mark). In auto the state is re-decided from the last batch size at once."""
        new_threshold = self.threshold if threshold is None else threshold
        if resume_at is None:
            resume_at = self.resume_at if threshold is None else default_resume_at(new_threshold)
        _check(mode, new_threshold, resume_at)
        self.mode, self.threshold, self.resume_at = mode, new_threshold, resume_at
        if mode == "auto":
            want = self.last_batch_size <= self.threshold if self.enabled else (
                self.last_batch_size <= self.resume_at)
        else:
            want = mode == "on"
        return self._switch(want, "mode_set") if want != self.enabled else None

    def _switch(self, enabled: bool, cause: str) -> SpecEvent:
        self.enabled = enabled
        self.num_transitions += 1
        return SpecEvent(step=self.num_steps, enabled=enabled, cause=cause, mode=self.mode,
                         batch_size=self.last_batch_size, threshold=self.threshold,
                         resume_at=self.resume_at)


def _check(mode: str, threshold: int, resume_at: int | None) -> None:
    if mode not in SPEC_MODES:
        raise ValueError(f"spec mode must be one of {SPEC_MODES}, got {mode!r}")
    if threshold < 1:
        raise ValueError(f"spec threshold must be >= 1, got {threshold}")
    if resume_at is not None and not 1 <= resume_at <= threshold:
        raise ValueError(f"spec resume_at must be in [1, threshold={threshold}], got {resume_at}")
