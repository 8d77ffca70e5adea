"""/metrics (daemon/http/metrics.py): every figure of `specctl stats` is written, the text
parses with prometheus_client's own parser, latencies are observed per token."""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from specd.daemon.http.metrics import ENGINE_METRICS, ENGINE_SPECIAL, Metrics
from specd.workers.engine.records import EngineStats

ENGINE = {
    "num_running": 2, "num_waiting": 1, "num_kv_blocks": 100, "num_free_kv_blocks": 60,
    "num_steps": 50, "num_generated_tokens": 120, "num_preemptions": 0, "spec_mode": "auto",
    "spec_active": True, "num_drafted": 40, "num_accepted": 30, "num_verify_passes": 20,
    "acceptance_length": 2.5, "accepted_at_depth": [15, 10, 5], "spec_transitions": 3,
    "draft_s": 1.5, "verify_s": 2.5, "catch_up_s": 0.5,
    "spec_measured_tok_s": {"1": [100.0, 80.0], "2-3": [150.0, 0.0]},
    "num_step_failures": 1, "num_requests_failed": 1,
    "vocab_size": 4096, "spec_threshold": 8, "spec_resume_at": 6, "fallbacks": {},
    "problems": {},
}
STATS = {"engine": ENGINE, "open_requests": 3, "connections": 2,
         "front": {"finished_length": 4, "finished_stop": 1, "error_overloaded": 2,
                   "output_tokens": 70, "prompt_tokens": 30, "scheduler_restarts": 1}}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition, via prometheus' parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_every_engine_stats_field_is_exported() -> None:
    fields = {f.name for f in dataclasses.fields(EngineStats)}
    assert set(ENGINE_METRICS) | ENGINE_SPECIAL == fields
    assert not set(ENGINE_METRICS) & ENGINE_SPECIAL
    assert set(ENGINE) == fields  # the sample above is a whole EngineStats


def test_the_stats_reply_as_prometheus_text() -> None:
    text = Metrics().render(STATS, "ready").decode()
    got = samples(text)
    expected: dict[tuple[str, tuple[Any, ...]], float] = {
        ("specd_requests_total", (("outcome", "length"),)): 4,
        ("specd_requests_total", (("outcome", "stop"),)): 1,
        ("specd_errors_total", (("code", "overloaded"),)): 2,
        ("specd_prompt_tokens_total", ()): 30,
        ("specd_generation_tokens_total", ()): 70,
        ("specd_scheduler_restarts_total", ()): 1,
        ("specd_open_requests", ()): 3,
        ("specd_socket_connections", ()): 2,
        ("specd_state", (("state", "ready"),)): 1,
        ("specd_state", (("state", "draining"),)): 0,
        ("specd_engine_up", ()): 1,
        ("specd_requests_running", ()): 2,
        ("specd_requests_waiting", ()): 1,
        ("specd_kv_blocks", ()): 100,
        ("specd_kv_blocks_used", ()): 40,
        ("specd_speculation_mode", (("mode", "auto"),)): 1,
        ("specd_speculation_mode", (("mode", "on"),)): 0,
        ("specd_speculation_active", ()): 1,
        ("specd_spec_draft_tokens_total", ()): 40,
        ("specd_spec_accepted_tokens_total", ()): 30,
        ("specd_spec_acceptance_length", ()): 2.5,
        ("specd_spec_mode_switches_total", ()): 3,
        ("specd_spec_accepted_at_depth_total", (("depth", "3"),)): 5,
        ("specd_spec_draft_seconds_total", ()): 1.5,
        ("specd_spec_measured_tokens_per_second", (("batch", "2-3"), ("mode", "on"))): 150,
        ("specd_step_failures_total", ()): 1,
        ("specd_spec_threshold", ()): 8,
        ("specd_spec_resume_at", ()): 6,
    }
    for key, value in expected.items():
        assert got.get(key) == value, (key, got.get(key))
    assert got[("specd_time_to_first_token_seconds_count", ())] == 0
    assert any(name == "process_start_time_seconds" for name, _ in got)
    for name, _ in got:  # Prometheus conventions; vLLM's names for routers beside them
        assert name.startswith(("specd_", "process_", "vllm:")), name
        assert "_ms" not in name and "_s_" not in name


def test_without_the_engines_figures() -> None:
    stats = {**STATS, "engine": {"error": "the scheduler did not answer"}}
    got = samples(Metrics().render(stats, "draining").decode())
    assert got[("specd_engine_up", ())] == 0
    assert got[("specd_state", (("state", "draining"),))] == 1
    assert not any(name == "specd_requests_running" for name, _ in got)
    got = samples(Metrics().render({}, "starting").decode())  # no stats at all
    assert got[("specd_engine_up", ())] == 0 and got[("specd_prompt_tokens_total", ())] == 0


class _Request:
    def __init__(self, request_id: str, started: float) -> None:
        self.request_id = request_id
        self.started = started


def test_latencies_count_one_observation_per_token() -> None:
    metrics = Metrics()
    request = _Request("r1", started=0.0)  # monotonic 0: the first token took "long"
    metrics.latency.on_output(request, 1)
    metrics.latency.on_output(request, 3)  # a speculative step's three tokens
    metrics.latency.on_output(request, 1)
    metrics.latency.on_end(request)
    metrics.latency.on_output(request, 1)  # a request id seen again starts over
    got = samples(metrics.render({}, "ready").decode())
    assert got[("specd_time_to_first_token_seconds_count", ())] == 2
    assert got[("specd_inter_token_latency_seconds_count", ())] == 4
    assert got[("specd_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2


def test_without_a_draft_model_no_threshold_is_written() -> None:
    engine = {**ENGINE, "spec_mode": "off", "spec_threshold": None, "spec_resume_at": None}
    got = samples(Metrics().render({**STATS, "engine": engine}, "ready").decode())
    assert got[("specd_speculation_mode", (("mode", "off"),))] == 1
    assert not any(name in ("specd_spec_threshold", "specd_spec_resume_at")
                   for name, _ in got)


def test_each_fallback_in_force_is_a_series_to_alert_on() -> None:
    engine = {**ENGINE, "fallbacks": {"cuda_graphs": "capture failed: RuntimeError"}}
    got = samples(Metrics().render({**STATS, "engine": engine}, "ready").decode())
    assert got[("specd_fallback", (("name", "cuda_graphs"),))] == 1
    got = samples(Metrics().render(STATS, "ready").decode())  # none in force: no series
    assert not any(name == "specd_fallback" for name, _ in got)


def test_vllm_names_for_routers_and_the_inference_gateway() -> None:
    text = Metrics().render(STATS, "ready", "fixture", {"block_size": 16}).decode()
    found = samples(text)
    model = (("model_name", "fixture"),)
    assert found[("vllm:num_requests_running", model)] == 2
    assert found[("vllm:num_requests_waiting", model)] == 1
    assert found[("vllm:kv_cache_usage_perc", model)] == 0.4  # 40 of 100 blocks held
    assert found[("vllm:gpu_cache_usage_perc", model)] == 0.4
    assert found[("vllm:prompt_tokens_total", model)] == 30
    assert found[("vllm:generation_tokens_total", model)] == 70
    assert found[("vllm:cache_config_info", (("block_size", "16"),
                                             ("num_gpu_blocks", "100")))] == 1
    lora = [k for k in found if k[0] == "vllm:lora_requests_info"]
    assert lora and dict(lora[0][1])["running_lora_adapters"] == ""
