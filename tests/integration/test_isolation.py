"""A step that raises because of one request fails that request, not the engine
(workers/engine/isolation.py). In-process engine on the fixture model (greedy, float32): a fault
is planted for request "p" among concurrent requests, in the runner (the sampler) or in
the host's update, with overlap scheduling and speculation on and off. "p" ends with an
error; every other request gets exactly the tokens of a run without the fault. A fault
that no single request reproduces still raises out of the engine."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.batch import ModelOutput, ScheduledBatch
from specd.workers.engine.core import EngineCore
from specd.workers.engine.isolation import StepFailed
from specd.workers.engine.records import RequestDelta
from specd.workers.engine.scheduler import Scheduler
from specd.workers.engine.sequence import Sequence
from specd.workers.runner import sampler
from tests.integration.heldout import heldout_prompt_ids

POISONED = "p"
PROMPTS = heldout_prompt_ids(4, 5, 11)
# (step at which it arrives, request id, prompt index, max_tokens)
ARRIVALS = [(0, "a", 0, 20), (0, "b", 1, 12), (1, POISONED, 2, 16), (2, "c", 3, 18)]
MODES: dict[str, dict[str, Any]] = {
    "no-head": {"speculative_algorithm": None},
    "spec-on": {"spec_mode": "on", "spec_topk": 1, "spec_num_steps": 4},
}


class PlantedFault(RuntimeError):
    pass


def params(request_id: str, max_tokens: int) -> SamplingParams:
    # "p" opts out of speculation so that every step of it samples through the sampler,
    # where the fault can be planted (a verify accepts drafts without it).
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                          speculative=request_id != POISONED)


def run(overlap: bool, mode: str, plant: Callable[[EngineCore], None] | None = None,
        ) -> tuple[dict[str, list[int]], dict[str, RequestDelta], EngineCore]:
    """The arrivals through `EngineCore.step`: tokens and last delta per request."""
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(max_num_batched_tokens=64, overlap_schedule=overlap,
                                   dtype="float32", **MODES[mode]))
    tokens: dict[str, list[int]] = {}
    last: dict[str, RequestDelta] = {}
    pending = list(ARRIVALS)
    step = 0
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= step:
            _, request_id, index, max_tokens = pending.pop(0)
            core.add_request(request_id, PROMPTS[index], params(request_id, max_tokens))
            tokens[request_id] = []
            if request_id == POISONED and plant is not None:
                plant(core)
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
            last[delta.request_id] = delta
        step += 1
    return tokens, last, core


def poisoned_seq(core: EngineCore) -> Sequence:
    return core.scheduler.sequences[POISONED]


def fault_in_sampler(monkeypatch: pytest.MonkeyPatch, after: int,
                     condition: Callable[[int], bool] | None = None,
                     ) -> Callable[[EngineCore], None]:
    """Plant: the sampler raises for a batch with p's row once p has `after` tokens
    (`condition(num_rows)`: raise for any batch with that many rows instead)."""

    def plant(core: EngineCore) -> None:
        seq, real = poisoned_seq(core), sampler.sample

        def sample(logits: torch.Tensor, rows: Any, *args: Any) -> torch.Tensor:
            if condition is not None:
                if seq.num_output_tokens >= after and condition(len(rows)):
                    raise PlantedFault(f"planted fault at {len(rows)} rows")
            elif seq.num_output_tokens >= after and any(
                    not p.speculative for p in rows):
                raise PlantedFault("planted fault in p's row\nsecond line")
            return real(logits, rows, *args)

        monkeypatch.setattr(sampler, "sample", sample)
    return plant


def fault_in_update(monkeypatch: pytest.MonkeyPatch, after: int
                    ) -> Callable[[EngineCore], None]:
    """Plant: the scheduler's update raises for a step with p in it once p has `after`
    tokens (with overlap, after the next step was launched)."""

    def plant(core: EngineCore) -> None:
        seq, real = poisoned_seq(core), Scheduler.update

        def update(self: Scheduler, batch: ScheduledBatch, output: ModelOutput
                   ) -> list[Sequence]:
            if seq.num_output_tokens >= after and any(s.seq is seq for s in batch.scheduled):
                raise PlantedFault("planted fault in p's update")
            return real(self, batch, output)

        monkeypatch.setattr(Scheduler, "update", update)
    return plant


@pytest.fixture(scope="module")
def clean() -> dict[str, list[int]]:
    tokens, last, _ = run(False, "no-head")
    assert all(d.finish_reason == "length" for d in last.values())
    return tokens


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [vars(r) for r in caplog.records if vars(r).get("event") == name]


@pytest.mark.parametrize("overlap", [False, True], ids=["whole", "overlap"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("site", "after"), [("sampler", 0), ("sampler", 5), ("update", 6)])
def test_the_poisoned_request_fails_and_the_others_get_their_tokens(
        clean: dict[str, list[int]], overlap: bool, mode: str, site: str, after: int,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="specd")
    plant = (fault_in_sampler(monkeypatch, after) if site == "sampler"
             else fault_in_update(monkeypatch, after))
    tokens, last, core = run(overlap, mode, plant)

    failed = last[POISONED]
    assert failed.finish_reason == "error"
    where = "row" if site == "sampler" else "update"
    assert failed.error == f"PlantedFault: planted fault in p's {where}"  # one line
    got = tokens[POISONED]
    assert len(got) >= after and got == clean[POISONED][: len(got)]
    for request_id in ("a", "b", "c"):
        assert last[request_id].finish_reason == "length" and last[request_id].error is None
        assert tokens[request_id] == clean[request_id], request_id
    assert not core.has_unfinished()
    stats = core.stats()
    assert (stats.num_step_failures, stats.num_requests_failed) == (1, 1)
    assert (stats.num_accepted > 0) == (mode == "spec-on")  # the others did speculate
    if overlap and core.spec is None:  # steps really overlapped: inputs came from samples
        assert core.runner.num_placeholders_resolved > 0  # the host had not read
    elif overlap:  # verifies launched before the host knew where they start
        assert core.spec is not None and core.spec.verifier.num_lagged_verifies > 0
    # One record for the isolation, one (with the traceback) for the failed request.
    [isolation] = events(caplog, "step_failure")
    assert isolation["outcome"] == "failed" and isolation["culprits"] == [POISONED]
    assert POISONED in isolation["request_ids"] and len(isolation["request_ids"]) > 1
    assert set(isolation["cleared"]) == set(isolation["request_ids"]) - {POISONED}
    [record] = [r for r in caplog.records if vars(r).get("event") == "request_failed"]
    assert vars(record)["request_id"] == POISONED and record.exc_info is not None


@pytest.mark.parametrize("overlap", [False, True], ids=["whole", "overlap"])
def test_a_fault_every_request_reproduces_alone_fails_the_engine(
        overlap: bool, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Whatever the batch: every suspect fails alone, so the engine (or device) is at fault.
    plant = fault_in_sampler(monkeypatch, 0, condition=lambda num_rows: True)
    with pytest.raises(StepFailed, match="each fails alone") as caught:
        run(overlap, "no-head", plant)
    assert isinstance(caught.value.__cause__, PlantedFault)
    [isolation] = events(caplog, "step_failure")
    assert isolation["outcome"] == "unattributable" and not isolation["cleared"]
    assert not events(caplog, "request_failed")  # no request was failed for it


@pytest.mark.parametrize("mode", list(MODES))
def test_a_fault_no_request_reproduces_alone_fails_the_engine(
        mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Only batches of 2+ sampled rows fail: every suspect runs alone without failing.
    plant = fault_in_sampler(monkeypatch, 0, condition=lambda num_rows: num_rows >= 2)
    with pytest.raises(StepFailed, match="none of them fails alone") as caught:
        run(False, mode, plant)
    assert isinstance(caught.value.__cause__, PlantedFault)
    [isolation] = events(caplog, "step_failure")
    assert isolation["outcome"] == "unattributable" and not isolation["culprits"]
    assert len(isolation["cleared"]) == len(isolation["request_ids"]) > 1


def test_a_lone_request_fails_at_once_but_not_twice_before_a_step_succeeds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(speculative_algorithm=None, dtype="float32"))
    real = sampler.sample
    broken = True

    def sample(*args: Any) -> torch.Tensor:
        if broken:
            raise PlantedFault("device lost")
        return real(*args)

    def step_alone(request_id: str) -> RequestDelta:
        core.add_request(request_id, PROMPTS[0], params(request_id, 3))
        while True:
            for delta in core.step():
                if delta.finish_reason is not None:
                    return delta

    monkeypatch.setattr(sampler, "sample", sample)
    # A step of one request that fails: that request is to blame, at once.
    assert step_alone("x").error == "PlantedFault: device lost"
    broken = False
    assert step_alone("y").finish_reason == "length"
    broken = True
    assert step_alone("z").error == "PlantedFault: device lost"  # a step succeeded since x
    # Failing again before any step succeeded: the device, not "w", is taken to be at fault
    # (a sticky device error would otherwise fail every request in turn).
    with pytest.raises(StepFailed, match="before any step succeeded"):
        step_alone("w")
    assert core.stats().num_requests_failed == 2
