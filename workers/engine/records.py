"""What the engine reports: a per-request delta of each step, and a snapshot of its figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from specd.workers.engine.batch import TokenLogprobs


@dataclass(frozen=True)
class RequestDelta:
    """What one step produced for one request. Figures are cumulative for the request.
    `error`: set, with finish reason "error", when a failed step was blamed on it."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs]
    num_drafted: int = 0
    num_accepted: int = 0
    error: str | None = None
    # With the request's first output: its prompt's log-probabilities, tokens 1, 2, ...
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


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
    num_step_failures: int = 0  # failed steps blamed on requests (workers/engine/isolation.py)
    num_requests_failed: int = 0  # requests those failures ended with an error
    # Documented fallbacks in force (backend.py): name -> reason; empty when all runs as
    # configured. Each was logged once, with its traceback, when it happened.
    fallbacks: dict[str, str] = field(default_factory=dict)
    # The model's vocabulary: prompt and logit_bias token ids must be below it.
    vocab_size: int = 0
    # Problems the engine sees while it serves (status shows them, doctor fails on them):
    # name -> what, e.g. "spec_acceptance_low" (workers/spec/acceptance_watch.py).
    problems: dict[str, str] = field(default_factory=dict)
    # Auto mode's live marks (the `spec` request changes them): speculation stops above
    # spec_threshold running requests and resumes at spec_resume_at or fewer; None
    # without a draft model.
    spec_threshold: int | None = None
    spec_resume_at: int | None = None
