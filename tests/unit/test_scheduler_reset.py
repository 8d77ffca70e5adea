"""Scheduler after a failed step (workers/engine/isolation.py): forgetting what was scheduled and
not applied, running one sequence alone, and failing one request (no torch, no model)."""

from __future__ import annotations

from specd.workers.engine.batch import ModelOutput
from specd.workers.engine.sequence import FinishReason, Sequence, SequenceStatus
from tests.unit.test_scheduler import BLOCK, make_scheduler, make_seq, plan, step


def test_reset_after_failure_forgets_the_unapplied_steps_and_recomputes_everyone() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq("a", num_prompt=9), make_seq("b", first=30), make_seq("c", first=50)
    for seq in (a, b, c):
        scheduler.add(seq)
    step(scheduler)
    step(scheduler)  # a and b decode; c waits (max_num_seqs 2)
    scheduler.schedule()  # this step's results never come back
    assert a.pending_sample_ids and b.pending_sample_ids
    a.spec_token_ids, b.lagged_sample_id = [5, 6], 17

    scheduler.reset_after_failure()

    assert [s.request_id for s in scheduler.waiting] == ["a", "b", "c"]  # arrival order
    for seq in (a, b):
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert seq.pending_sample_ids == [] and seq.block_ids == []
        assert seq.output_token_ids == [7, 7], "tokens applied before the failure stay"
    assert a.spec_token_ids == [] and b.lagged_sample_id is None
    assert scheduler.block_manager.num_free_blocks == 64
    # The prefix cache starts empty: a's full blocks may hold KV the failed step half wrote.
    assert plan(scheduler.schedule()) == [("a", 0, 11), ("b", 0, 8)]


def test_schedule_alone_runs_one_sequence_taking_blocks_from_the_others() -> None:
    # 4 blocks of 4 slots: a (10 tokens: 3 blocks) and b (7 tokens: 2) do not fit together.
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    a, b = make_seq("a", num_prompt=10), make_seq("b", num_prompt=7, first=40)
    scheduler.add(a)
    scheduler.add(b)

    alone = scheduler.schedule_alone("b")  # b, not a, although a arrived first
    assert plan(alone) == [("b", 0, 7)] and alone.preempted_ids == []
    scheduler.update(alone, ModelOutput(sampled={"b": [9]}))
    assert b.output_token_ids == [9] and a.status is SequenceStatus.WAITING

    alone = scheduler.schedule_alone("a")  # needs 3 blocks, 2 are free: b gives its own
    assert plan(alone) == [("a", 0, 10)] and alone.preempted_ids == ["b"]
    assert b.status is SequenceStatus.WAITING and b.output_token_ids == [9]
    scheduler.update(alone, ModelOutput(sampled={"a": [9]}))
    assert a.output_token_ids == [9] and len(a.block_ids) * BLOCK >= a.num_tokens - 1


def test_a_request_ends_with_reason_error_and_frees_its_blocks() -> None:
    scheduler = make_scheduler()
    seq: Sequence = make_seq("a")
    scheduler.add(seq)
    step(scheduler)
    assert scheduler.abort("a", FinishReason.ERROR) is seq
    assert seq.finish_reason is FinishReason.ERROR and seq.is_finished
    assert not scheduler.has_unfinished() and scheduler.block_manager.num_free_blocks == 64
    assert scheduler.abort("a", FinishReason.ERROR) is None
