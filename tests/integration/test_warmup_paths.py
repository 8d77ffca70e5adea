"""Warm-up runs every decode path the configuration enables, so a path whose code is broken
fails start-up instead of the first request that takes it (the incident: an attribute read
only on the logprobs path, or when the load crosses the speculation threshold, passed
start-up; the first such request killed the scheduler).

Paths are observed by wrapping the functions only that path calls; faults are planted the
same way (an AttributeError on first use, the incident's shape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from specd.exit_codes import EXIT_SOFTWARE
from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.block_manager import BlockManager
from specd.workers.engine.core import EngineCore
from specd.workers.engine.scheduler import Scheduler
from specd.workers.engine.sequence import FinishReason, Sequence
from specd.workers.runner import model_runner, sampler
from specd.workers.spec import step as spec_step
from specd.workers.spec import verify
from specd.workers.spec.controller import SpecController
from specd.workers.spec.worker import SpeculativeWorker
from specd.workers.structured.masks import StepMasks
from tests.integration.daemon_harness import Daemon
from tests.integration.test_startup_faults import plant_in_scheduler

# Small and exact: float32 (greedy is then deterministic), a cache of 256 blocks.
BASE: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 256}

Predicate = Callable[..., bool]  # (result, *args) -> whether this call took the path


def _sequences(batch: Any) -> list[Sequence]:
    return [s.seq for s in batch.scheduled]


# label -> (owner, attribute, predicate over the call's result and arguments)
PATHS: dict[str, tuple[Any, str, Predicate]] = {
    "logprobs in a plain step": (
        model_runner.ModelRunner, "logprobs", lambda result, *a: bool(result)),
    "logprobs of verified tokens": (
        spec_step.PendingSpec, "_resolve_verified", lambda result, self, v, sampled, lps:
            any(item.seq.sampling.logprobs for item in v.items)),
    "seeded generator": (
        model_runner.ModelRunner, "_generator", lambda result, self, seq: result is not None),
    "unseeded sampling": (
        sampler, "sample", lambda result, logits, params, generators, default: any(
            not p.is_greedy and g is None for p, g in zip(params, generators, strict=True))),
    "top-k/top-p/min-p filter": (sampler, "_filter", lambda result, *a: True),
    "penalties in a plain step": (
        sampler, "penalize", lambda result, logits, params, seqs: any(
            p.has_history_penalties for p in params)),
    "penalties in verification": (
        verify, "penalize_tree", lambda result, logits, tree, params, seqs: any(
            p.has_history_penalties for p in params)),
    "sampled acceptance": (
        verify, "accept_tree", lambda result, tree, logits, params, *a: any(
            not p.is_greedy for p in params)),
    "stop token id": (
        Sequence, "append_tokens", lambda result, seq, *a:
            seq.finish_reason is FinishReason.STOP
            and seq.output_token_ids[-1] in seq.sampling.stop_token_ids),
    "max_tokens 1": (
        Sequence, "append_tokens", lambda result, seq, *a:
            seq.is_finished and seq.sampling.max_tokens == 1),
    "abort": (Scheduler, "abort", lambda result, self, rid, reason=FinishReason.ABORT:
              result is not None and reason is FinishReason.ABORT),
    "prefix-cache hit": (BlockManager, "_find_cached", lambda result, *a: bool(result)),
    "chunked prefill": (
        Scheduler, "schedule", lambda batch, self: any(
            not s.needs_sample and s.seq.num_computed_tokens < s.seq.num_prompt_tokens
            for s in batch.scheduled)),
    "plain rows beside a verify": (
        SpeculativeWorker, "_launch_verify", lambda result, self, batch: any(
            not s.seq.sampling.speculative for s in batch.scheduled)),
    "speculation off above the threshold": (
        SpecController, "update", lambda event, *a:
            event is not None and event.cause == "batch_above_threshold"),
    "speculation on at the resume mark": (
        SpecController, "update", lambda event, *a:
            event is not None and event.cause == "batch_at_or_below_resume_mark"),
    "overlapped step": (EngineCore, "_step_overlapped", lambda result, *a: True),
    "grammar masks in a plain step": (
        StepMasks, "apply", lambda result, self, logits, seqs: any(
            s.request_id in self.layout for s in seqs)),
    "grammar masks in verification": (
        StepMasks, "apply_tree", lambda result, self, logits, seqs: any(
            s.request_id in self.layout for s in seqs)),
}

SPEC_PATHS = {"logprobs of verified tokens", "penalties in verification", "sampled acceptance",
              "plain rows beside a verify", "speculation off above the threshold",
              "speculation on at the resume mark", "grammar masks in verification"}


def watch(monkeypatch: pytest.MonkeyPatch, labels: set[str],
          on_path: Callable[[str], None]) -> None:
    """Wrap each path's function: `on_path(label)` after a call that took the path."""
    by_function: dict[tuple[Any, str], list[tuple[str, Predicate]]] = {}
    for label in labels:
        owner, name, predicate = PATHS[label]
        by_function.setdefault((owner, name), []).append((label, predicate))
    for (owner, name), checks in by_function.items():
        original = getattr(owner, name)

        def wrapped(*args: Any, _original: Any = original,
                    _checks: list[tuple[str, Predicate]] = checks, **kwargs: Any) -> Any:
            result = _original(*args, **kwargs)
            for label, predicate in _checks:
                if predicate(result, *args):  # keyword arguments are not read
                    on_path(label)
            return result

        monkeypatch.setattr(owner, name, wrapped)


CONFIGS: dict[str, tuple[dict[str, Any], set[str]]] = {
    # The daemon's defaults on the CPU: chains, auto at threshold 8, whole steps.
    "speculative": ({}, set(PATHS) - {"chunked prefill", "overlapped step"}),
    # Trees, overlap scheduling, a token budget small enough for a cheap chunked prefill.
    "tree-overlap-chunked": ({"spec_topk": 2, "spec_num_draft_tokens": 6,
                              "overlap_schedule": True, "max_num_batched_tokens": 64},
                             set(PATHS)),
    "plain": ({"speculative_algorithm": None, "overlap_schedule": True},
              set(PATHS) - SPEC_PATHS - {"chunked prefill"}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_warm_up_takes_every_path_the_configuration_enables(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    options, expected = CONFIGS[name]
    core = EngineCore(EngineConfig(**BASE, **options))
    seen: set[str] = set()
    watch(monkeypatch, expected, seen.add)
    core.warmup()
    assert expected - seen == set()
    # Warm-up is not the workload: nothing of it shows in the figures, and the mode and
    # marks are the configured ones again.
    stats = core.stats()
    assert (stats.num_steps, stats.num_generated_tokens, stats.num_drafted,
            stats.spec_transitions, stats.num_preemptions, stats.spec_measured_tok_s) == (
        0, 0, 0, 0, 0, {})
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    if core.spec is None:
        assert (stats.spec_mode, stats.spec_active) == ("off", False)
    else:
        assert (stats.spec_mode, stats.spec_active, stats.spec_threshold) == ("auto", True, 8)


@pytest.mark.parametrize("options", [{"max_num_seqs": 1}, {"max_model_len": 24}])
def test_a_configuration_that_cannot_switch_skips_that_round_saying_so(
        options: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """One sequence at a time never crosses a threshold; a 24-token limit cannot hold the
    request that lives across both switches. The rest still runs, and nothing fails."""
    core = EngineCore(EngineConfig(**BASE, **options))
    with caplog.at_level("INFO", logger="specd.engine"):
        core.warmup()
    events = [getattr(r, "event", None) for r in caplog.records]
    assert "warmup_skipped" in events
    (done,) = [r for r in caplog.records if getattr(r, "event", None) == "warmup"]
    assert done.rounds == ["options", "structured"]  # type: ignore[attr-defined]  # `extra`


# The incident's paths run in the quick tier; every other path of the default configuration
# in the slow one (about 3 s each: an engine per path).
INCIDENT_PATHS = ["logprobs in a plain step", "logprobs of verified tokens",
                  "speculation off above the threshold", "speculation on at the resume mark"]
OTHER_PATHS = sorted(CONFIGS["speculative"][1] - set(INCIDENT_PATHS))


@pytest.mark.parametrize("label", [*INCIDENT_PATHS, *(
    pytest.param(label, marks=pytest.mark.slow) for label in OTHER_PATHS)])
def test_a_path_broken_on_first_use_fails_warm_up_with_its_own_exception(
        label: str, monkeypatch: pytest.MonkeyPatch) -> None:
    core = EngineCore(EngineConfig(**BASE))

    def planted(path: str) -> None:
        raise AttributeError(f"planted: {path} reads an attribute never assigned")

    watch(monkeypatch, {label}, planted)
    with pytest.raises(AttributeError, match=f"planted: {label}"):
        core.warmup()


def test_the_same_fault_after_warm_up_fails_only_the_request_that_takes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Why warm-up must take the path: past start-up, the engine isolates the fault to the
    request (here a logprobs request), which is the crash the incident saw at first use."""
    core = EngineCore(EngineConfig(**BASE, speculative_algorithm=None))
    core.warmup()

    def planted(path: str) -> None:
        raise AttributeError("planted")

    watch(monkeypatch, {"logprobs in a plain step"}, planted)
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1))
    errors = [d.error for _ in range(10) for d in core.step() if d.error]
    assert errors == ["AttributeError: planted"]


def test_the_daemon_exits_70_naming_a_fault_on_the_logprobs_path(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plant_in_scheduler(tmp_path, monkeypatch, """
        from specd.workers.runner import model_runner

        original = model_runner.ModelRunner.logprobs

        def logprobs(self, logits, tokens, seqs):
            found = original(self, logits, tokens, seqs)
            if found:
                return self.planted_logprobs_table  # the incident's shape: never assigned
            return found

        model_runner.ModelRunner.logprobs = logprobs
    """)
    daemon = Daemon(tmp_path)
    try:
        assert daemon.wait(240) == EXIT_SOFTWARE
        (record,) = daemon.events("scheduler_failed")
        assert "stage warmup" in record["msg"] and "AttributeError" in record["msg"]
        assert "planted_logprobs_table" in record["scheduler_traceback"]
    finally:
        daemon.stop()
