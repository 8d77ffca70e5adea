"""lm-eval (EleutherAI's harness), unmodified, against a live daemon: its `local-completions`
model runs a `loglikelihood` task and a `multiple_choice` task over local JSONL files, and
the log-likelihoods it records equal transformers' for the fixture in float32 to 1e-4.

lm-eval asks for them as `{"prompt": [[ids]], "max_tokens": 1, "logprobs": 1, "echo": true,
"temperature": 0}` and sums `token_logprobs` over the continuation; it tokenizes with the
model's own tokenizer (`tokenizer=` the model directory). Skipped where lm-eval is not
installed (.ci/run installs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specd.workers.config import FIXTURE_DIR
from tests.integration.daemon_harness import Daemon

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

LOGLIKELIHOOD: list[dict[str, Any]] = [
    {"context": "def fib(n):\n", "continuation": "    return n"},
    {"context": "import os\nimport sys\n", "continuation": "\ndef main():"},
    {"context": "class Point:\n    def __init__(self", "continuation": ", x, y):"},
]
MULTIPLE_CHOICE: list[dict[str, Any]] = [
    {"question": "for i in range(10):\n    print(", "choices": ["i)", "x)", "'hello')"],
     "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": ["a + b", "a * b", "None"],
     "answer": 0},
]


def write_tasks(root: Path) -> Path:
    """Two lm-eval task configs over local JSONL files, in `root`."""
    for name, rows in (("ll", LOGLIKELIHOOD), ("mc", MULTIPLE_CHOICE)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\n")
    (root / "specd_ll.yaml").write_text(
        "task: specd_ll\n" + common.format(data=root / "ll.jsonl")
        + "output_type: loglikelihood\ndoc_to_text: '{{context}}'\n"
        + "doc_to_target: '{{continuation}}'\nmetric_list:\n  - metric: perplexity\n"
        + "    aggregation: perplexity\n    higher_is_better: false\n  - metric: acc\n")
    (root / "specd_mc.yaml").write_text(
        "task: specd_mc\n" + common.format(data=root / "mc.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        + "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        + "metric_list:\n  - metric: acc\n")
    return root


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("lm-eval")
    daemon = Daemon(tmp, "--model", "fixture", "--dtype", "float32", "--no-spec-auto-measure",
                    "--http", "127.0.0.1:0").wait_ready()
    record = daemon.events("http_listening")[0]
    yield f"http://{record['host']}:{record['port']}"
    daemon.stop()


def hf_loglikelihood(model: Any, tokenizer: Any, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, tokenized as lm-eval does
    (`_encode_pair`: the context's trailing whitespace moved to the continuation, the
    continuation's tokens those of the whole after the context's)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    num_context = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([whole])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return float(sum(logprobs[i - 1, whole[i]] for i in range(num_context, len(whole))))


def test_lm_eval_runs_loglikelihood_and_multiple_choice(base_url: str, tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "OPENAI_API_KEY": "none"}
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
               "--model_args", f"model=fixture,base_url={base_url}/v1/completions,"
               f"tokenizer_backend=huggingface,tokenizer={FIXTURE_DIR},num_concurrent=1,"
               "max_retries=1",
               "--tasks", "specd_ll,specd_mc", "--include_path", str(tasks),
               "--output_path", str(out), "--log_samples"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    samples = {task: [json.loads(line) for path in out.rglob(f"samples_{task}_*.jsonl")
                      for line in path.read_text().splitlines()]
               for task in ("specd_ll", "specd_mc")}
    assert len(samples["specd_ll"]) == len(LOGLIKELIHOOD)
    assert len(samples["specd_mc"]) == len(MULTIPLE_CHOICE)
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURE_DIR, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(FIXTURE_DIR)
    checked = 0
    for task_samples in samples.values():
        for sample in task_samples:
            # {"gen_args_i": {"arg_0": context, "arg_1": continuation}}, and per request
            # [[log-likelihood, is_greedy]] (as strings).
            for arguments, response in zip(sample["arguments"].values(), sample["resps"],
                                           strict=True):
                context, continuation = arguments["arg_0"], arguments["arg_1"]
                expected = hf_loglikelihood(model, tokenizer, context, continuation)
                assert abs(float(response[0][0]) - expected) < 1e-4, (context, continuation)
                checked += 1
    assert checked == len(LOGLIKELIHOOD) + sum(len(r["choices"]) for r in MULTIPLE_CHOICE)
