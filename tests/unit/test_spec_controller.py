"""SpecController: on/off/auto, hysteresis, and one event per transition."""

from __future__ import annotations

import random

import pytest

from specd.workers.spec.controller import SpecController, SpecEvent, default_resume_at


def run(ctrl: SpecController, sizes: list[int]) -> tuple[list[bool], list[SpecEvent]]:
    states, events = [], []
    for size in sizes:
        event = ctrl.update(size)
        if event is not None:
            events.append(event)
        states.append(ctrl.enabled)
    return states, events


def test_on_and_off_never_change_with_batch_size():
    for mode, expected in (("on", True), ("off", False)):
        ctrl = SpecController(mode, threshold=4)
        states, events = run(ctrl, [1, 100, 1, 100])
        assert states == [expected] * 4
        assert events == []


def test_auto_turns_off_above_threshold_and_on_only_at_the_resume_mark():
    ctrl = SpecController("auto", threshold=8, resume_at=5)
    sizes = [1, 8, 9, 8, 7, 6, 5, 9, 6, 8, 4]
    states, events = run(ctrl, sizes)
    assert states == [True, True, False, False, False, False, True, False, False, False, True]
    assert [(e.step, e.enabled, e.cause, e.batch_size) for e in events] == [
        (3, False, "batch_above_threshold", 9),
        (7, True, "batch_at_or_below_resume_mark", 5),
        (8, False, "batch_above_threshold", 9),
        (11, True, "batch_at_or_below_resume_mark", 4),
    ]
    assert all((e.threshold, e.resume_at, e.mode) == (8, 5, "auto") for e in events)
    assert ctrl.num_transitions == 4
    assert ctrl.num_steps == len(sizes)
    assert ctrl.num_steps_on == sum(states)


def test_hovering_at_the_threshold_does_not_flap():
    ctrl = SpecController("auto", threshold=16)
    _, events = run(ctrl, [17, 16, 17, 15, 16, 17, 14, 13])
    assert [e.enabled for e in events] == [False]  # resume mark 12 never reached


def test_default_resume_mark_is_three_quarters_and_at_least_one():
    assert default_resume_at(16) == 12
    assert default_resume_at(1) == 1
    assert SpecController("auto", threshold=16).resume_at == 12


def test_set_mode_emits_an_event_only_when_the_state_changes():
    ctrl = SpecController("auto", threshold=4, resume_at=2)
    ctrl.update(3)
    assert ctrl.set_mode("on") is None
    event = ctrl.set_mode("off")
    assert event is not None
    assert (event.enabled, event.cause, event.mode) == (False, "mode_set", "off")
    # Back to auto with a batch of 3: above the resume mark 2, so it stays off until 2.
    assert ctrl.set_mode("auto") is None
    assert ctrl.update(3) is None and not ctrl.enabled
    assert ctrl.update(2) is not None and ctrl.enabled
    # A lower threshold while on turns it off at once, with the default mark.
    event = ctrl.set_mode("auto", threshold=1)
    assert event is not None and not event.enabled and (event.threshold, event.resume_at) == (1, 1)


def test_event_record_carries_cause_and_figures():
    ctrl = SpecController("auto", threshold=2, resume_at=1)
    ctrl.update(1)
    event = ctrl.update(3)
    assert event is not None
    assert event.as_dict() == {"event": "spec_off", "step": 2, "cause": "batch_above_threshold",
                               "mode": "auto", "batch_size": 3, "threshold": 2, "resume_at": 1,
                               "on_tok_s": 0.0, "off_tok_s": 0.0}


@pytest.mark.parametrize("mode, threshold, resume_at", [
    ("sometimes", 4, None), ("auto", 0, None), ("auto", 4, 5), ("auto", 4, 0)])
def test_invalid_settings_raise(mode, threshold, resume_at):
    with pytest.raises(ValueError):
        SpecController(mode, threshold, resume_at)


def test_negative_batch_size_raises():
    with pytest.raises(ValueError, match="batch_size"):
        SpecController("auto", threshold=4).update(-1)


def drive(ctrl: SpecController, batch_size: int, steps: int, on_tok_s: float,
          off_tok_s: float) -> list[SpecEvent]:
    """Run `steps` engine steps at a fixed batch size on a machine where each mode yields
    the given throughput, as the engine does: decide the next step, then record the one
    that ran in the state it ran in (the controller picks which steps count)."""
    events = []
    for _ in range(steps):
        speculated = ctrl.enabled
        event = ctrl.update(batch_size)
        if event is not None:
            events.append(event)
        ctrl.record(batch_size, speculated, 0.01, round(
            (on_tok_s if speculated else off_tok_s) * 0.01))
    return events


def test_measured_auto_picks_the_faster_mode_even_against_the_threshold():
    # Threshold 8 says "off" at batch 32, but speculation measures faster there.
    ctrl = SpecController("auto", threshold=8, measure=True)
    events = drive(ctrl, 32, 120, on_tok_s=900, off_tok_s=600)
    assert ctrl.enabled
    assert [e.cause for e in events][:2] == ["batch_above_threshold", "explore"]
    on, off = ctrl.figures(32)
    assert (round(on), round(off)) == (900, 600)
    # ... and speculation below the threshold turns off where plain decode is faster.
    ctrl2 = SpecController("auto", threshold=8, measure=True)
    drive(ctrl2, 4, 120, on_tok_s=300, off_tok_s=500)
    assert not ctrl2.enabled


def test_measured_auto_keeps_its_mode_within_the_margin():
    ctrl = SpecController("auto", threshold=8, measure=True, margin=0.05)
    events = drive(ctrl, 4, 200, on_tok_s=500, off_tok_s=510)  # 2% apart: stay on
    assert ctrl.enabled
    assert not any(e.cause == "measured_faster" for e in events)


def test_measured_auto_re_measures_the_other_mode_and_follows_a_change():
    ctrl = SpecController("auto", threshold=8, measure=True, explore_every=50,
                          explore_steps=8, settle_steps=2, min_samples=8)
    drive(ctrl, 4, 100, on_tok_s=800, off_tok_s=400)
    assert ctrl.enabled
    # The workload changes: speculation stops paying. The next exploration finds it.
    events = drive(ctrl, 4, 200, on_tok_s=300, off_tok_s=400)
    assert not ctrl.enabled
    causes = [e.cause for e in events]
    assert "explore" in causes
    # Exploration is bounded: a few percent of the steps in the other mode.
    explored = drive(ctrl, 4, 1000, on_tok_s=300, off_tok_s=400)
    assert 0 < sum(e.cause == "explore" for e in explored) <= 1000 // 50 + 1
    # Each exploration: 2 settling steps, 8 measured, 1 that switches back.
    assert ctrl.num_steps_on <= 100 + 200 + 1000 * 11 // 50


def test_buckets_are_measured_apart():
    ctrl = SpecController("auto", threshold=8, measure=True)
    drive(ctrl, 2, 120, on_tok_s=400, off_tok_s=100)
    drive(ctrl, 48, 300, on_tok_s=400, off_tok_s=900)
    assert ctrl.figures(2) == (pytest.approx(400), pytest.approx(100))
    assert ctrl.figures(48) == (pytest.approx(400), pytest.approx(900))
    table = ctrl.measured_table()
    assert table["~2"] == [400.0, 100.0] and table["~64"] == [400.0, 900.0]
    assert not ctrl.enabled
    # Back at 2: once the averaged load is back in its bucket, speculation again.
    drive(ctrl, 2, 200, on_tok_s=400, off_tok_s=100)
    assert ctrl.enabled


def test_a_bucket_is_a_load_not_the_batch_size_of_one_step():
    # One regime: 30 sequences running, every fourth step a prefill that lowers the batch
    # to 20 and emits little. Its figure is the regime's, in one bucket (about 32).
    ctrl = SpecController("off", threshold=8, measure=True, settle_steps=0)
    for i in range(200):
        ctrl.update(30)
        prefill = i % 4 == 3
        ctrl.record(20 if prefill else 30, False, 0.05 if prefill else 0.02,
                    20 if prefill else 30)
    assert list(ctrl.measured_table()) == ["~32"]
    # 3 steps of 30 tokens in 0.02 s and one of 20 in 0.05 s: 110 tokens in 0.11 s.
    assert ctrl.figures(30)[1] == pytest.approx(1000, rel=0.05)


def test_bucket_edges_lie_between_powers_of_two():
    from specd.workers.spec.controller import bucket_of

    assert [bucket_of(x) for x in (1, 1.4, 1.5, 2, 2.8, 2.9, 24, 31.9, 45, 46, 64)] == [
        0, 0, 1, 1, 1, 2, 5, 5, 5, 6, 6]


def test_record_rejects_nonsense():
    ctrl = SpecController("auto", threshold=8, measure=True)
    with pytest.raises(ValueError):
        ctrl.record(0, True, 0.01, 3)
    with pytest.raises(ValueError):
        ctrl.record(4, True, 0.0, 3)


def test_steps_around_a_switch_are_not_samples():
    ctrl = SpecController("auto", threshold=8, measure=True, settle_steps=3, min_samples=1)
    assert ctrl.update(4) is None  # on, below the threshold
    # The step that ran speculating and after which the state turned off: not a sample.
    assert ctrl.update(16) is not None and not ctrl.enabled
    ctrl.record(4, True, 0.01, 40)
    # The first settle_steps steps of the new state still carry the old regime: not samples.
    for _ in range(3):
        ctrl.update(16)
        ctrl.record(16, False, 0.01, 99)
    assert ctrl.figures(16) == (0.0, 0.0)
    assert ctrl.figures(4) == (0.0, 0.0)
    ctrl.update(16)
    ctrl.record(16, False, 0.01, 5)
    assert ctrl.figures(16) == (0.0, pytest.approx(500.0))


def test_steps_served_in_on_and_off_teach_auto():
    # Speculation pays at batch 32 on this machine although the threshold says it does not.
    ctrl = SpecController("on", threshold=8, measure=True)
    drive(ctrl, 32, 40, on_tok_s=900, off_tok_s=600)
    ctrl.set_mode("off")
    drive(ctrl, 32, 40, on_tok_s=900, off_tok_s=600)
    event = ctrl.set_mode("auto")
    assert event is not None and event.enabled and event.cause == "mode_set"
    assert (round(event.on_tok_s), round(event.off_tok_s)) == (900, 600)


def _run_off(batch_sizes: list[int]) -> dict[str, list[float]]:
    """Plain decode on a machine where every sequence makes 20 tokens/s, through the given
    batch sizes; the measured table."""
    ctrl = SpecController("off", threshold=8, measure=True, settle_steps=0, min_samples=1)
    for batch in batch_sizes:
        ctrl.update(batch)
        ctrl.record(batch, False, 0.05, batch)
    return ctrl.measured_table()


def test_a_sudden_burst_or_end_is_not_a_sample_of_the_loads_it_passes_through():
    # 64 requests arrive at once at an engine serving one, then all but 5 end at once.
    # While the load (an average) catches up, the steps are not samples of the buckets it
    # passes through: each figure is exactly what its own batch size yields.
    table = _run_off([1] * 50 + [64] * 200 + [5] * 40)
    assert table.pop("~1") == [0.0, 20.0] and table.pop("~64") == [0.0, 1280.0]
    # the five-wide steps count once the load is near five (in ~8 on its way, then ~4)
    assert table == {"~4": [0.0, 100.0], "~8": [0.0, 100.0]}


def test_a_slow_drain_counts_in_the_buckets_of_its_own_batch_sizes():
    # One sequence leaves every fourth step: the load keeps up, and each bucket's figure
    # is what batch sizes of that bucket yield (about 2**(k - 1/2) to 2**(k + 1/2)).
    table = _run_off([64] * 200 + [(b + 3) // 4 for b in range(256, 0, -1)])
    assert {"~4", "~8", "~16", "~32", "~64"} <= set(table)
    for label, (_, off) in table.items():
        load = int(label[1:])
        assert 20 * load / 1.5 <= off <= 20 * load * 1.5, (label, off)


def test_a_step_is_steady_within_a_third_of_the_load_or_one_sequence():
    from specd.workers.spec.controller import is_steady

    assert is_steady(30, 27.5) and is_steady(20, 27.5) and not is_steady(12, 27.5)
    assert not is_steady(64, 20.0)
    assert is_steady(1, 1.7) and is_steady(2, 1.7) and not is_steady(4, 1.7)


def test_a_switch_waits_for_a_measurement_of_the_state_entered_last():
    # Two modes 2% apart, each step's figure noisy (+-50%): no `measured_faster` switch
    # comes before the state entered last has had its settling steps and min_samples
    # measured ones (without that rule this run flips back after 10 steps).
    ctrl = SpecController("auto", threshold=8, measure=True, settle_steps=2, min_samples=16,
                          explore_every=10_000)
    rng = random.Random(0)
    last_switch, gaps = 0, []
    for step in range(3000):
        speculated = ctrl.enabled
        event = ctrl.update(8)
        if event is not None and event.cause == "measured_faster":
            gaps.append(step - last_switch)
        if event is not None:
            last_switch = step
        base = 1000 if speculated else 980
        noisy = base * (1 + 0.5 * (2 * rng.random() - 1))
        ctrl.record(8, speculated, 0.1, round(noisy * 0.1))
    assert gaps and min(gaps) >= 2 + 16
