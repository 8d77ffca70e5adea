"""The acceptance watch: a window below the floor, or far below the first window, is one
WARNING record and a problem while it lasts; a good window ends it; warm-up's figures are
forgotten; an engine without speculation is never judged."""

from __future__ import annotations

import logging

import pytest

from specd.workers.spec.acceptance_watch import AcceptanceWatch

DEPTH = 4
WINDOW = 100


def _feed(watch: AcceptanceWatch, state: list[float], passes: int, rate: float) -> None:
    """`passes` more verify passes accepting `rate` of the depth on average, a pass a
    step (state: the cumulative passes and accepted drafts)."""
    for _ in range(passes):
        state[0] += 1
        state[1] += rate * DEPTH
        watch.observe(int(state[0]), round(state[1]))


def _records(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == event]


def test_a_head_below_the_floor_from_its_first_window_is_named_once(
        caplog: pytest.LogCaptureFixture) -> None:
    watch, state = AcceptanceWatch(DEPTH, WINDOW, floor=0.1), [0.0, 0.0]
    caplog.set_level(logging.INFO, logger="specd.spec")
    _feed(watch, state, WINDOW - 1, 0.0)
    assert watch.problems() == {}  # not a whole window yet
    _feed(watch, state, 3 * WINDOW + 1, 0.0)
    (record,) = _records(caplog, "spec_acceptance_low")
    assert record.levelno == logging.WARNING
    assert (vars(record)["acceptance"], vars(record)["first_acceptance"],
            vars(record)["depth"]) == (0.0, 0.0, DEPTH)
    (problem,) = watch.problems().values()
    assert problem.startswith("the draft head's drafts are rarely accepted: 0.0% of the 4 "
                              "draft positions per verify over the last 100 verifies")


def test_a_head_far_below_its_first_window_is_named_then_recovers(
        caplog: pytest.LogCaptureFixture) -> None:
    watch, state = AcceptanceWatch(DEPTH, WINDOW, floor=0.1), [0.0, 0.0]
    caplog.set_level(logging.INFO, logger="specd.spec")
    _feed(watch, state, WINDOW, 0.75)
    _feed(watch, state, WINDOW, 0.5)  # lower, not far below: fine
    assert watch.problems() == {}
    _feed(watch, state, WINDOW, 0.2)  # above the floor, below a third of 75%
    assert "against 75.0% over its first 100" in watch.problems()["spec_acceptance_low"]
    _feed(watch, state, WINDOW, 0.5)
    assert watch.problems() == {}
    assert len(_records(caplog, "spec_acceptance_low")) == 1
    assert len(_records(caplog, "spec_acceptance_recovered")) == 1


def test_reset_forgets_the_windows_and_no_speculation_is_never_judged() -> None:
    watch, state = AcceptanceWatch(DEPTH, WINDOW), [0.0, 0.0]
    _feed(watch, state, WINDOW, 0.0)
    assert watch.problems()
    watch.reset()
    assert watch.problems() == {} and watch.num_windows == 0
    _feed(watch, [0.0, 0.0], WINDOW, 0.75)
    assert watch.first == 0.75 and watch.problems() == {}
    plain = AcceptanceWatch(0, WINDOW)
    plain.observe(10 * WINDOW, 0)
    assert plain.problems() == {} and plain.num_windows == 0
