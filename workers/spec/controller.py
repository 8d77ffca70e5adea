"""Whether the next engine step speculates: `SpecController`, pure Python (no torch).

Modes: "on" always speculates, "off" never, "auto" decides per step from the running batch
size with hysteresis: speculation turns off when the batch grows above `threshold` and turns
on again only when it has shrunk to `resume_at` or below (default: three quarters of the
threshold), so a batch hovering around the threshold does not flap.

With `measure=True` (the engine's default) "auto" also learns what each mode yields on
this machine and this workload: the engine reports every step (`record`: batch size, the
state it ran in, its wall time and the tokens it emitted; prefill included) and the
controller keeps, per load bucket (the batch size averaged over recent steps, about a
power of two; see `bucket_of`), an average of output tokens per second for each state;
steps of a ramp or a drain, whose batch is far from the load, are not counted there.
Those are regime figures: a mode's cost per request (prefill mixed with verification, the
draft head's catch-up on new prompts, re-gathered K/V) is paid in steps that a
decode-only sample would leave out, and those steps are most of the steps at high
concurrency. The first `settle_steps` steps after each switch are not counted: they still
carry the other regime's state (its request turnover, its kept K/V). Once both states
have been measured in a bucket, the faster one is used there (switching only when the
other is faster by `margin`, and not before the state entered last has been measured for
`settle_steps + min_samples` steps, so that noise does not flap it); until then the
threshold rule above decides. So that a stale figure cannot lock a mode in, the other
state is re-measured for `settle_steps + explore_steps` steps after every `explore_every`
steps in one state (a bounded cost: a few percent of the steps, at the other mode's
speed). Figures are kept across `set_mode`: steps served in "on" or "off" teach "auto" too.

Each change of state is returned as one `SpecEvent` (the engine logs it as one structured
record): what changed, why, and the figures behind the decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specd.ipc.messages import SPEC_MODES

EWMA_WEIGHT = 1 / 32  # of the newest step in a bucket's average (one exploration's worth)
# of the newest step's batch size in the load: the load follows a change of concurrency
# within about 8 steps, so that a slowly draining batch counts in its own bucket, not in
# the one it left (with 1/32, a drain counted at a load 30% above its batch).
LOAD_WEIGHT = 1 / 8
MIN_SAMPLES = 16  # steps measured in a state before its figure is trusted
# A step counts in the bucket of the load only when its own batch size is this close to
# the load (relative, or within one sequence at small loads); see `is_steady`.
STEADY_TOLERANCE = 1 / 3


@dataclass(frozen=True)
class SpecEvent:
    """One transition: enabled is the new state; cause one of "batch_above_threshold",
    "batch_at_or_below_resume_mark", "mode_set", "measured_faster" (the bucket's figures
    favour the new state), "explore" (re-measuring the other mode), "explore_done".
    on_tok_s / off_tok_s: the bucket's measured figures (0 where not measured yet)."""

    step: int
    enabled: bool
    cause: str
    mode: str
    batch_size: int
    threshold: int
    resume_at: int
    on_tok_s: float = 0.0
    off_tok_s: float = 0.0

    def as_dict(self) -> dict[str, int | bool | str | float]:
        return {"event": "spec_on" if self.enabled else "spec_off", "step": self.step,
                "cause": self.cause, "mode": self.mode, "batch_size": self.batch_size,
                "threshold": self.threshold, "resume_at": self.resume_at,
                "on_tok_s": round(self.on_tok_s, 1), "off_tok_s": round(self.off_tok_s, 1)}


def ewma_weight(num_samples: int, floor: float = EWMA_WEIGHT) -> float:
    """Weight of the newest of `num_samples + 1` samples in a running average: a plain mean
    until the average spans its window (so that the first step, often a prefill, does not
    weigh more than any other), then `floor`."""
    return max(floor, 1.0 / (num_samples + 1))


@dataclass
class Throughput:
    """Output tokens per second in one mode and bucket: running averages of the tokens and
    of the seconds of its steps, so that a long step weighs by its duration, as it does in
    the wall-clock throughput a client sees."""

    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    def add(self, num_tokens: int, step_s: float) -> None:
        w = ewma_weight(self.samples)
        self.tokens = (1 - w) * self.tokens + w * num_tokens
        self.seconds = (1 - w) * self.seconds + w * step_s
        self.samples += 1

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def trusted(self, min_samples: int) -> bool:
        return self.samples >= min_samples


@dataclass
class Bucket:
    """Figures for a load of about 2**k sequences (see `bucket_of`): per mode, and the steps
    run in one mode since the other was last measured."""

    on: Throughput = field(default_factory=Throughput)
    off: Throughput = field(default_factory=Throughput)
    steps_since_explore: int = 0


def bucket_of(load: float) -> int:
    """The bucket k of a (smoothed) batch size: [2**(k - 1/2), 2**(k + 1/2)), so about 1, 2,
    4, 8, ... A bucket is centred on its power of two rather than starting at it because a
    closed loop of C clients keeps somewhat fewer than C sequences running (each request
    spends its turnaround outside the engine, and the faster mode turns over more often):
    both modes of one load then fall in one bucket instead of straddling an edge."""
    return math.floor(math.log2(max(load, 1.0)) + 0.5)


def is_steady(batch_size: int, load: float) -> bool:
    """Whether a step of `batch_size` sequences is a sample of the regime at `load` (the
    smoothed batch size), rather than of a sudden change: the load lags the batch by about
    1 / LOAD_WEIGHT steps, so while a burst of requests arrives, steps of 64 sequences
    would count at a load of 20, and when a burst ends at once, steps of 5 at a load of 25.
    Each mode sees its own ramps and drains (which one ran before it, how fast it drains),
    so such steps would skew one mode's figure in a bucket that is not theirs."""
    return abs(batch_size - load) <= max(1.0, STEADY_TOLERANCE * load)


def bucket_label(k: int) -> str:
    return f"~{1 << k}"


def default_resume_at(threshold: int) -> int:
    """The lower mark: three quarters of the threshold (at least 1)."""
    return max(1, threshold * 3 // 4)


class SpecController:
    """Decides per step whether to speculate; all state is set here and only changed by
    `update` and `set_mode`.

    threshold: in auto, speculation turns off when the batch size exceeds it (>= 1).
    resume_at: in auto, it turns back on when the batch size is at most this (1..threshold;
    None = `default_resume_at(threshold)`).
    measure: in auto, decide from measured throughput where both modes have figures (see
    the module docstring); explore_every, explore_steps, settle_steps (steps after a switch
    that are not counted), margin and min_samples (steps before a figure is trusted) tune
    that.
    """

    modes: tuple[str, ...] = SPEC_MODES  # those `set_mode` accepts

    def __init__(self, mode: str, threshold: int, resume_at: int | None = None, *,
                 measure: bool = False, explore_every: int = 2048, explore_steps: int = 32,
                 settle_steps: int = 16, margin: float = 0.02,
                 min_samples: int = MIN_SAMPLES) -> None:
        _check(mode, threshold, resume_at)
        if explore_every < 1 or explore_steps < 1 or settle_steps < 0 or not 0 <= margin < 1:
            raise ValueError(f"need explore_every >= 1, explore_steps >= 1, settle_steps >= 0, "
                             f"0 <= margin < 1; got {explore_every}, {explore_steps}, "
                             f"{settle_steps}, {margin}")
        self.mode = mode
        self.threshold = threshold
        self.resume_at = default_resume_at(threshold) if resume_at is None else resume_at
        self.measure = measure
        self.explore_every = explore_every
        self.explore_steps = explore_steps
        self.settle_steps = settle_steps
        self.margin = margin
        self.min_samples = min_samples
        self.enabled = mode != "off"
        self.num_steps = 0
        self.num_steps_on = 0
        self.num_transitions = 0
        self.last_batch_size = 0
        # The batch size of recorded steps, averaged (weight LOAD_WEIGHT): the key of the
        # bucket a step is counted in and decided by. A regime's steps vary in batch size (a
        # prefill lowers it for a step or two) but belong to one regime and one figure.
        self.load = 0.0
        self.num_recorded = 0
        self.buckets: dict[int, Bucket] = {}
        self.exploring = 0  # steps left in the current exploration of the other mode
        # Steps decided in the current state since it was entered (0 right after a switch):
        # when a step is recorded, the index of that step within its state.
        self.steps_in_state = 0

    def update(self, batch_size: int) -> SpecEvent | None:
        """Decide for the coming step with `batch_size` running sequences; then read
        `enabled`. Returns the event when the state changed, else None."""
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        self.num_steps += 1
        self.last_batch_size = batch_size
        event = None
        if self.mode == "auto":
            event = self._decide_measured(batch_size) if self.measure else None
            if event is None and not self._measured(batch_size) and not self.exploring:
                if self.enabled and batch_size > self.threshold:
                    event = self._switch(False, "batch_above_threshold")
                elif not self.enabled and batch_size <= self.resume_at:
                    event = self._switch(True, "batch_at_or_below_resume_mark")
        if event is None:
            self.steps_in_state += 1
        self.num_steps_on += int(self.enabled)
        return event

    def record(self, batch_size: int, speculated: bool, step_s: float, num_tokens: int
               ) -> None:
        """One finished step's figures; `speculated`: the state it ran in. Called after
        `update` decided the next step. Not counted: a step followed by a switch (it ran
        in the old state and its tail already prepared the new one), the first
        `settle_steps` steps of each state, and a step whose batch is far from the load (a
        ramp or a drain: `is_steady`)."""
        if batch_size < 1 or step_s <= 0 or num_tokens < 0:
            raise ValueError(f"need batch_size >= 1, step_s > 0, num_tokens >= 0; got "
                             f"{batch_size}, {step_s}, {num_tokens}")
        self.load += ewma_weight(self.num_recorded, LOAD_WEIGHT) * (batch_size - self.load)
        self.num_recorded += 1
        if speculated != self.enabled or self.steps_in_state <= self.settle_steps:
            return
        if not is_steady(batch_size, self.load):
            return
        bucket = self.buckets.setdefault(bucket_of(self.load), Bucket())
        (bucket.on if speculated else bucket.off).add(num_tokens, step_s)

    def forget_measurements(self) -> None:
        """Drop every bucket's figures and the step and switch counts (after warm-up, whose
        steps are not the workload: status counts switches from zero); mode, marks and
        state stay."""
        self.buckets = {}
        self.exploring = 0
        self.load, self.num_recorded = 0.0, 0
        self.num_steps = self.num_steps_on = self.num_transitions = 0
        self.last_batch_size = self.steps_in_state = 0

    def figures(self, load: float) -> tuple[float, float]:
        """(on, off) measured output tokens/s in the bucket of `load` (a smoothed batch
        size; 0 = not measured)."""
        bucket = self.buckets.get(bucket_of(load))
        return (0.0, 0.0) if bucket is None else (bucket.on.tok_s, bucket.off.tok_s)

    def measured_table(self) -> dict[str, list[float]]:
        """Every bucket's figures: "~N" (a load of about N sequences) -> [on, off] tokens/s
        (0 = none)."""
        return {bucket_label(k): [round(b.on.tok_s, 1), round(b.off.tok_s, 1)]
                for k, b in sorted(self.buckets.items()) if b.on.samples or b.off.samples}

    def _load_or(self, batch_size: int) -> float:
        """The smoothed load, or `batch_size` before any step was recorded."""
        return self.load if self.num_recorded else batch_size

    def _key(self, batch_size: int) -> int:
        """The bucket decisions read."""
        return bucket_of(self._load_or(batch_size))

    def _measured(self, batch_size: int) -> bool:
        bucket = self.buckets.get(self._key(batch_size))
        return (self.measure and bucket is not None and bucket.on.trusted(self.min_samples)
                and bucket.off.trusted(self.min_samples))

    def _decide_measured(self, batch_size: int) -> SpecEvent | None:
        """Exploration first (finish a running one, start a due one), then the faster mode
        where both are measured; None leaves the decision to the threshold rule."""
        bucket = self.buckets.setdefault(self._key(batch_size), Bucket())
        if self.exploring:
            self.exploring -= 1
            if self.exploring:
                return None
            # Done: the mode explored from keeps its place unless beaten by the margin.
            want = self._preferred(bucket, batch_size, incumbent=not self.enabled)
            return self._switch(want, "explore_done") if want != self.enabled else None
        current = bucket.on if self.enabled else bucket.off
        other = bucket.off if self.enabled else bucket.on
        bucket.steps_since_explore += 1
        if current.trusted(self.min_samples) and (not other.trusted(self.min_samples)
                                or bucket.steps_since_explore >= self.explore_every):
            bucket.steps_since_explore = 0
            # Settling steps, then the measured ones, then one more: the step after which
            # exploration ends switches back and is not counted.
            self.exploring = self.settle_steps + self.explore_steps + 1
            return self._switch(not self.enabled, "explore")
        if (bucket.on.trusted(self.min_samples) and bucket.off.trusted(self.min_samples)
                and self.steps_in_state >= self.settle_steps + self.min_samples):
            # Only once the state entered last has had its own measurement (settling, then
            # min_samples counted steps): a switch decided on its first few steps would
            # flip between two modes within a few percent of each other on noise, paying
            # the settling and the draft head's catch-up each time.
            want = self._preferred(bucket, batch_size, incumbent=self.enabled)
            if want != self.enabled:
                return self._switch(want, "measured_faster")
        return None

    def _preferred(self, bucket: Bucket, batch_size: int, incumbent: bool) -> bool:
        """The state the bucket's figures favour, keeping `incumbent` unless the other is
        faster by `margin`; the threshold rule's state where a mode is not measured yet."""
        if not (bucket.on.trusted(self.min_samples) and bucket.off.trusted(self.min_samples)):
            return (batch_size <= self.threshold if incumbent
                    else batch_size <= self.resume_at)
        kept = bucket.on.tok_s if incumbent else bucket.off.tok_s
        other = bucket.off.tok_s if incumbent else bucket.on.tok_s
        return (not incumbent) if other > kept * (1 + self.margin) else incumbent

    def set_mode(self, mode: str, threshold: int | None = None,
                 resume_at: int | None = None) -> SpecEvent | None:
        """Change mode (and the marks; a new threshold without resume_at takes the default
        mark). In auto the state is re-decided from the last batch size at once."""
        new_threshold = self.threshold if threshold is None else threshold
        if resume_at is None:
            resume_at = self.resume_at if threshold is None else default_resume_at(new_threshold)
        _check(mode, new_threshold, resume_at)
        self.mode, self.threshold, self.resume_at = mode, new_threshold, resume_at
        self.exploring = 0
        if mode == "auto" and self._measured(self.last_batch_size):
            want = self._preferred(self.buckets[self._key(self.last_batch_size)],
                                   self.last_batch_size, incumbent=self.enabled)
        elif mode == "auto":
            want = self.last_batch_size <= self.threshold if self.enabled else (
                self.last_batch_size <= self.resume_at)
        else:
            want = mode == "on"
        return self._switch(want, "mode_set") if want != self.enabled else None

    def _switch(self, enabled: bool, cause: str) -> SpecEvent:
        self.enabled = enabled
        self.steps_in_state = 0
        self.num_transitions += 1
        load = self._load_or(self.last_batch_size)
        on, off = self.figures(load) if load else (0.0, 0.0)
        return SpecEvent(step=self.num_steps, enabled=enabled, cause=cause, mode=self.mode,
                         batch_size=self.last_batch_size, threshold=self.threshold,
                         resume_at=self.resume_at, on_tok_s=on, off_tok_s=off)


def _check(mode: str, threshold: int, resume_at: int | None) -> None:
    if mode not in SPEC_MODES:
        raise ValueError(f"spec mode must be one of {SPEC_MODES}, got {mode!r}")
    if threshold < 1:
        raise ValueError(f"spec threshold must be >= 1, got {threshold}")
    if resume_at is not None and not 1 <= resume_at <= threshold:
        raise ValueError(f"spec resume_at must be in [1, threshold={threshold}], got {resume_at}")
