"""Overlap scheduling on the CPU: step N + 1 is scheduled and launched before step N's
results reach the host, and greedy output is token for token what the whole-step engine
produces, for every speculation mode, with requests arriving, finishing, aborting and being
preempted between steps. The stand-ins for device streams and events are synchronous
(workers/runner/host_copy.py); the one-step lag and the device-side resolution of placeholder
tokens are the real code paths."""

from __future__ import annotations

from typing import Any

import pytest

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from tests.integration.scenario import MODES, PROMPTS, assert_same, run


@pytest.fixture(scope="module")
def whole_step() -> dict[str, list[int]]:
    out, _ = run(False, speculative_algorithm=None)
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_overlap_on_gives_the_whole_step_engines_output(
        whole_step: dict[str, list[int]], mode: str) -> None:
    got, core = run(True, **MODES[mode])
    assert_same(got, whole_step)
    assert not core.has_unfinished()
    if mode in ("no-head", "spec-off", "auto-threshold"):
        # Plain steps really overlapped: inputs came from samples the host had not read.
        assert core.runner.num_placeholders_resolved > 0
    if mode in ("chain", "tree", "auto-threshold"):
        assert core.stats().num_accepted > 0
        # Speculative steps really overlapped: verifies launched before the host knew
        # where they start (the drafts and the accepted count of the step in flight).
        assert core.spec is not None and core.spec.verifier.num_lagged_verifies > 0


def test_overlap_with_measured_auto_switching_often(whole_step: dict[str, list[int]]) -> None:
    got, core = run(True, spec_mode="auto", spec_disable_batch_threshold=2,
                    _explore_every=3)
    assert_same(got, whole_step)
    assert core.spec is not None and core.spec.controller.num_transitions >= 3
    assert core.runner.num_placeholders_resolved > 0
    assert core.spec.verifier.num_lagged_verifies > 0


def test_overlap_under_preemption(whole_step: dict[str, list[int]],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 blocks of 16 tokens cannot hold these requests at once: some are preempted, some
    # while a step that samples for them is still in flight (with speculation: a step
    # that verified and drafted for them on the device).
    # (Measured auto is left out here: its timing-driven choices change the step count,
    # and with it whether this small cache overflows at all.)
    from specd.workers.engine.scheduler import Scheduler

    preempted_in_flight: list[tuple[bool, bool]] = []  # (sample in flight, device drafts)
    real = Scheduler._preempt

    def preempt(self: Scheduler, seq: Any) -> None:
        preempted_in_flight.append((bool(seq.pending_sample_ids),
                                    seq.lagged_sample_id is not None))
        real(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    for options in ({"speculative_algorithm": None}, {"spec_mode": "on"},
                    {"spec_mode": "auto", "spec_auto_measure": False}):
        preempted_in_flight.clear()
        got, core = run(True, num_kv_blocks=10, **options)
        assert core.scheduler.num_preemptions > 0
        assert any(in_flight for in_flight, _ in preempted_in_flight)
        if core.spec is not None:
            assert any(drafts for _, drafts in preempted_in_flight)
        assert_same(got, whole_step)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_lagged_verify_at_the_wrong_start_is_caught(
        whole_step: dict[str, list[int]], mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The identity tests can fail: read every accepted count as 0 (as if the host's lower
    # bound were the start) and the lagged verifies check drafts at the wrong positions.
    from specd.workers.spec.futures import DraftFutures

    real = DraftFutures.write_accepted

    def forget(self: DraftFutures, index: Any, accepted: Any) -> None:
        real(self, index, accepted * 0)

    monkeypatch.setattr(DraftFutures, "write_accepted", forget)
    got, _ = run(True, **MODES[mode])
    assert got != whole_step


def test_overlapped_speculation_gives_the_whole_step_logprobs() -> None:
    def generate(overlap: bool) -> dict[str, tuple[list[int], list[Any]]]:
        core = EngineCore(EngineConfig(overlap_schedule=overlap, dtype="float32",
                                       spec_mode="on", spec_topk=3, spec_num_steps=3,
                                       spec_num_draft_tokens=8))
        for i in range(3):
            core.add_request(f"r{i}", PROMPTS[i], SamplingParams(
                max_tokens=12 + 4 * i, ignore_eos=True, logprobs=2 + i))
        out: dict[str, tuple[list[int], list[Any]]] = {f"r{i}": ([], []) for i in range(3)}
        while core.has_unfinished():
            for d in core.step():
                out[d.request_id][0].extend(d.new_token_ids)
                out[d.request_id][1].extend(d.logprobs)
        if overlap:
            assert core.spec is not None and core.spec.verifier.num_lagged_verifies > 0
        return out

    whole, overlapped = generate(False), generate(True)
    for request_id, (tokens, logprobs) in whole.items():
        got_tokens, got_logprobs = overlapped[request_id]
        assert got_tokens == tokens and len(got_logprobs) == len(logprobs) == len(tokens)
        for a, b in zip(got_logprobs, logprobs, strict=True):
            assert a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_whole_step_engine_never_reads_a_placeholder() -> None:
    _, core = run(False, speculative_algorithm=None)
    assert core.runner.num_placeholders_resolved == 0


def test_the_host_reads_a_step_only_after_launching_the_next() -> None:
    core = EngineCore(EngineConfig(speculative_algorithm=None, overlap_schedule=True))
    core.add_request("a", PROMPTS[2], SamplingParams(max_tokens=5, ignore_eos=True))
    seq = core.scheduler.sequences["a"]
    assert core.step() == []  # prefill launched; nothing processed yet
    assert seq.num_placeholders == 1 and seq.output_token_ids == []
    deltas = core.step()  # decode launched on the placeholder, then the prefill processed
    assert [len(d.new_token_ids) for d in deltas] == [1]
    assert seq.num_placeholders == 1 and len(seq.output_token_ids) == 1
    while core.has_unfinished():
        core.step()
    assert seq.num_output_tokens == 5 and seq.num_placeholders == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["no-head", "spec-off", "chain", "tree"])
def test_overlap_on_cuda_gives_the_whole_step_output(mode: str) -> None:
    # Real streams and events: the host reads step N only after launching step N + 1.
    options = {"device": "cuda", "dtype": "bfloat16", **MODES[mode]}
    expected, _ = run(False, **dict(options))
    got, core = run(True, **dict(options))
    assert_same(got, expected)
    if mode in ("chain", "tree"):
        assert core.spec is not None and core.spec.verifier.num_lagged_verifies > 0
    else:
        assert core.runner.num_placeholders_resolved > 0


def test_each_verify_waits_for_the_drafts_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Drafting runs on its own stream (a synchronous stand-in here): every verify must be
    # ordered after a draft section issued since the previous verify, and only then run.
    # Both ways of running the one pipeline: whole steps and overlapped ones.
    from specd.workers.spec.verify import Verifier

    order_at_verify: list[tuple[str, int]] = []
    cores: list[EngineCore] = []
    real = Verifier.verify

    def verify(self: Verifier, *args: Any) -> Any:
        spec = cores[-1].spec
        assert spec is not None
        order_at_verify.append(spec.streams.order[-1])
        return real(self, *args)

    monkeypatch.setattr(Verifier, "verify", verify)
    for overlap in (False, True):
        order_at_verify.clear()
        _, core = run(overlap, spec_mode="on", spec_topk=3, spec_num_steps=3,
                      spec_num_draft_tokens=8, _after_build=cores.append)
        assert core.spec is not None
        assert len(order_at_verify) >= 10
        _check_each_verify_waits_for_a_new_section(order_at_verify)


def _check_each_verify_waits_for_a_new_section(order_at_verify: list[tuple[str, int]]
                                               ) -> None:
    # The last stream record before each verify is a wait for the latest draft section...
    assert all(kind == "wait" for kind, _ in order_at_verify)
    # ...and a new section was drafted for every verify (none reuses older drafts).
    sections = [n for _, n in order_at_verify]
    assert sections == sorted(set(sections))
