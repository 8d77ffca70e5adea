"""ModelRunner behaviour beyond logits parity: KV block budget, sampling with per-request
generators, log-probs, and the inputs it refuses. Driven with hand-built sequences and block
tables on a tiny random Llama (no scheduler)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.config import EngineConfig
from specd.workers.engine.batch import ScheduledBatch, ScheduledSequence
from specd.workers.engine.sequence import Sequence
from specd.workers.runner.cpu_backend import CpuBackend
from specd.workers.runner.kv_cache import kv_block_bytes
from specd.workers.runner.model_runner import ModelRunner, prepare_inputs

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def make_runner(model_dir: Path, **options: object) -> ModelRunner:
    defaults: dict[str, object] = {"dtype": "float32", "num_kv_blocks": 32}
    config = EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE,
                          **(defaults | options))
    return ModelRunner(config)


def generate(runner: ModelRunner, seqs: list[Sequence], num_steps: int) -> None:
    """Prefill then decode every sequence for `num_steps` steps, blocks handed out in order."""
    next_block = 0
    for _ in range(num_steps):
        work = [(s, s.num_tokens - s.num_computed_tokens) for s in seqs]
        for s, n in work:
            while len(s.block_ids) * BLOCK_SIZE < s.num_computed_tokens + n:
                s.block_ids.append(next_block)
                next_block += 1
        output = runner.execute(ScheduledBatch([ScheduledSequence(s, n) for s, n in work]))
        for s, n in work:
            s.num_computed_tokens += n
            s.output_token_ids += output.sampled[s.request_id]


def test_block_count_follows_the_memory_budget(model_dir: Path) -> None:
    runner = make_runner(model_dir, num_kv_blocks=None, kv_cache_memory_bytes=1 << 20)
    per_block = kv_block_bytes(runner.model_config, BLOCK_SIZE, torch.float32)
    assert per_block == 2 * 2 * BLOCK_SIZE * 2 * 8 * 4  # K+V, layers, tokens, kv heads, dim, fp32
    assert runner.num_kv_blocks == (1 << 20) // per_block
    assert [tuple(c.shape) for c in runner.kv_caches] == [(2, runner.num_kv_blocks, 4, 2, 8)] * 2


def test_budget_below_one_block_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_bytes .* holds no KV block"):
        make_runner(model_dir, num_kv_blocks=None, kv_cache_memory_bytes=100)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(model_dir: Path) -> None:
    hot = SamplingParams(temperature=1.5, seed=7)
    alone = [Sequence("a", [1, 2, 3], hot)]
    generate(make_runner(model_dir), alone, 12)
    crowd = [Sequence("x", [4, 5], SamplingParams(temperature=1.0)), Sequence("a", [1, 2, 3], hot),
             Sequence("y", [9], SamplingParams())]
    generate(make_runner(model_dir), crowd, 12)
    assert crowd[1].output_token_ids == alone[0].output_token_ids
    other_seed = [Sequence("a", [1, 2, 3], SamplingParams(temperature=1.5, seed=8))]
    generate(make_runner(model_dir), other_seed, 12)
    assert other_seed[0].output_token_ids != alone[0].output_token_ids


def test_release_drops_the_generator_so_a_reused_id_starts_over(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    first = [Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0, seed=3))]
    generate(runner, first, 6)
    assert "a" in runner.generators
    runner.release("a")
    runner.release("never-seen")
    assert runner.generators == {}
    again = [Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0, seed=3))]
    generate(runner, again, 6)
    assert again[0].output_token_ids == first[0].output_token_ids


def test_logprobs_are_returned_only_when_asked(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    asked = Sequence("asked", [1, 2, 3, 4, 5], SamplingParams(logprobs=3))
    plain = Sequence("plain", [6, 7], SamplingParams())
    asked.block_ids, plain.block_ids = [0, 1], [2]
    output = runner.execute(ScheduledBatch([ScheduledSequence(asked, 5),
                                            ScheduledSequence(plain, 2)]))
    assert set(output.logprobs) == {"asked"}
    (lp,) = output.logprobs["asked"]
    assert len(lp.top_ids) == 3 and lp.top_ids[0] == output.sampled["asked"][0]  # greedy
    assert lp.logprob == pytest.approx(lp.top_logprobs[0])
    assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_a_prefill_chunk_that_does_not_reach_the_end_samples_nothing(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    seq = Sequence("a", list(range(10)), SamplingParams())
    seq.block_ids = [0, 1, 2]
    assert runner.execute(ScheduledBatch([ScheduledSequence(seq, 6)])).sampled == {}


def test_draft_tokens_are_refused_by_the_plain_step(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    seq = Sequence("a", [1, 2, 3], SamplingParams())
    seq.spec_token_ids = [4, 5]
    seq.block_ids = [0, 1]
    with pytest.raises(ValueError, match=r"requests \['a'\] carry draft tokens"):
        runner.execute(ScheduledBatch([ScheduledSequence(seq, 5)]))


@pytest.mark.parametrize("layers", [(3,), (2, 1), (1, 1), (-1,)])
def test_capture_layers_must_be_ascending_and_in_range(model_dir: Path,
                                                       layers: tuple[int, ...]) -> None:
    config = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"capture_layers must be strictly ascending .*\[0, 2\]"):
        ModelRunner(config, capture_layers=layers)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(model_dir: Path, dtype: str) -> None:
    """Half-precision weights, activations and KV cache; logits within what 8 (bf16) or 11
    (fp16) mantissa bits allow of the fp32 run: 5% of the logits' spread."""
    def logits(runner: ModelRunner) -> torch.Tensor:
        seq = Sequence("a", list(range(1, 14)), SamplingParams())
        seq.block_ids = [3, 0, 2, 1]
        with torch.inference_mode():
            inputs = prepare_inputs(ScheduledBatch([ScheduledSequence(seq, 13)]), BLOCK_SIZE,
                                    runner.device)
            return runner.model.compute_logits(runner.forward(inputs)).float()

    half = make_runner(model_dir, dtype=dtype)
    assert {p.dtype for p in half.model.parameters()} == {getattr(torch, dtype)}
    assert half.kv_caches[0].dtype == getattr(torch, dtype)
    full = logits(make_runner(model_dir))
    torch.testing.assert_close(logits(half), full, atol=0.05 * float(full.std()), rtol=0)


@pytest.mark.parametrize(("device", "stored", "native_bf16", "expected"), [
    ("cpu", "bfloat16", True, "bfloat16"),   # AVX512-BF16/AMX: the checkpoint's dtype
    ("cpu", "bfloat16", False, "float32"),   # emulated bf16 is slow: float32
    ("cpu", "float16", True, "float32"),     # no native fp16 matmuls on these CPUs
    ("cpu", None, True, "float32"),
    ("cuda", "float16", False, "float16"),
    ("cuda", "float32", False, "bfloat16"),
])
def test_auto_dtype_is_the_checkpoints_half_precision_where_native(
        monkeypatch: pytest.MonkeyPatch, device: str, stored: str | None, native_bf16: bool,
        expected: str) -> None:
    from specd.workers.models.config import ModelConfig
    from specd.workers.runner.dtypes import resolve_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)

    class Stored:  # only the field resolve_dtype reads
        torch_dtype = stored

    cfg: ModelConfig = Stored()
    assert resolve_dtype(EngineConfig(device=device), cfg) == expected
    assert resolve_dtype(EngineConfig(device=device, dtype="float16"), cfg) == "float16"


def test_packed_bf16_linears_compute_what_nn_linear_computes(model_dir: Path) -> None:
    from specd.workers.models.layers import PackedLinear, bf16_packing_unsupported

    if (reason := bf16_packing_unsupported()) is not None:
        pytest.skip(f"this CPU cannot pack bf16 linears: {reason}")
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear)
    for shape in ((1, 48), (7, 48), (2, 3, 48)):
        x = torch.randn(*shape, dtype=torch.bfloat16)
        torch.testing.assert_close(packed(x), linear(x), atol=0, rtol=0)
    # A bf16 runner on the CPU packs every dense linear.
    backend = make_runner(model_dir, dtype="bfloat16").backend
    assert isinstance(backend, CpuBackend) and backend.num_packed_linears == 2 * 4 + 1
    assert backend.linears_status() == "packed for oneDNN (9 bfloat16 linears)"


# A CPU without oneDNN's bf16 GEMM, on any host: oneDNN reads this cap as the CPU's ISA.
_AVX2_ONLY = """
import sys, torch
from specd.workers.config import EngineConfig
from specd.workers.runner.model_runner import ModelRunner
from specd.workers.models.layers import bf16_packing_unsupported
assert bf16_packing_unsupported() is not None, "the ISA cap did not take"
runner = ModelRunner(EngineConfig(model=sys.argv[1], dtype="bfloat16", num_kv_blocks=32))
assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
print(runner.backend.num_packed_linears)
print(runner.backend.linears_status())
"""


def test_a_cpu_without_onednn_bf16_keeps_nn_linear_and_says_why(model_dir: Path) -> None:
    """oneDNN refuses to lay out a bf16 weight on an AVX2-only CPU: there the runner keeps
    `nn.Linear` (no traceback) and its status names what the CPU lacks."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _AVX2_ONLY, str(model_dir)],
                            env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    count, status = result.stdout.splitlines()[-2:]
    assert count == "0"
    assert status == ("nn.Linear (oneDNN's bf16 GEMM needs avx_ne_convert, or avx512bw, "
                      "avx512vl and avx512dq, which this CPU lacks)")


def test_packed_float32_linears_compute_what_nn_linear_computes_up_to_rounding(
        model_dir: Path) -> None:
    from specd.workers.models.layers import PackedLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40, bias=True)
    packed = PackedLinear(linear)
    for shape in ((1, 48), (7, 48), (2, 3, 48)):
        x = torch.randn(*shape)
        # oneDNN's kernel against MKL's: the same products, summed in another order.
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    # A float32 runner told --cpu-linear onednn packs every dense linear; told mkl it keeps
    # nn.Linear.
    backend = make_runner(model_dir, cpu_linear="onednn").backend
    assert isinstance(backend, CpuBackend) and backend.num_packed_linears == 2 * 4 + 1
    assert backend.linears_status() == "float32 on onednn (requested)"
    plain = make_runner(model_dir, cpu_linear="mkl").backend
    assert isinstance(plain, CpuBackend) and plain.num_packed_linears == 0
    assert plain.linears_status() == "float32 on mkl (requested)"


def test_transposed_float32_linears_compute_what_nn_linear_computes_up_to_rounding(
        model_dir: Path) -> None:
    from specd.workers.models.layers import TransposedLinear

    torch.manual_seed(0)
    for bias in (True, False):
        linear = torch.nn.Linear(48, 40, bias=bias)
        transposed = TransposedLinear(linear)
        # The same weight, read through its [out, in] view, for code that reads `.weight`.
        assert torch.equal(transposed.weight, linear.weight)
        for shape in ((1, 48), (7, 48), (2, 3, 48)):
            x = torch.randn(*shape)
            torch.testing.assert_close(transposed(x), linear(x), atol=1e-5, rtol=1e-5)
    backend = make_runner(model_dir, cpu_linear="transposed").backend
    assert isinstance(backend, CpuBackend) and backend.num_packed_linears == 2 * 4 + 1
    assert all(not isinstance(m, torch.nn.Linear) for m in backend.model.modules())


def test_auto_runs_float32_linears_on_the_kernel_measured_fastest(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="specd.cpu_linears"):
        backend = make_runner(model_dir).backend
    assert isinstance(backend, CpuBackend)
    choice = backend.linear_choice
    # Every candidate was timed, and the chosen one took the least time.
    assert set(choice.ms) == {"mkl", "onednn", "transposed"}
    assert choice.how == "auto" and choice.kernel == min(choice.ms, key=choice.ms.__getitem__)
    assert all(ms > 0 for ms in choice.ms.values())
    assert backend.linears_status().startswith(f"float32 on {choice.kernel} (fastest measured")
    # The choice is one logged event, with every candidate's time.
    [record] = [r for r in caplog.records if getattr(r, "event", "") == "cpu_linear_kernel"]
    assert vars(record)["kernel"] == choice.kernel and set(vars(record)["ms"]) == set(choice.ms)
    # With --cpu-compile oneDNN's packed op is no candidate (compiled steps cannot lower it).
    compiled = make_runner(model_dir, cpu_compile=True).backend
    assert isinstance(compiled, CpuBackend)
    assert set(compiled.linear_choice.ms) == {"mkl", "transposed"}


def test_a_cpu_linear_kernel_that_cannot_run_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cpu_linear must be auto or one of"):
        EngineConfig(cpu_linear="blas")
    with pytest.raises(ValueError, match="cpu_linear onednn cannot be compiled"):
        EngineConfig(cpu_linear="onednn", cpu_compile=True)
