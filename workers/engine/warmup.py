"""Warm-up: before the scheduler sends Ready, every decode path the configuration enables
runs once through `EngineCore.step`, so that a path whose code is broken (the incident: an
attribute read only on the logprobs path, or when the load crosses the speculation
threshold) fails start-up with its own exception and traceback, not the first request that
takes it; first-call costs (allocations, compilation) are paid here too.

Steps run without failure isolation (`step(isolate=False)`): a warm-up step that raises
leaves as raised. Each request's output is checked (finished, token count, log-probability
count) and a round that does not finish within `MAX_STEPS` steps fails (`WarmUpFailed`).

Rounds, each a few short requests (a prompt of 3 tokens, or of one KV block plus one), so
that warm-up stays cheap (it runs at every start; docs/operations.md has its cost):

1. **options** (with a draft model: speculation forced on, so every option runs through a
   prefill's plain sample and through verification; chain or tree as configured): greedy
   with log-probabilities; seeded sampling with top-k, top-p, min-p and log-probabilities;
   unseeded sampling; repetition, frequency and presence penalties with a logit bias;
   `max_tokens` 1; a request that opts out of speculation (plain rows beside verifies);
   one aborted after the first step. Once the greedy request has its first token, the
   same prompt arrives again, stopped by that token: a prefix-cache hit (the prompt's first
   block was cached by the first prefill), a prefill beside running verifies, a stop id.
2. **switch** (draft model only): auto mode; one request speculates, then `threshold`
   more arrive, so the batch crosses the threshold (speculation turns off with drafts
   waiting; plain steps that keep the head's hidden states run), and when they finish it
   falls to the resume mark and speculation turns back on for the request still running,
   which verifies once and is aborted. Both switches are checked. Where the configured
   threshold cannot be crossed (`max_num_seqs`, the KV cache or the token budget hold
   fewer requests) a lower one is used for the round; mode and marks are restored after.
3. **chunked** prefill: a prompt one token longer than `max_num_batched_tokens`, when it
   fits the model and is cheap (on CUDA, or a budget of at most CPU_CHUNKED_MAX_TOKENS).
4. **compiled** (`--cpu-compile`): decode and verify at batch 1 and 2 in each mode, so
   that every compiled step kind compiles now (with `--cpu-compile-background` these steps
   run eagerly and hand each kind to the compile thread: runner/cpu_compile_thread.py).
5. **structured** (when the model has a tokenizer: structured output is on; with a draft
   model speculation forced on, so the masks of plain samples and of verified chains or
   trees are built and applied): a JSON schema greedily with log-probabilities, the same
   schema sampled with a seed, and a tool call (Hermes' format, which every tokenizer can
   write). Each output is checked against its grammar as well.

With overlap scheduling enabled every round runs overlapped (the penalties request makes
its steps whole while it runs, as in serving). Mode switches made by warm-up itself are
not logged (they are not the operator's); switches the engine decides in round 2 are, as
always. Afterwards the controller's figures and counts are forgotten and the engine's
figures reset (`EngineCore.warmup`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specd.ipc.sampling import SamplingParams
from specd.ipc.structured import JsonSchema, StructuredOutput, ToolCall, ToolSpec
from specd.workers.config import EngineConfig
from specd.workers.engine.records import RequestDelta
from specd.workers.models.config import ModelConfig

if TYPE_CHECKING:
    from specd.workers.engine.plain_worker import StepWorker
    from specd.workers.runner.model_runner import ModelRunner
    from specd.workers.spec.worker import SpeculativeWorker
    from specd.workers.structured.outputs import StructuredOutput as Structured

log = logging.getLogger("specd.engine")


class WarmedEngine(Protocol):
    """What warm-up drives: the engine (`EngineCore`, engine/core.py) through its public
    requests and steps, and the parts whose state it reads or resets (runner, worker, speculative
    worker)."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    runner: ModelRunner
    worker: StepWorker[Any]
    structured: Structured

    @property
    def spec(self) -> SpeculativeWorker | None: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams) -> None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self, isolate: bool = True) -> list[RequestDelta]: ...


MAX_STEPS = 1000  # steps one round may take; far more than any round needs
# On the CPU a chunked prefill is warmed only for a budget this small: a prefill of the
# default 2048 tokens costs seconds there at every start (measured: docs/operations.md).
CPU_CHUNKED_MAX_TOKENS = 256
SHORT_PROMPT_LEN = 3


class WarmUpFailed(AssertionError):
    """A warm-up request did not end as its path must (an AssertionError: an invariant of
    the code failed, so the start exits 70, like any bug found while warming up)."""


@dataclass(frozen=True)
class WarmRequest:
    """One warm-up request; its engine id is `__warmup_<name>`."""

    name: str
    prompt: list[int]
    sampling: SamplingParams


@dataclass
class _Output:
    """What a warm-up request produced so far (from its deltas)."""

    token_ids: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)  # top alternatives per token
    finish_reason: str | None = None


@dataclass(frozen=True)
class _Plan:
    """Token ids for the rounds' prompts (inside the vocabulary), and their lengths."""

    vocab_size: int
    block_size: int
    max_model_len: int

    def prompt(self, length: int, start: int) -> list[int]:
        return [1 + (start + 7 * i) % (self.vocab_size - 1) for i in range(length)]

    def num_blocks(self, num_positions: int) -> int:
        """KV blocks that hold `num_positions` positions."""
        return -(-num_positions // self.block_size)

    @property
    def long_len(self) -> int:
        """One full KV block and one token (cached for prefix reuse once prefilled), if the
        model is long enough for it and a few output tokens; else a short prompt."""
        n = self.block_size + 1
        return n if n + 8 < self.max_model_len else SHORT_PROMPT_LEN


def warm_up(core: WarmedEngine) -> None:
    """Run the rounds the configuration enables (module docstring); raises what a path
    raised, or WarmUpFailed."""
    t0 = time.perf_counter()
    plan = _Plan(core.model_config.vocab_size, core.config.block_size, core.max_model_len)
    spec = core.spec
    ran: list[str] = []
    if spec is not None:
        saved = (spec.controller.mode, spec.controller.threshold, spec.controller.resume_at)
        spec.controller.set_mode("on")  # warm-up's own switches are not logged
    _options_round(core, plan, ran)
    if spec is not None:
        _switch_round(core, spec, plan, ran)
        spec.controller.set_mode(*saved)
    if _chunked_prefill_is_cheap(core):
        budget = core.config.max_num_batched_tokens
        _run(core, [WarmRequest("chunked", plan.prompt(budget + 1, 5), SamplingParams(
            max_tokens=2, ignore_eos=True))], ran, "chunked")
    if core.runner.backend.compiles:
        _warm_compiled(core, plan, ran)
    if core.structured.enabled:
        _structured_round(core, plan, ran)
    core.worker.controller.forget_measurements()
    log.info("warm-up ran %s in %.2f s", ", ".join(ran), time.perf_counter() - t0,
             extra={"event": "warmup", "rounds": ran,
                    "seconds": round(time.perf_counter() - t0, 3)})


def _options_round(core: WarmedEngine, plan: _Plan, ran: list[str]) -> None:
    """Round 1 (module docstring)."""
    short = plan.prompt(SHORT_PROMPT_LEN, 1)
    # ignore_eos: each runs its full length, so the checks below know what to expect.
    requests = [
        WarmRequest("greedy", plan.prompt(plan.long_len, 0),
                    SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True)),
        WarmRequest("seeded", short, SamplingParams(
            max_tokens=3, temperature=0.8, seed=1, top_k=8, top_p=0.9, min_p=0.05,
            logprobs=1, ignore_eos=True)),
        WarmRequest("unseeded", short, SamplingParams(max_tokens=2, temperature=1.0,
                                                      ignore_eos=True)),
        # Few tokens, the whole steps it imposes end early: the others then run overlapped.
        # Three: with overlap its first drafts are dropped (made on the device before the
        # host knew its tokens); the step after drafts on the host, the next verifies.
        WarmRequest("penalties", short, SamplingParams(
            max_tokens=3, repetition_penalty=1.1, frequency_penalty=0.1,
            presence_penalty=0.1, logit_bias={short[0]: 1.0}, ignore_eos=True)),
        WarmRequest("one_token", short, SamplingParams(max_tokens=1)),
        WarmRequest("not_speculative", short, SamplingParams(max_tokens=3, speculative=False,
                                                             ignore_eos=True)),
        WarmRequest("aborted", short, SamplingParams(max_tokens=8, ignore_eos=True)),
    ]
    outputs = {r.name: _Output() for r in requests}
    for r in requests:
        core.add_request(_request_id(r.name), r.prompt, r.sampling)
    steps = 0
    while not outputs["greedy"].token_ids:  # one step, or two with overlap scheduling
        steps = _step(core, outputs, steps)
    if not core.abort_request(_request_id("aborted")):
        raise WarmUpFailed("warm-up: the request to abort had already finished")
    del outputs["aborted"]
    again = WarmRequest("again", requests[0].prompt, SamplingParams(
        max_tokens=3, stop_token_ids=(outputs["greedy"].token_ids[0],)))
    requests.append(again)
    outputs[again.name] = _Output()
    core.add_request(_request_id(again.name), again.prompt, again.sampling)
    while core.has_unfinished():
        steps = _step(core, outputs, steps)
    _check(outputs, {r.name: r.sampling for r in requests})
    ran.append("options")


def _switch_round(core: WarmedEngine, spec: SpeculativeWorker, plan: _Plan,
                  ran: list[str]) -> None:
    """Round 2 (module docstring); skipped, with a record saying why, where not even a
    threshold of 1 can be crossed (a single sequence at a time) or `max_model_len` is
    shorter than the request that lives across both switches."""
    controller = spec.controller
    num_rows = spec.num_draft_tokens  # a verify's rows per sequence
    # Outlives the verifies before the switch off (two, overlapped) and the plain step.
    long_tokens = 3 * num_rows + 4
    blocks_long = plan.num_blocks(SHORT_PROMPT_LEN + long_tokens + num_rows)
    blocks_short = plan.num_blocks(SHORT_PROMPT_LEN + 2 + num_rows)
    config = core.config
    threshold = min(controller.threshold, config.max_num_seqs - 1,
                    (core.runner.num_kv_blocks - blocks_long) // blocks_short,
                    (config.max_num_batched_tokens - num_rows) // SHORT_PROMPT_LEN)
    if threshold < 1 or SHORT_PROMPT_LEN + long_tokens + num_rows >= core.max_model_len:
        log.info("warm-up: the speculation switch is not warmed: this configuration never "
                 "runs two sequences at once, or no sequence of %d tokens",
                 SHORT_PROMPT_LEN + long_tokens + num_rows,
                 extra={"event": "warmup_skipped", "round": "switch"})
        return
    controller.set_mode("auto", threshold)
    core.add_request(_request_id("switch_long"), plan.prompt(SHORT_PROMPT_LEN, 3),
                     SamplingParams(max_tokens=long_tokens, ignore_eos=True))
    outputs: dict[str, _Output] = {"switch_long": _Output()}
    steps = 0
    while not outputs["switch_long"].token_ids:  # speculating, drafts made
        steps = _step(core, outputs, steps)
    short = SamplingParams(max_tokens=2, ignore_eos=True)
    for i in range(threshold):
        name = f"switch_{i}"
        outputs[name] = _Output()
        core.add_request(_request_id(name), plan.prompt(SHORT_PROMPT_LEN, 4 + i), short)
    was_off = False
    while not (was_off and controller.enabled):
        if outputs["switch_long"].finish_reason is not None or not core.has_unfinished():
            raise WarmUpFailed(f"warm-up: {threshold + 1} requests at threshold {threshold} "
                               "did not turn speculation off and on again while one ran")
        steps = _step(core, outputs, steps)
        was_off = was_off or not controller.enabled
    # Back on: the long request was drafted for at once; it verifies once, then ends.
    steps = _step(core, outputs, steps)
    core.abort_request(_request_id("switch_long"))
    while core.has_unfinished():
        steps = _step(core, outputs, steps)
    del outputs["switch_long"]
    _check(outputs, {name: short for name in outputs})
    ran.append(f"switch (threshold {threshold})")


def _warm_compiled(core: WarmedEngine, plan: _Plan, ran: list[str]) -> None:
    """Compile every step kind now, not at the first request that needs it: decode and
    (with a head) verify, each at batch size 1 and >= 2 (cpu_decode.py), in each mode."""
    controller = core.worker.controller
    saved = controller.mode
    for mode in [m for m in ("off", "on") if m in controller.modes]:
        controller.set_mode(mode)
        for batch in (2, 1):
            # Long enough for whole draft trees (shorter ones run eagerly).
            _run(core, [WarmRequest(f"{mode}_{batch}_{i}", plan.prompt(SHORT_PROMPT_LEN, i),
                                    SamplingParams(max_tokens=24, ignore_eos=True))
                        for i in range(batch)], ran, f"compiled {mode} {batch}")
    controller.set_mode(saved)


# Bounded everywhere, so that any model ends it within a few tokens once the mask allows EOS.
WARM_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                      "maximum": 9}},
               "required": ["n"], "additionalProperties": False}


def _structured_round(core: WarmedEngine, plan: _Plan, ran: list[str]) -> None:
    """Round 5 (module docstring)."""
    schema = JsonSchema(WARM_SCHEMA)
    tool = ToolCall("hermes", [ToolSpec("f", WARM_SCHEMA)], function="f")
    requests = [
        WarmRequest("json_greedy", plan.prompt(SHORT_PROMPT_LEN, 11),
                    SamplingParams(max_tokens=12, logprobs=1, structured=schema)),
        WarmRequest("json_sampled", plan.prompt(SHORT_PROMPT_LEN, 12), SamplingParams(
            max_tokens=12, temperature=0.8, seed=2, top_k=8, structured=schema)),
        WarmRequest("tool_call", plan.prompt(SHORT_PROMPT_LEN, 13),
                    SamplingParams(max_tokens=12, structured=tool)),
    ]
    controller = core.worker.controller
    saved = controller.mode
    if "on" in controller.modes:
        controller.set_mode("on")
    outputs = {r.name: _Output() for r in requests}
    for r in requests:
        core.add_request(_request_id(r.name), r.prompt, r.sampling)
    steps = 0
    while core.has_unfinished():
        steps = _step(core, outputs, steps)
    controller.set_mode(saved)
    _check(outputs, {r.name: r.sampling for r in requests})
    for r in requests:
        _check_grammar(core, r.name, r.sampling.structured, outputs[r.name].token_ids)
    ran.append("structured")


def _check_grammar(core: WarmedEngine, name: str, constraint: StructuredOutput | None,
                   token_ids: list[int]) -> None:
    """The output is a prefix of a sentence of its grammar (a fresh matcher takes it all)."""
    if constraint is None:
        raise WarmUpFailed(f"warm-up request {name}: no constraint to check")
    error = core.structured.check(constraint, token_ids)
    if error is not None:
        raise WarmUpFailed(f"warm-up request {name}: its output {token_ids} breaks its "
                           f"grammar: {error}")


def _run(core: WarmedEngine, requests: list[WarmRequest], ran: list[str], name: str) -> None:
    """Submit `requests`, step until all finished, check each."""
    outputs = {r.name: _Output() for r in requests}
    for r in requests:
        core.add_request(_request_id(r.name), r.prompt, r.sampling)
    steps = 0
    while core.has_unfinished():
        steps = _step(core, outputs, steps)
    _check(outputs, {r.name: r.sampling for r in requests})
    ran.append(name)


def _step(core: WarmedEngine, outputs: dict[str, _Output], steps: int) -> int:
    """One strict step, its deltas recorded; the new step count (WarmUpFailed past
    MAX_STEPS: a round that does not finish is a bug)."""
    if steps >= MAX_STEPS:
        raise WarmUpFailed(f"warm-up: requests {sorted(outputs)} unfinished after "
                           f"{MAX_STEPS} steps")
    for delta in core.step(isolate=False):
        _record(outputs, delta)
    return steps + 1


def _record(outputs: dict[str, _Output], delta: RequestDelta) -> None:
    out = outputs.get(delta.request_id.removeprefix("__warmup_"))
    if out is None:
        return  # the aborted request's output of a step launched before the abort
    out.token_ids += delta.new_token_ids
    out.num_logprobs += [len(lp.top_ids) for lp in delta.logprobs]
    out.finish_reason = delta.finish_reason


def _check(outputs: dict[str, _Output], sampling: dict[str, SamplingParams]) -> None:
    """Each request finished (length or stop) with 1..max_tokens tokens and, where it asked
    for log-probabilities, that many alternatives for every token."""
    for name, out in outputs.items():
        n, params = len(out.token_ids), sampling[name]
        if out.finish_reason not in ("length", "stop") or not 1 <= n <= params.max_tokens:
            raise WarmUpFailed(f"warm-up request {name}: finish reason {out.finish_reason!r} "
                               f"after {n} tokens (at most {params.max_tokens})")
        if params.logprobs and out.num_logprobs != [params.logprobs] * n:
            raise WarmUpFailed(f"warm-up request {name}: {params.logprobs} log-probabilities "
                               f"asked per token, got {out.num_logprobs} for {n} tokens")


def _chunked_prefill_is_cheap(core: WarmedEngine) -> bool:
    """Whether round 3 runs: a prompt longer than the budget fits the model and the KV
    cache, and prefilling it costs little (on CUDA, or a small budget)."""
    budget, config = core.config.max_num_batched_tokens, core.config
    fits = (budget + 3 < core.max_model_len
            and (budget + 3) // config.block_size + 1 <= core.runner.num_kv_blocks)
    return fits and (config.device.startswith("cuda") or budget <= CPU_CHUNKED_MAX_TOKENS)


def _request_id(name: str) -> str:
    return f"__warmup_{name}"
