"""The engine: `EngineCore`, step-level, driven by the scheduler process and by the
in-process API (`engine_api.Engine`).

One step reads `schedule -> execute -> update`; features (the speculative worker, the
controller) are objects behind `execute`, not branches in the loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from specd.ipc.sampling import SamplingParams
from specd.workers.batch import ModelOutput, ScheduledBatch, TokenLogprobs
from specd.workers.config import EngineConfig, EngineResolved
from specd.workers.model_config import ModelConfig
from specd.workers.model_runner import ModelRunner, PendingOutput
from specd.workers.scheduler import Scheduler
from specd.workers.sequence import Sequence as Seq
from specd.workers.spec.controller import SpecController, SpecEvent
from specd.workers.spec.draft_model import load_draft_head, resolve_aux_layer_ids
from specd.workers.spec.step import PendingSpec
from specd.workers.spec.worker import (
    SpecFigures,
    SpeculativeWorker,
    read_draft_config,
    verify_query_len,
)

log = logging.getLogger("specd.engine")


@dataclass(frozen=True)
class RequestDelta:
    """What one step produced for one request. Figures are cumulative for the request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs]
    num_drafted: int = 0
    num_accepted: int = 0


@dataclass(frozen=True)
class _InFlight:
    """A launched step whose results the host has not read yet (overlap scheduling):
    a plain step (`PendingOutput`) or a speculative one (`PendingSpec`)."""

    batch: ScheduledBatch
    pending: PendingOutput | PendingSpec
    t0: float


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for status, stats and `specctl top`."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_steps: int
    num_generated_tokens: int
    num_preemptions: int
    spec_mode: str
    spec_active: bool
    num_drafted: int
    num_accepted: int
    num_verify_passes: int = 0
    acceptance_length: float = 0.0
    # accepted_at_depth[d] / num_verify_passes: acceptance rate of draft position d + 1
    accepted_at_depth: tuple[int, ...] = ()
    spec_transitions: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    catch_up_s: float = 0.0
    # auto's measured output tokens/s per batch-size bucket: "4-7" -> [on, off] (0 = not
    # measured yet), so `specctl stats` shows why it speculates or not.
    spec_measured_tok_s: dict[str, list[float]] = field(default_factory=dict)


class EngineCore:
    """Scheduler + model runner. Built whole or not at all (construction raises)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_path)
        # Without a draft model the runner runs steps itself; with one, the speculative
        # worker wraps it (and the runner captures the head's hidden states every step).
        self.spec: SpeculativeWorker | None = _build_speculative(config, self.model_config)
        self.runner = (self.spec.runner if self.spec is not None
                       else ModelRunner(config, self.model_config))
        self.max_model_len = _max_model_len(config, self.model_config, self.runner.num_kv_blocks)
        self.scheduler = Scheduler(
            config, self.runner.num_kv_blocks, self.max_model_len, self.model_config.eos_token_ids
        )
        self.overlap = config.overlap_enabled
        self._in_flight: _InFlight | None = None  # overlap: the launched, unprocessed step
        self._last_finish = 0.0
        # Whether work was left when the last step finished: then the time until the next
        # step (the scheduler process's messaging, new requests) is part of serving it.
        self._busy_after_last = False
        # request id -> number of output tokens already reported in a delta
        self._num_emitted: dict[str, int] = {}
        self._num_steps = 0
        self._num_generated = 0

    @property
    def resolved(self) -> EngineResolved:
        """What the engine found at start-up (and what its graphs or compiled decode came
        to, which warm-up may change: a compilation that failed)."""
        config = self.config
        return EngineResolved(
            model_name=config.model_path.name,
            num_kv_blocks=self.runner.num_kv_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            dtype=self.runner.dtype_name,
            device=config.device,
            eos_token_ids=self.model_config.eos_token_ids,
            speculative=self.spec is not None,
            overlap_schedule=config.overlap_enabled,
            graphs=_graphs_status(self.runner, self.spec),
            graph_memory_bytes=(
                self.runner.backend.memory_bytes
                + (0 if self.spec is None else self.spec.drafter.loop_runner.memory_bytes)),
        )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        """Queue a request. ValueError for a duplicate id, an empty or too-long prompt, or
        token ids outside the vocabulary."""
        if request_id in self._num_emitted:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; this model allows at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        self.scheduler.add(Seq(request_id, prompt_token_ids, sampling))
        self._num_emitted[request_id] = 0

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued or running request; False if it is unknown or already done."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestDelta]:
        """One engine step: schedule -> execute -> update. Returns a delta per request that
        got tokens or finished.

        With overlap scheduling the step is split: schedule and launch step N, then
        process step N - 1's results (which the host reads only now), so the deltas lag
        one call behind. Speculative steps overlap too (spec/worker.py: accepted counts
        and drafts stay on the device); speculation turned off drains the step in flight
        and runs one whole step (see `_can_overlap`).
        """
        if self.overlap and self._can_overlap():
            return self._step_overlapped()
        deltas = self._drain()
        # The next step runs from what the host knows: drafts made on the device by the
        # step just drained are not verified (the sequences decode one plain step).
        self.scheduler.drop_lagged_drafts()
        return deltas + self._step_whole()

    def _can_overlap(self) -> bool:
        """Whether the next step can be launched before the one in flight is read. Not
        while speculation is off and the step in flight drafted on the device (the verifies
        of those drafts could not be scheduled without drafting again), nor while drafts
        the host knows wait (a whole step verifies them): drain, and run a whole step."""
        if self.spec is None or self.spec.controller.enabled:
            return True
        in_flight = self._in_flight
        if (in_flight is not None and isinstance(in_flight.pending, PendingSpec)
                and in_flight.pending.drafted is not None):
            return False
        return not any(s.spec_token_ids for s in self.scheduler.running)

    def _step_overlapped(self) -> list[RequestDelta]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        launched = None
        if not batch.is_empty:
            pending: PendingOutput | PendingSpec
            pending = (self.runner.launch(batch) if self.spec is None
                       else self.spec.launch(batch))
            launched = _InFlight(batch, pending, t0)
        deltas = self._drain()
        if self.spec is not None:
            # Drafts for the sequences of the step just launched (made by it, or by the
            # controller turning speculation on in `_drain`) stay on the device: the next
            # step verifies them lagged.
            self.scheduler.update_draft_token_ids(
                self.spec.take_draft_token_ids(on_device=True))
        self._in_flight = launched
        return deltas

    def _drain(self) -> list[RequestDelta]:
        """Process the step in flight, if any (its results reach the host here)."""
        if self._in_flight is None:
            return []
        in_flight, self._in_flight = self._in_flight, None
        pending = in_flight.pending
        return self._finish(in_flight.batch, pending.resolve(), in_flight.t0,
                            pending if isinstance(pending, PendingSpec) else None)

    def _step_whole(self) -> list[RequestDelta]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        output = (self.runner.execute(batch) if self.spec is None
                  else self.spec.execute(batch))
        deltas = self._finish(batch, output, t0)
        if self.spec is not None:
            # Its drafts, read on the host: after update, which consumed the previous ones.
            self.scheduler.update_draft_token_ids(
                self.spec.take_draft_token_ids(on_device=False))
        return deltas

    def _finish(self, batch: ScheduledBatch, output: ModelOutput, t0: float,
                spec_pending: PendingSpec | None = None) -> list[RequestDelta]:
        """update -> (speculation: the controller's figures and decision) -> deltas.
        `spec_pending`: the step was an overlapped speculative one."""
        updated = self.scheduler.update(batch, output)
        if self.spec is not None:
            controller = self.spec.controller
            # The state this step ran in (an overlapped step was launched before the last
            # decision: whether it verified or drafted).
            ran_speculating = (controller.enabled if spec_pending is None
                               else spec_pending.speculates)
            _log_switch(self.spec.update_controller(self.scheduler.num_running))
            step_s = self._step_time(t0)
            # Every step is a sample of the state it ran in, prefill and all (drafting for
            # the next step included): what a mode yields is its regime's throughput, request
            # turnover included. The controller leaves out the steps around each switch.
            if step_s > 0:
                controller.record(len(batch.scheduled), ran_speculating, step_s,
                                  sum(len(t) for t in output.sampled.values()))
        else:
            self._step_time(t0)
        self._num_steps += 1
        return [self._delta(seq, output.logprobs.get(seq.request_id, [])) for seq in updated]

    def _step_time(self, t0: float) -> float:
        """The finished step's share of wall time: since the previous step finished if that
        one left work behind (the gap between steps, spent by the caller on messaging and
        new requests, is part of the cost of serving: without it a mode that emits more
        tokens per step, and so more messages, would look cheaper than it is), else since
        this step started (the engine was idle)."""
        now = time.perf_counter()
        step_s = now - (self._last_finish if self._busy_after_last else t0)
        self._last_finish = now
        self._busy_after_last = self.scheduler.has_unfinished()
        return step_s

    def _delta(self, seq: Seq, logprobs: list[TokenLogprobs]) -> RequestDelta:
        start = self._num_emitted.get(seq.request_id, 0)
        new = seq.output_token_ids[start:]
        self._num_emitted[seq.request_id] = seq.num_output_tokens
        self._num_generated += len(new)
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        drafted, accepted = (self.spec.request_figures(seq.request_id)
                             if self.spec is not None else (0, 0))
        if seq.is_finished:
            self._forget(seq.request_id)
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=new,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs[: len(new)],
            num_drafted=drafted,
            num_accepted=accepted,
        )

    def _forget(self, request_id: str) -> None:
        self._num_emitted.pop(request_id, None)
        if self.spec is not None:
            self.spec.release(request_id)
        else:
            self.runner.release(request_id)

    def set_spec_mode(self, mode: str, threshold: int | None = None) -> None:
        """Change speculation at run time: mode on|off|auto, and the auto threshold (the
        resume mark follows it). ValueError for a bad mode/threshold, or for on/auto
        without a draft model."""
        if self.spec is None:
            if mode != "off":
                raise ValueError(f"spec mode {mode!r} needs a draft model; this engine has "
                                 "none (speculative_algorithm or draft_model unset)")
            return
        _log_switch(self.spec.controller.set_mode(mode, threshold))

    def warmup(self) -> None:
        """Run every path once (prefill, decode, sampling) so the first request pays nothing."""
        ids = [1, 2, 3]
        for i, params in enumerate((SamplingParams(max_tokens=2),
                                    SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9))):
            self.add_request(f"__warmup{i}", ids, params)
        while self.has_unfinished():
            self.step()
        if self.runner.backend.compiles:
            self._warm_compiled(ids)
        if self.spec is not None:
            self.spec.controller.forget_measurements()  # warm-up steps are not the workload

    def _warm_compiled(self, ids: list[int]) -> None:
        """Compile every step kind now, not at the first request that needs it: decode and
        (with a head) verify, each at batch size 1 and >= 2 (cpu_decode.py). Speculation is
        switched for this (logged, like every switch) and restored."""
        controller = self.spec.controller if self.spec is not None else None
        saved = None
        if controller is not None:
            saved = (controller.mode, controller.threshold, controller.resume_at)
        for mode in ("off", "on") if controller is not None else ("off",):
            if controller is not None:
                _log_switch(controller.set_mode(mode))
            for batch in (2, 1):
                for i in range(batch):
                    # Long enough for whole draft trees (shorter ones run eagerly).
                    self.add_request(f"__warmup_{mode}_{batch}_{i}", ids,
                                     SamplingParams(max_tokens=24, ignore_eos=True))
                while self.has_unfinished():
                    self.step()
        if controller is not None and saved is not None:
            _log_switch(controller.set_mode(*saved))

    def stats(self) -> EngineStats:
        blocks = self.scheduler.block_manager
        fig = self.spec.figures if self.spec is not None else SpecFigures()
        controller = self.spec.controller if self.spec is not None else None
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=self.runner.num_kv_blocks,
            num_free_kv_blocks=blocks.num_free_blocks,
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated,
            num_preemptions=self.scheduler.stats().num_preemptions,
            spec_mode=controller.mode if controller is not None else "off",
            spec_active=controller.enabled if controller is not None else False,
            num_drafted=fig.num_drafted,
            num_accepted=fig.num_accepted,
            num_verify_passes=fig.num_verify_passes,
            acceptance_length=fig.acceptance_length,
            accepted_at_depth=tuple(fig.accepted_at_depth),
            spec_transitions=controller.num_transitions if controller is not None else 0,
            draft_s=fig.draft_s,
            verify_s=fig.verify_s,
            catch_up_s=fig.catch_up_s,
            spec_measured_tok_s={} if controller is None else controller.measured_table(),
        )


def _build_speculative(config: EngineConfig, model_config: ModelConfig
                       ) -> SpeculativeWorker | None:
    """The speculative worker (with its runner), or None without a draft model. Every
    step raises out of here: an unreadable head, one that does not fit the target, a bad
    controller configuration."""
    path = config.draft_model_path
    if config.speculative_algorithm is None or path is None:
        return None
    draft_config = read_draft_config(path)
    aux_layers = resolve_aux_layer_ids(draft_config, model_config.num_layers)
    # The head's K/V cache has the target's blocks: its bytes come from the same budget.
    runner = ModelRunner(config, model_config, capture_layers=aux_layers,
                         verify_shape=(verify_query_len(config), config.spec_topk > 1),
                         extra_kv_elements_per_token=(2 * draft_config.num_key_value_heads
                                                      * draft_config.head_dim))
    # The head shares the target's token embedding unless its checkpoint has its own.
    head = load_draft_head(path, runner.model.model.embed_tokens.weight, dtype=runner.dtype,
                           device=runner.device)
    controller = SpecController(config.spec_mode, config.spec_disable_batch_threshold,
                                measure=config.spec_auto_measure)
    return SpeculativeWorker(config, runner, head, controller)


def _log_switch(event: SpecEvent | None) -> None:
    """One record per speculation switch (with its cause and figures)."""
    if event is not None:
        log.info("speculation %s", "on" if event.enabled else "off", extra=event.as_dict())


def _graphs_status(runner: ModelRunner, spec: SpeculativeWorker | None) -> str:
    """The target's backend (captured graphs, compiled CPU steps) and the draft loop's, for
    status ("off" when nothing is captured or compiled)."""
    parts = [runner.backend.status()]
    if spec is not None and spec.drafter.loop_runner.status():
        parts.append(spec.drafter.loop_runner.status())
    return " | ".join(parts)


def _max_model_len(config: EngineConfig, model_config: ModelConfig, num_kv_blocks: int) -> int:
    """The longest sequence served: the configured value, else the model's limit capped by
    what the KV cache can hold (a sequence that cannot fit the cache could never finish)."""
    limit = model_config.max_model_len
    capacity = num_kv_blocks * config.block_size
    if config.max_model_len is None:
        if capacity < limit:
            log.info("max_model_len capped by the KV cache", extra={
                "event": "max_model_len_capped", "max_position_embeddings": limit,
                "kv_capacity_tokens": capacity})
        return min(limit, capacity)
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's "
            f"limit {limit}")
    if config.max_model_len > capacity:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the KV cache's capacity of "
            f"{capacity} tokens ({num_kv_blocks} blocks of {config.block_size}); raise "
            "kv_cache_memory_bytes or lower max_model_len")
    return config.max_model_len
