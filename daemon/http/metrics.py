"""`/metrics`: the figures `specctl stats` shows, in Prometheus' text format.

Everything lives in the front's own `CollectorRegistry` (not prometheus_client's global
one). Two kinds of figures:

* Latencies the front measures as output arrives, for every request (socket and HTTP):
  time to first token (from admission, tokenizing included) and inter-token latency (the
  time between a request's outputs, divided among the tokens the later one brought, so
  that a speculative step's tokens count one each). `RequestLatency` is fed by the request
  flow.
* A snapshot of the stats reply (`StatsReply.stats`: the front's counters, the engine's
  `EngineStats`), taken for each scrape and written by `ENGINE_METRICS`' table, which names
  every EngineStats field (a test checks it), and the front's state.

Names follow Prometheus' conventions: `specd_` prefix, base units (seconds), counters
ending in `_total`, a mode or state as a label whose series is 1 for the current value.

Beside them, under vLLM's names and with its `model_name` label, the figures routers and
load balancers read from an inference server (`VLLM_METRICS`): the Gateway API Inference
Extension's endpoint picker reads `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` (a fraction, 0-1; also under its older name
`vllm:gpu_cache_usage_perc`) and `vllm:lora_requests_info` (no adapters here) by default.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specd.ipc.messages import SPEC_MODES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATES = ("starting", "ready", "draining", "failed")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5, 5.0)

# EngineStats field -> (metric name, counter or gauge, help). Fields written otherwise are
# in ENGINE_SPECIAL; test_http_metrics checks the two cover every field.
ENGINE_METRICS = {
    "num_running": ("specd_requests_running", "gauge", "Requests the scheduler is running."),
    "num_waiting": ("specd_requests_waiting", "gauge",
                    "Requests waiting in the scheduler for a batch slot or KV blocks."),
    "num_kv_blocks": ("specd_kv_blocks", "gauge", "KV cache blocks in all."),
    "num_steps": ("specd_engine_steps", "counter", "Engine steps run."),
    "num_generated_tokens": ("specd_engine_generated_tokens", "counter",
                             "Tokens the engine generated (aborted requests included)."),
    "num_preemptions": ("specd_preemptions", "counter",
                        "Requests preempted for KV blocks (recomputed later)."),
    "spec_active": ("specd_speculation_active", "gauge",
                    "1 while the engine speculates, 0 while it decodes plainly."),
    "num_drafted": ("specd_spec_draft_tokens", "counter", "Draft tokens proposed."),
    "num_accepted": ("specd_spec_accepted_tokens", "counter", "Draft tokens accepted."),
    "num_verify_passes": ("specd_spec_verify_steps", "counter",
                          "Sequence verifications (one per speculating sequence and step)."),
    "acceptance_length": ("specd_spec_acceptance_length", "gauge",
                          "Mean tokens per verification (1 + accepted drafts)."),
    "spec_transitions": ("specd_spec_mode_switches", "counter",
                         "Times speculation was turned off or on."),
    "draft_s": ("specd_spec_draft_seconds", "counter", "Time spent drafting."),
    "verify_s": ("specd_spec_verify_seconds", "counter", "Time spent verifying drafts."),
    "catch_up_s": ("specd_spec_catch_up_seconds", "counter",
                   "Time the draft head spent catching up on the target's tokens."),
    "num_step_failures": ("specd_step_failures", "counter",
                          "Failed engine steps blamed on a request (the others went on)."),
    "num_requests_failed": ("specd_step_failed_requests", "counter",
                            "Requests ended by the failed steps blamed on them."),
}
# vocab_size is the model's, fixed at start-up: a property (status), not a figure to scrape;
# problems are texts for status and doctor.
ENGINE_SPECIAL = frozenset({"num_free_kv_blocks", "spec_mode", "accepted_at_depth",
                            "spec_measured_tok_s", "spec_threshold", "spec_resume_at",
                            "vocab_size", "fallbacks", "problems"})


class _Request(Protocol):
    """What `RequestLatency` reads of an open request (request_table.OpenRequest)."""

    request_id: str
    started: float  # time.monotonic() at admission


class RequestLatency:
    """Time-to-first-token and inter-token-latency histograms, fed by the request flow:
    `on_output` for each output with new tokens, `on_end` once the request left."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.time_to_first_token = Histogram(
            "specd_time_to_first_token_seconds", "From admission to the first output token.",
            buckets=TTFT_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram(
            "specd_inter_token_latency_seconds", "Time between a request's output tokens.",
            buckets=ITL_BUCKETS, registry=registry)
        self._last_output: dict[str, float] = {}  # request id -> time of its last output

    def on_output(self, request: _Request, num_tokens: int) -> None:
        now = time.monotonic()
        last = self._last_output.get(request.request_id)
        self._last_output[request.request_id] = now
        if last is None:
            self.time_to_first_token.observe(now - request.started)
            return
        gap = (now - last) / num_tokens
        for _ in range(num_tokens):
            self.inter_token_latency.observe(gap)

    def on_end(self, request: _Request) -> None:
        self._last_output.pop(request.request_id, None)


class Metrics:
    """The front's registry: request latencies, the process, and a stats snapshot."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = RequestLatency(self.registry)
        ProcessCollector(namespace="", registry=self.registry)
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)

    def render(self, stats: dict[str, Any], state: str, model: str = "",
               resolved: dict[str, Any] | None = None) -> bytes:
        """The text exposition for a stats reply's `stats` and the front's state; `model`
        (the served model's name) and `resolved` (Ready's) label vLLM's names."""
        self._snapshot.stats = stats
        self._snapshot.state = state
        self._snapshot.model = model
        self._snapshot.resolved = resolved or {}
        return generate_latest(self.registry)


class _Snapshot:
    """A collector writing the last stats reply (set just before each `collect`)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}
        self.state = "starting"
        self.model = ""
        self.resolved: dict[str, Any] = {}

    def describe(self) -> list[Metric]:
        return []  # registered before any figure exists: no names to reserve

    def collect(self) -> Iterator[Metric]:
        yield _state_set("specd_state", "The front's state.", "state", STATES, self.state)
        yield from front_families(self.stats)
        engine = self.stats.get("engine") or {}
        has_engine = bool(engine) and "error" not in engine
        yield GaugeMetricFamily("specd_engine_up", "1 when the scheduler answered the stats "
                                "query of this scrape.", value=int(has_engine))
        if has_engine:
            yield from engine_families(engine)
            yield from vllm_families(self.stats, self.model, self.resolved)


def front_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """The front's counters (`specctl stats`' front section) and open requests."""
    front = stats.get("front") or {}
    outcomes = CounterMetricFamily("specd_requests", "Generate requests finished, by finish "
                                   "reason.", labels=["outcome"])
    errors = CounterMetricFamily("specd_errors", "Error answers (requests and connections), "
                                 "by error code.", labels=["code"])
    for key, value in sorted(front.items()):
        if key.startswith("finished_"):
            outcomes.add_metric([key.removeprefix("finished_")], value)
        elif key.startswith("error_"):
            errors.add_metric([key.removeprefix("error_")], value)
    yield outcomes
    yield errors
    yield CounterMetricFamily("specd_prompt_tokens", "Prompt tokens of finished requests.",
                              value=front.get("prompt_tokens", 0))
    yield CounterMetricFamily("specd_generation_tokens", "Output tokens of finished requests.",
                              value=front.get("output_tokens", 0))
    yield CounterMetricFamily("specd_scheduler_restarts", "Times this service exited because "
                              "its scheduler failed (restarted by systemd).",
                              value=front.get("scheduler_restarts", 0))
    yield GaugeMetricFamily("specd_open_requests", "Generate requests open in the front "
                            "(tokenizing or in the scheduler).",
                            value=stats.get("open_requests", 0))
    yield GaugeMetricFamily("specd_socket_connections", "Client connections on the Unix "
                            "socket.", value=stats.get("connections", 0))


def engine_families(engine: dict[str, Any]) -> Iterator[Metric]:
    """The engine's figures (`specctl stats`' engine section)."""
    for key, (name, kind, doc) in ENGINE_METRICS.items():
        family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        yield family(name, doc, value=float(engine.get(key, 0)))
    yield GaugeMetricFamily("specd_kv_blocks_used", "KV cache blocks in use.",
                            value=engine.get("num_kv_blocks", 0)
                            - engine.get("num_free_kv_blocks", 0))
    yield _state_set("specd_speculation_mode", "The speculation mode (auto chooses per load).",
                     "mode", SPEC_MODES, engine.get("spec_mode", ""))
    if engine.get("spec_threshold") is not None:  # nil without a draft model
        yield GaugeMetricFamily("specd_spec_threshold", "auto: speculation stops above this "
                                "many running requests (the live value).",
                                value=engine["spec_threshold"])
        yield GaugeMetricFamily("specd_spec_resume_at", "auto: speculation resumes at this "
                                "many running requests or fewer.",
                                value=engine.get("spec_resume_at", 0))
    fallbacks = GaugeMetricFamily("specd_fallback", "A documented fallback in force (1 while "
                                  "that part runs degraded, e.g. eagerly; absent when none).",
                                  labels=["name"])
    for fallback in sorted(engine.get("fallbacks") or {}):
        fallbacks.add_metric([fallback], 1)
    yield fallbacks
    depth = CounterMetricFamily("specd_spec_accepted_at_depth", "Verifications that accepted "
                                "the draft token at this depth (1 = the first).",
                                labels=["depth"])
    for index, value in enumerate(engine.get("accepted_at_depth", ())):
        depth.add_metric([str(index + 1)], value)
    yield depth
    measured = GaugeMetricFamily("specd_spec_measured_tokens_per_second", "auto's measured "
                                 "throughput per batch-size bucket and mode (0: not yet).",
                                 labels=["batch", "mode"])
    for bucket, (on, off) in sorted(engine.get("spec_measured_tok_s", {}).items()):
        measured.add_metric([bucket, "on"], on)
        measured.add_metric([bucket, "off"], off)
    yield measured


def vllm_families(stats: dict[str, Any], model: str, resolved: dict[str, Any]
                  ) -> Iterator[Metric]:
    """vLLM's names for the figures routers read (module docstring), labelled with the
    model's name."""
    engine, front = stats.get("engine") or {}, stats.get("front") or {}
    total = engine.get("num_kv_blocks", 0)
    used = total - engine.get("num_free_kv_blocks", 0)
    usage = used / total if total else 0.0
    labels = ["model_name"]
    for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the model's batch.",
             engine.get("num_running", 0)),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
             engine.get("num_waiting", 0)),
            ("vllm:kv_cache_usage_perc", "KV cache usage, a fraction (1 = full).", usage),
            ("vllm:gpu_cache_usage_perc", "KV cache usage, a fraction (vLLM's older name).",
             usage)):
        family = GaugeMetricFamily(name, doc, labels=labels)
        family.add_metric([model], value)
        yield family
    for name, key in (("vllm:prompt_tokens", "prompt_tokens"),
                      ("vllm:generation_tokens", "output_tokens")):
        counter = CounterMetricFamily(name, f"{key.replace('_', ' ').capitalize()} of "
                                      "finished requests.", labels=labels)
        counter.add_metric([model], front.get(key, 0))
        yield counter
    lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters running and waiting "
                             "(none: specd serves no adapters); the value is the time.",
                             labels=["max_lora", "running_lora_adapters",
                                     "waiting_lora_adapters"])
    lora.add_metric(["0", "", ""], time.time())
    yield lora
    if "block_size" in resolved:
        config = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration.",
                                   labels=["block_size", "num_gpu_blocks"])
        config.add_metric([str(resolved["block_size"]), str(total)], 1)
        yield config


def _state_set(name: str, doc: str, label: str, values: tuple[str, ...],
               current: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value in values:
        family.add_metric([value], int(value == current))
    return family
