"""The OpenAI-compatible HTTP API of a live daemon (`specd --http`), driven through the
official `openai` SDK: completions and chat, streamed and not, equal to the socket's greedy
output; errors as the SDK's typed exceptions; /metrics parsed by prometheus_client and
moving as requests run; a disconnect aborting its request; 503 while draining. One daemon
serves the module; the last test drains it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon, model_under_test

KEY = "sk-test-0123456789"
MAX_PENDING = 4
MAX_BODY = 65536
PROMPTS = ["def fib(n):\n", "import os\nimport sys\n"]
CHAT: list[Any] = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list"}]
NEW_TOKENS = 12
MODEL_DIR = Path(model_under_test() or FIXTURE_DIR)
MODEL = MODEL_DIR.name  # the name the daemon serves
TOKENIZER = Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("http")
    keys = tmp / "api-keys"
    keys.write_text(f"# test key\n{KEY}\n")
    # float32 and no measured auto, as in test_daemon: outputs comparable across requests.
    d = Daemon(tmp, "--dtype", "float32", "--no-spec-auto-measure", "--http", "127.0.0.1:0",
               "--api-key-file", str(keys), "--max-pending-requests", str(MAX_PENDING),
               "--max-frame-bytes", str(MAX_BODY)).wait_ready()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def base_url(daemon: Daemon) -> str:
    record = daemon.events("http_listening")[0]
    return f"http://{record['host']}:{record['port']}"


@pytest.fixture(scope="module")
def api(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def get(base_url: str, path: str, key: str | None = KEY) -> tuple[int, bytes]:
    request = urllib.request.Request(base_url + path)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = get(base_url, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples}


def test_models_health_and_keys(daemon: Daemon, base_url: str, api: openai.OpenAI) -> None:
    models = api.models.list().data
    assert [model.id for model in models] == [MODEL]
    assert get(base_url, "/health", key=None) == (200, b'{"status":"ready"}')
    status, body = get(base_url, "/metrics", key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_completions_equal_the_sockets_greedy_output(daemon: Daemon,
                                                     api: openai.OpenAI) -> None:
    for prompt in PROMPTS:
        with daemon.client() as client:
            expected = client.generate(prompt, max_tokens=NEW_TOKENS)
        stream = api.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert chunks[-2].choices[0].finish_reason == expected.finish_reason
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        assert usage.completion_tokens == expected.num_output_tokens
        assert usage.prompt_tokens == expected.num_prompt_tokens
        assert usage.model_extra is not None and "speculation" in usage.model_extra

        whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS,
                                       temperature=0)
        assert whole.choices[0].text == expected.text
        assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
        by_ids = api.completions.create(model=MODEL, prompt=TOKENIZER.encode(prompt),
                                        max_tokens=NEW_TOKENS, temperature=0)
        assert by_ids.choices[0].text == expected.text


def test_chat_streamed_and_not(daemon: Daemon, api: openai.OpenAI) -> None:
    with daemon.client() as client:
        expected = client.generate(messages=CHAT, max_tokens=NEW_TOKENS)
    stream = api.chat.completions.create(model=MODEL, messages=CHAT,
                                         max_completion_tokens=NEW_TOKENS, temperature=0,
                                         stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    whole = api.chat.completions.create(model=MODEL, messages=CHAT,
                                        max_tokens=NEW_TOKENS, temperature=0, logprobs=True,
                                        top_logprobs=2)
    choice = whole.choices[0]
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == expected.num_output_tokens
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert whole.usage is not None and whole.usage.completion_tokens == NEW_TOKENS


def test_errors_arrive_as_the_sdks_exceptions(api: openai.OpenAI) -> None:
    def create(**extra: Any) -> Any:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}
        return api.completions.create(**body)

    for kwargs, param in (({"n": 0}, "n"), ({"temperature": -1.0}, "temperature"),
                          ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
                          ({"extra_body": {"top_k": "many"}}, "top_k"),
                          ({"prompt": [1, 2**40]}, "prompt")):
        with pytest.raises(openai.BadRequestError) as raised:
            create(**kwargs)
        assert raised.value.status_code == 400
        assert isinstance(raised.value.body, dict) and raised.value.body["param"] == param
        assert param in raised.value.message
    with pytest.raises(openai.NotFoundError):
        create(model="gpt-4o")
    with pytest.raises(openai.APIStatusError) as too_large:
        create(prompt="x" * MAX_BODY)
    assert too_large.value.status_code == 413
    assert isinstance(too_large.value.body, dict)
    assert too_large.value.body["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as too_long:  # tokens beyond max_model_len
        create(prompt=[5] * 4096)
    assert too_long.value.code == "prompt_too_long"


def test_penalties_and_logit_bias_equal_the_sockets(daemon: Daemon, api: openai.OpenAI) -> None:
    prompt = PROMPTS[0]
    with daemon.client() as client:
        expected = client.generate(prompt, max_tokens=NEW_TOKENS, repetition_penalty=1.2,
                                   frequency_penalty=0.5, presence_penalty=0.25,
                                   logit_bias={65: 2.0, 85: -3.0})
        plain = client.generate(prompt, max_tokens=NEW_TOKENS)
    assert expected.token_ids != plain.token_ids  # the penalties change this output
    got = api.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS,
                                 temperature=0, frequency_penalty=0.5, presence_penalty=0.25,
                                 logit_bias={"65": 2, "85": -3},  # OpenAI's string keys
                                 extra_body={"repetition_penalty": 1.2})
    assert got.choices[0].text == expected.text
    # A token id the protocol allows but the model's vocabulary does not: the engine
    # refuses the request, and the client gets a 400.
    with pytest.raises(openai.BadRequestError) as raised:
        api.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                               logit_bias={str(2**31 - 1): 1})
    assert raised.value.code == "bad_request" and "logit_bias" in raised.value.message


@pytest.mark.slow  # 3 requests of 3 sampled choices: about a minute on two loaded cores
def test_n_sampled_choices_streamed_and_not(api: openai.OpenAI) -> None:
    # A prompt of its own, longer than a KV block: the choices after the first take its
    # blocks from the prefix cache (the first computes them).
    messages: list[Any] = [{"role": "user", "content": "Write a function that merges two "
                            "sorted lists of integers into one sorted list, in Python."}]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 10,
                              "temperature": 1.0, "n": 3, "seed": 11,
                              "extra_body": {"ignore_eos": True}}
    whole = api.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1  # each choice samples with its own seed (seed + index)
    assert whole.usage is not None and whole.usage.completion_tokens == 30
    assert whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens > 0
    assert [c.message.content for c in
            api.chat.completions.create(**kwargs).choices] == texts  # seeded: the same
    streamed = ["", "", ""]
    chunks = list(api.chat.completions.create(**kwargs, stream=True,
                                              stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    assert {c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason} == {"length"}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 30


@pytest.mark.slow  # loads transformers' model besides the daemon's: about 20 s
def test_lm_eval_loglikelihood_request_equals_transformers(api: openai.OpenAI) -> None:
    """lm-eval's local-completions loglikelihood request, as it sends it."""
    transformers = pytest.importorskip("transformers")
    import torch

    ids = TOKENIZER.encode(PROMPTS[0] + "    return n if n < 2 else fib(n - 1)")
    body = api.completions.create(model=MODEL, prompt=[ids], max_tokens=1, logprobs=1,
                                  echo=True, temperature=0, seed=1234)
    choice = body.choices[0]
    assert choice.text.startswith(TOKENIZER.decode(ids))
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.token_logprobs) == len(ids) + 1  # the prompt, then the output token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(logprobs.token_logprobs[1:len(ids)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # lm-eval's greediness check: each token's log-probability is its top-1's when greedy.
    for p, (value, top) in enumerate(zip(logprobs.token_logprobs[1:len(ids)],
                                         logprobs.top_logprobs[1:len(ids)], strict=True)):
        assert top is not None and len(top) == 1
        assert (value == max(top.values())) == (int(expected[p].argmax()) == ids[p + 1])


def test_stream_usage_and_the_fields_clients_add(api: openai.OpenAI) -> None:
    # continuous_usage_stats is vLLM's (guidellm and aiperf send it), not in the SDK's types.
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(api.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, stream=True,
        stream_options=options,
        extra_body={"min_tokens": 6, "skip_special_tokens": True, "no_stop_trim": False,
                    "spaces_between_special_tokens": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks)


def test_openai_validation(base_url: str, api: openai.OpenAI) -> None:
    for kwargs, param in (
            ({"temperature": 5}, "temperature"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
            ({"messages": []}, "messages"),
            ({"max_tokens": 10**9}, "max_tokens"),
            ({"extra_body": {"skip_special_tokens": False}}, "skip_special_tokens")):
        body: dict[str, Any] = {"model": MODEL, "messages": CHAT, **kwargs}
        with pytest.raises(openai.BadRequestError) as raised:
            api.chat.completions.create(**body)
        assert isinstance(raised.value.body, dict) and raised.value.body["param"] == param
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4o")
    status, info = get(base_url, "/get_model_info")
    assert status == 200 and json.loads(info)["model_path"] == MODEL
    labels = (("model_name", MODEL),)
    found = scrape(base_url)
    assert 0 <= found[("vllm:kv_cache_usage_perc", labels)] <= 1
    assert found[("vllm:num_requests_waiting", labels)] == 0
    assert ("vllm:num_requests_running", labels) in found


def test_metrics_move_as_requests_run(base_url: str, api: openai.OpenAI) -> None:
    before = scrape(base_url)
    api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                           extra_body={"ignore_eos": True})
    after = scrape(base_url)

    def moved(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("specd_requests_total", (("outcome", "length"),)) == 1
    assert moved("specd_generation_tokens_total") == 6
    assert moved("specd_prompt_tokens_total") > 0
    assert moved("specd_time_to_first_token_seconds_count") == 1
    assert moved("specd_inter_token_latency_seconds_count") == 5
    assert moved("specd_engine_generated_tokens_total") >= 6
    assert after[("specd_engine_up", ())] == 1 and after[("specd_kv_blocks", ())] > 0
    assert after[("specd_requests_running", ())] == 0
    assert sum(after[("specd_speculation_mode", (("mode", mode),))]
               for mode in ("on", "off", "auto")) == 1
    assert after[("specd_state", (("state", "ready"),))] == 1
    assert ("specd_spec_draft_tokens_total", ()) in after
    # Refusals only HTTP makes are counted too (the earlier tests made these).
    assert after[("specd_errors_total", (("code", "invalid_api_key"),))] >= 2
    assert after[("specd_errors_total", (("code", "bad_request"),))] >= 5
    assert after[("specd_errors_total", (("code", "model_not_found"),))] >= 1


def test_overload_is_429_and_a_disconnect_aborts(daemon: Daemon, base_url: str,
                                                 api: openai.OpenAI) -> None:
    gone_before = len(daemon.events("client_gone"))
    streams = [api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1500,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
               for _ in range(MAX_PENDING)]
    try:
        with pytest.raises(openai.RateLimitError) as raised:
            api.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert raised.value.response.headers["retry-after"] == "1"
        assert raised.value.code == "overloaded"
    finally:
        for stream in streams:
            stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with daemon.client() as client:
            stats = client.stats()
        if stats["open_requests"] == 0 and stats["engine"]["num_running"] == 0:
            break
        time.sleep(0.2)
    assert stats["open_requests"] == 0 and stats["engine"]["num_running"] == 0, stats
    assert len(daemon.events("client_gone")) - gone_before == MAX_PENDING
    assert scrape(base_url)[("specd_errors_total", (("code", "overloaded"),))] >= 1


def test_draining_answers_503(daemon: Daemon, base_url: str, api: openai.OpenAI) -> None:
    # Last in the module: the daemon exits after this drain.
    stream = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                    temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    with daemon.client() as client:
        client.drain(60)
    assert get(base_url, "/health", key=None) == (503, b'{"status":"draining"}')
    with pytest.raises(openai.InternalServerError) as raised:
        api.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert raised.value.status_code == 503 and raised.value.code == "shutting_down"
    chunks = list(stream)  # the request in flight finishes
    assert chunks[-1].choices[0].finish_reason == "length"
    assert daemon.wait(60) == 0
