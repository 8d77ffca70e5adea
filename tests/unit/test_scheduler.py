"""Scheduler: continuous batching on hand-built model outputs (no torch, no model)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import pytest

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.batch import ModelOutput, ScheduledBatch
from specd.workers.engine.scheduler import Scheduler
from specd.workers.engine.sequence import FinishReason, Sequence, SequenceStatus

BLOCK = 4
EOS = 2


def make_scheduler(
    num_blocks: int = 64, max_model_len: int = 64, **options: Any,
) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, **options)
    return Scheduler(config, num_blocks=num_blocks, max_model_len=max_model_len,
                     eos_token_ids=(EOS,))


def make_seq(request_id: str, num_prompt: int = 6, first: int = 10, **sampling: Any) -> Sequence:
    return Sequence(request_id, list(range(first, first + num_prompt)), SamplingParams(**sampling))


def plan(batch: ScheduledBatch) -> list[tuple[str, int, int]]:
    """(request id, first token computed, tokens computed) per scheduled sequence."""
    return [(s.seq.request_id, s.start, s.num_new_tokens) for s in batch.scheduled]


def step(
    scheduler: Scheduler, next_tokens: Callable[[Sequence], list[int]] = lambda seq: [7],
) -> tuple[list[tuple[str, int, int]], list[Sequence]]:
    """schedule -> a stand-in model that samples `next_tokens(seq)` -> update.

    Returns the step's plan (taken before `update` moves the sequences on) and what
    `update` returned; the batch itself is `scheduler.last_batch`."""
    batch = scheduler.schedule()
    planned = plan(batch)
    sampled = {s.seq.request_id: next_tokens(s.seq) for s in batch.scheduled if s.needs_sample}
    return planned, scheduler.update(batch, ModelOutput(sampled=sampled))


def test_prefill_then_decode_one_token_per_step() -> None:
    scheduler = make_scheduler()
    seq = make_seq("a", num_prompt=6)
    scheduler.add(seq)
    planned, changed = step(scheduler)
    assert planned == [("a", 0, 6)] and changed == [seq]
    assert seq.output_token_ids == [7] and seq.num_computed_tokens == 6
    planned, changed = step(scheduler)
    assert planned == [("a", 6, 1)] and seq.output_token_ids == [7, 7]
    assert len(seq.block_ids) == 2  # 8 tokens, the 8th not computed yet


def test_chunked_prefill_splits_a_long_prompt_and_running_goes_first() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    long, short = make_seq("long", num_prompt=10), make_seq("short", num_prompt=3, first=50)
    scheduler.add(long)
    scheduler.add(short)
    planned, changed = step(scheduler)
    assert planned == [("long", 0, 4)] and changed == []
    assert long.output_token_ids == [] and long.num_computed_tokens == 4
    assert step(scheduler)[0] == [("long", 4, 4)]
    # The last chunk leaves 2 tokens of budget for the next waiting prompt's first chunk.
    planned, changed = step(scheduler)
    assert planned == [("long", 8, 2), ("short", 0, 2)] and changed == [long]
    assert long.output_token_ids == [7]
    planned, changed = step(scheduler)
    assert planned == [("long", 10, 1), ("short", 2, 1)] and changed == [long, short]


def test_the_running_cap_holds_back_waiting_sequences_fcfs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(name, first=10 + 100 * i, max_tokens=2) for i, name in enumerate("abc")]
    for seq in seqs:
        scheduler.add(seq)
    planned, _ = step(scheduler)
    assert [request_id for request_id, _, _ in planned] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    _, changed = step(scheduler)  # a and b reach max_tokens
    assert [s.finish_reason for s in changed] == [FinishReason.LENGTH] * 2
    planned, _ = step(scheduler)
    assert planned == [("c", 0, 6)]


def test_a_shared_prefix_is_not_recomputed() -> None:
    scheduler = make_scheduler()
    first = make_seq("a", num_prompt=9, max_tokens=1)
    scheduler.add(first)
    step(scheduler)
    assert first.is_finished and scheduler.block_manager.num_free_blocks == 64
    second = Sequence("b", first.prompt_token_ids[:8] + [99, 98], SamplingParams())
    scheduler.add(second)
    planned, _ = step(scheduler)
    assert planned == [("b", 8, 2)]
    assert second.num_cached_tokens == 8
    assert scheduler.stats().blocks.prefix_hit_tokens == 8


def test_prefix_caching_off_recomputes_everything() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    scheduler.add(make_seq("a", num_prompt=9, max_tokens=1))
    step(scheduler)
    scheduler.add(make_seq("b", num_prompt=9))
    assert step(scheduler)[0] == [("b", 0, 9)]


def run_two_until_preemption(enable_prefix_caching: bool) -> tuple[Scheduler, Sequence, Sequence]:
    """4 blocks of 4 slots; two 7-token prompts fill them, then a needs a third block."""
    scheduler = make_scheduler(num_blocks=4, max_model_len=16,
                               enable_prefix_caching=enable_prefix_caching)
    a, b = make_seq("a", num_prompt=7, max_tokens=4), make_seq("b", num_prompt=7, first=40)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler)[0] == [("a", 0, 7), ("b", 0, 7)]
    assert step(scheduler)[0] == [("a", 7, 1), ("b", 7, 1)]
    assert scheduler.block_manager.num_free_blocks == 0
    return scheduler, a, b


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_frees_the_latest_arrival_and_recomputes_it(
    enable_prefix_caching: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler, a, b = run_two_until_preemption(enable_prefix_caching)
    caplog.set_level(logging.INFO, logger="specd.scheduler")
    planned, _ = step(scheduler)  # a's 9th token needs a block: b is preempted
    assert planned == [("a", 8, 1)] and scheduler.last_batch.preempted_ids == ["b"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_ids == [] and b.num_preemptions == 1
    assert b.output_token_ids == [7, 7], "output tokens survive; they are recomputed"
    assert scheduler.stats().num_preemptions == 1
    # Each preemption is one structured log record, not an entry kept in a list.
    [event] = [vars(r) for r in caplog.records if vars(r).get("event") == "preemption"]
    assert (event["request_id"], event["cause"], event["num_tokens"],
            event["num_computed_tokens"]) == ("b", "no_free_block", 9, 8)

    _, changed = step(scheduler)  # a finishes (max_tokens 4); b waits for its blocks
    assert changed == [a] and a.finish_reason is FinishReason.LENGTH
    planned, _ = step(scheduler)
    # b recomputes prompt + output; with prefix caching its first block was kept cached.
    first = 4 if enable_prefix_caching else 0
    assert planned == [("b", first, 9 - first)]
    assert b.num_cached_tokens == 0, "num_cached_tokens counts the first admission only"
    assert b.output_token_ids == [7, 7, 7]


def test_a_sequence_preempts_itself_when_it_is_the_latest_arrival() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    a, b = make_seq("a", num_prompt=6), make_seq("b", num_prompt=7, first=40)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)  # a: 2 blocks (6 tokens), b: 2 blocks
    step(scheduler)  # a computes position 6, b position 7
    planned, _ = step(scheduler)  # a needs slot 7 (in its block 1); b slot 8, a third block
    assert planned == [("a", 7, 1)] and scheduler.last_batch.preempted_ids == ["b"]


def test_abort_waiting_and_running() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq("run"), make_seq("wait")
    scheduler.add(running)
    scheduler.add(waiting)
    batch = scheduler.schedule()
    assert scheduler.abort("wait") is waiting
    assert scheduler.abort("run") is running
    for seq in (running, waiting):
        assert seq.finish_reason is FinishReason.ABORT and seq.block_ids == []
    assert scheduler.abort("run") is None and scheduler.abort("nope") is None
    # The step that was in flight when "run" was aborted changes nothing.
    assert scheduler.update(batch, ModelOutput(sampled={"run": [7]})) == []
    assert running.output_token_ids == []
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 64


def finish_with(
    tokens: list[int], eos_ids_ignored: bool = False, max_model_len: int = 64, **sampling: Any,
) -> Sequence:
    """Decode until the sequence finishes, sampling `tokens` one per step."""
    scheduler = make_scheduler(max_model_len=max_model_len)
    seq = make_seq("s", ignore_eos=eos_ids_ignored, **sampling)
    scheduler.add(seq)
    queue = list(tokens)
    while scheduler.has_unfinished():
        step(scheduler, lambda _seq: [queue.pop(0)])
    assert scheduler.block_manager.num_free_blocks == 64
    return seq


def test_stop_conditions() -> None:
    eos = finish_with([5, EOS, 6])
    assert (eos.output_token_ids, eos.finish_reason) == ([5, EOS], FinishReason.STOP)
    ignored = finish_with([EOS, EOS, 6], eos_ids_ignored=True, max_tokens=3)
    assert (ignored.output_token_ids, ignored.finish_reason) == ([EOS, EOS, 6],
                                                                 FinishReason.LENGTH)
    stop_id = finish_with([5, 9, 6], eos_ids_ignored=True, stop_token_ids=(9,))
    assert (stop_id.output_token_ids, stop_id.finish_reason) == ([5, 9], FinishReason.STOP)
    length = finish_with([5, 5, 5], max_tokens=2)
    assert (length.output_token_ids, length.finish_reason) == ([5, 5], FinishReason.LENGTH)
    model_len = finish_with([5, 5, 5], max_model_len=8)  # 6 prompt tokens + 2
    assert (model_len.output_token_ids, model_len.finish_reason) == ([5, 5],
                                                                     FinishReason.LENGTH)
    # The last allowed token being EOS finishes for length, as in vLLM and SGLang.
    both = finish_with([5, EOS], max_tokens=2)
    assert both.finish_reason is FinishReason.LENGTH


def test_a_prompt_of_max_model_len_gets_exactly_one_token() -> None:
    seq = finish_with([5, 5], max_model_len=6)
    assert (seq.output_token_ids, seq.finish_reason) == ([5], FinishReason.LENGTH)


def start_decoding(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.add(seq)
    step(scheduler)
    assert seq.num_computed_tokens == seq.num_tokens - 1


@pytest.mark.parametrize("num_accepted", [0, 1, 3])
def test_speculation_arithmetic(num_accepted: int) -> None:
    scheduler = make_scheduler()
    seq = make_seq("a", num_prompt=6)
    start_decoding(scheduler, seq)  # 7 tokens, 6 computed
    drafts = [20, 21, 22]
    seq.spec_token_ids = list(drafts)
    batch = scheduler.schedule()
    # The last real token plus 3 drafts: positions 6..9, blocks for 10 tokens.
    assert plan(batch) == [("a", 6, 4)] and len(seq.block_ids) == 3
    sampled = drafts[:num_accepted] + [30]
    assert scheduler.update(batch, ModelOutput(sampled={"a": sampled})) == [seq]
    assert seq.output_token_ids == [7] + sampled
    assert seq.num_computed_tokens == 6 + 4 - (3 - num_accepted) == seq.num_tokens - 1
    assert seq.spec_token_ids == []


def test_tokens_after_a_stop_among_accepted_drafts_are_dropped() -> None:
    scheduler = make_scheduler()
    seq = make_seq("a", num_prompt=6)
    start_decoding(scheduler, seq)
    seq.spec_token_ids = [20, EOS, 22]
    batch = scheduler.schedule()
    assert scheduler.update(batch, ModelOutput(sampled={"a": [20, EOS, 22, 30]})) == [seq]
    assert seq.output_token_ids == [7, 20, EOS] and seq.finish_reason is FinishReason.STOP
    assert scheduler.block_manager.num_free_blocks == 64


def test_drafts_are_trimmed_to_the_budget_and_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=6, max_num_batched_tokens=4)
    seq = make_seq("a", num_prompt=3)
    start_decoding(scheduler, seq)  # 4 tokens: room for 2 more positions
    seq.spec_token_ids = [20, 21, 22, 23, 24]
    assert plan(scheduler.schedule()) == [("a", 3, 3)] and seq.spec_token_ids == [20, 21]

    scheduler = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq("b", num_prompt=3)
    start_decoding(scheduler, seq)  # the budget allows the last token and 3 drafts
    seq.spec_token_ids = [20, 21, 22, 23, 24]
    assert plan(scheduler.schedule()) == [("b", 3, 4)] and seq.spec_token_ids == [20, 21, 22]


def test_more_sampled_tokens_than_drafts_allow_is_an_error() -> None:
    scheduler = make_scheduler()
    seq = make_seq("a")
    start_decoding(scheduler, seq)
    seq.spec_token_ids = [20]
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="expected 1 to 2 sampled tokens"):
        scheduler.update(batch, ModelOutput(sampled={"a": [20, 21, 22]}))


def test_bad_requests_and_configurations() -> None:
    scheduler = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match=r"9 tokens, more than max_model_len \(8\)"):
        scheduler.add(make_seq("long", num_prompt=9))
    scheduler.add(make_seq("a"))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add(make_seq("a"))
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_scheduler(num_blocks=2, max_model_len=9)


def test_stats_describe_the_last_step() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_seq("a"))
    scheduler.add(make_seq("b"))
    step(scheduler)
    stats = scheduler.stats()
    assert (stats.num_steps, stats.num_running, stats.num_waiting) == (1, 1, 1)
    assert (stats.num_scheduled_seqs, stats.num_scheduled_tokens) == (1, 6)
    assert stats.num_preemptions == 0 and stats.blocks.num_free_blocks == 62


def true_next(token_ids: list[int]) -> int:
    """The stand-in model's greedy next token: a function of the whole prefix."""
    return (sum(token_ids[-3:]) * 31 + len(token_ids)) % 40 + 1  # 1..40; EOS (2) happens


def reference_output(seq: Sequence, max_model_len: int) -> list[int]:
    """What greedy decoding must produce for seq, computed without the scheduler."""
    tokens, output = list(seq.prompt_token_ids), []
    params = seq.sampling
    while True:
        token = true_next(tokens)
        tokens.append(token)
        output.append(token)
        if (len(output) >= params.max_tokens or len(tokens) >= max_model_len
                or (token == EOS and not params.ignore_eos)):
            return output


class KVSimulator:
    """Stands in for the runner: a dict slot -> the prefix whose KV it holds.

    Before a step computes tokens [start, end) of a sequence, every slot of positions
    [0, start) must hold exactly that sequence's prefix: this catches wrong block tables,
    wrong prefix-cache hits, and blocks freed or reused while still needed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}

    def slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def run(self, batch: ScheduledBatch) -> ModelOutput:
        sampled: dict[str, list[int]] = {}
        for item in batch.scheduled:
            seq = item.seq
            tokens = seq.all_token_ids + seq.spec_token_ids
            assert item.num_new_tokens >= 1 and item.end <= len(seq.block_ids) * self.block_size
            prefixes = [hash(tuple(tokens[:position + 1])) for position in range(item.end)]
            for position in range(item.start):
                assert self.slots.get(self.slot(seq, position)) == prefixes[position]
            for position in range(item.start, item.end):
                self.slots[self.slot(seq, position)] = prefixes[position]
            if item.needs_sample:
                sampled[seq.request_id] = self.verify(seq)
        return ModelOutput(sampled=sampled)

    @staticmethod
    def verify(seq: Sequence) -> list[int]:
        """Greedy acceptance: drafts are accepted while they equal the model's next token;
        the first mismatch (or the token after the last draft) is the model's own."""
        context, result = seq.all_token_ids, []
        for draft in seq.spec_token_ids:
            result.append(true_next(context))
            if result[-1] != draft:
                return result
            context = context + [draft]
        return result + [true_next(context)]


def check_block_references(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    holders = [0] * manager.num_blocks
    for seq in scheduler.running:
        assert len(set(seq.block_ids)) == len(seq.block_ids)
        for block_id in seq.block_ids:
            holders[block_id] += 1
    assert [block.ref_count for block in manager.blocks] == holders
    assert set(manager.free_block_ids) == {i for i, n in enumerate(holders) if n == 0}
    for seq in scheduler.waiting:
        assert seq.block_ids == [] and seq.num_computed_tokens == 0


@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_keep_the_cache_consistent_and_decode_greedily(seed: int) -> None:
    """Random arrivals, budgets, block counts, drafts and aborts. Every finished sequence
    must equal greedy decoding without the scheduler, whatever was preempted or shared."""
    rng = random.Random(seed)
    max_model_len = 32
    scheduler = make_scheduler(
        num_blocks=rng.randint(max_model_len // BLOCK, 14), max_model_len=max_model_len,
        max_num_batched_tokens=rng.choice([4, 8, 16, 64]), max_num_seqs=rng.randint(1, 6),
        enable_prefix_caching=rng.random() < 0.7)
    simulator = KVSimulator(BLOCK)
    prefixes = [[rng.randint(3, 40) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    pending: list[Sequence] = []
    for i in range(rng.randint(4, 12)):
        prompt = rng.choice(prefixes) + [rng.randint(3, 40) for _ in range(rng.randint(0, 10))]
        pending.append(Sequence(f"r{i}", prompt, SamplingParams(
            max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3)))
    finished: list[Sequence] = []
    for _ in range(1000):
        if not pending and not scheduler.has_unfinished():
            break
        if pending and rng.random() < 0.7:
            scheduler.add(pending.pop(0))
        if scheduler.running and rng.random() < 0.03:
            aborted = scheduler.abort(rng.choice(scheduler.running).request_id)
            assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
        for seq in scheduler.running:
            if seq.num_computed_tokens == seq.num_tokens - 1 and rng.random() < 0.5:
                context = seq.all_token_ids
                drafts = []
                for _ in range(rng.randint(1, 4)):
                    token = true_next(context) if rng.random() < 0.7 else rng.randint(3, 40)
                    drafts.append(token)
                    context = context + [token]
                seq.spec_token_ids = drafts
        batch = scheduler.schedule()
        check_block_references(scheduler)
        changed = scheduler.update(batch, simulator.run(batch))
        check_block_references(scheduler)
        finished += [seq for seq in changed if seq.is_finished]
    assert not scheduler.has_unfinished() and not pending
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    for seq in finished:
        assert seq.output_token_ids == reference_output(seq, max_model_len), seq.request_id


@pytest.mark.parametrize(("accepted_first", "accepted_second"), [(0, 0), (3, 1), (2, 3)])
def test_a_lagged_verify_is_scheduled_before_the_verify_in_flight_is_read(
        accepted_first: int, accepted_second: int) -> None:
    # Overlap scheduling of speculation: step 2 verifies drafts that step 1 made on the
    # device, scheduled before step 1's result is known. Its start is a lower bound (every
    # draft of step 1 rejected) with max_shift = step 1's drafts; the blocks cover the
    # latest start, and after both updates the bookkeeping is the whole-step one.
    scheduler = make_scheduler()
    seq = make_seq("a", num_prompt=6)
    start_decoding(scheduler, seq)  # 7 tokens, 6 computed
    seq.spec_token_ids = [20, 21, 22]
    first = scheduler.schedule()  # verifies positions 6..9 (host drafts)
    seq.lagged_sample_id, seq.num_lagged_drafts = first.scheduled[0].sample_id, 3
    second = scheduler.schedule()
    item = second.scheduled[0]
    assert plan(second) == [("a", 7, 4)]  # the root is at 7 + accepted_first
    assert item.lagged_sample_id == first.scheduled[0].sample_id and item.max_shift == 3
    assert item.num_drafts == 3 and item.needs_sample
    assert len(seq.block_ids) * BLOCK >= 7 + 3 + 4  # latest start + 4 rows
    sampled1 = [20, 21, 22][:accepted_first] + [30]
    sampled2 = [40, 41, 42][:accepted_second] + [50]
    scheduler.update(first, ModelOutput(sampled={"a": sampled1}))
    assert seq.lagged_sample_id is None  # read: no later launch drafted for it here
    scheduler.update(second, ModelOutput(sampled={"a": sampled2}))
    assert seq.output_token_ids == [7] + sampled1 + sampled2
    assert seq.num_computed_tokens == seq.num_tokens - 1
    assert seq.pending_sample_ids == []


def test_a_lagged_verify_that_does_not_fit_sits_the_step_out() -> None:
    # max_model_len 13: a verify of 4 rows from a latest start of 7 + 3 would pass it, so
    # the sequence waits for the step in flight; its device drafts are stale after that.
    scheduler = make_scheduler(max_model_len=13)
    seq = make_seq("a", num_prompt=6)
    start_decoding(scheduler, seq)
    seq.spec_token_ids = [20, 21, 22]
    first = scheduler.schedule()
    seq.lagged_sample_id, seq.num_lagged_drafts = first.scheduled[0].sample_id, 3
    assert scheduler.schedule().is_empty
    scheduler.update(first, ModelOutput(sampled={"a": [20, 30]}))
    assert seq.lagged_sample_id is None and seq.num_lagged_drafts == 0
    assert plan(scheduler.schedule()) == [("a", 8, 1)]  # a plain step from the host's view


def test_preemption_and_leaving_overlap_drop_device_drafts() -> None:
    scheduler = make_scheduler()
    a, b = make_seq("a"), make_seq("b", first=30)
    start_decoding(scheduler, a)
    start_decoding(scheduler, b)
    for seq in (a, b):
        seq.lagged_sample_id, seq.num_lagged_drafts = 99, 3
    scheduler._preempt(b)
    assert b.lagged_sample_id is None and b.num_lagged_drafts == 0
    scheduler.drop_lagged_drafts()
    assert a.lagged_sample_id is None and a.num_lagged_drafts == 0
