"""A GGUF file's tensors as the Hugging Face checkpoint's: names, layout and bfloat16 values.

* Names: llama.cpp's (`blk.{i}.attn_q.weight`, `token_embd.weight`, ...) -> transformers'
  Llama names (`model.layers.{i}.self_attn.q_proj.weight`, ...). A tensor with another name
  is refused: it would be a part of the model the import does not place.
* Layout: GGUF lists a tensor's dimensions fastest first (ggml's ne[0] is a row's length),
  so the array is read as reversed(shape). llama.cpp's converter permutes the rows of
  attn_q and attn_k for its interleaved rotary embedding; they are permuted back (the
  inverse of its `permute`, as transformers' GGUF loader does), per head of that tensor.
* Values: a block-quantized tensor is dequantized to float32 by the `gguf` package
  (llama.cpp's reference reader: ggml's block formats, the arithmetic of ggml's
  dequantize_row_*), then rounded to bfloat16 to nearest even (torch's conversion). A float
  tensor keeps its own precision (F32 stays float32, F16 float16, BF16 bfloat16: llama.cpp
  keeps norms in F32), so nothing the file holds exactly is rounded. The types with no
  dequantization checked here against an independent one are refused by name
  (`SUPPORTED_TYPES`).
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch

# The types imported: float types converted, block-quantized ones dequantized by gguf.
SUPPORTED_TYPES = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
})

_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The transformers Llama name of GGUF tensor `name`; ValueError for one not placed."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER.match(name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no place in a Llama checkpoint")
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.weight"


FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def hf_tensor(tensor: Any, config: dict[str, Any]) -> torch.Tensor:
    """GGUF reader tensor -> its Hugging Face value: a float type in its own dtype, a
    quantized one in bfloat16 (module docstring)."""
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF tensor {tensor.name!r} is of type {kind}, which the import "
                         f"does not dequantize; supported: {sorted(SUPPORTED_TYPES)}")
    shape = [int(n) for n in reversed(tensor.shape)]
    if kind == "BF16":  # stored as its 16 bits: widen to float32 exactly, then back
        bits = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        values = torch.from_numpy(bits.view(np.float32).reshape(shape))  # a new array
    elif kind in ("F32", "F16"):
        values = torch.from_numpy(np.array(tensor.data, dtype=np.float32).reshape(shape))
    else:
        values = torch.from_numpy(
            gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape))
    if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config["num_attention_heads" if "attn_q" in tensor.name
                       else "num_key_value_heads"]
        values = unpermute_rotary(values, heads)
    return values.to(FLOAT_TYPES.get(kind, torch.bfloat16)).contiguous()


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's q/k permutation: within each head, its rows were reordered
    from rotate-half order (all first halves, then all second halves) to interleaved pairs;
    put them back. weight [num_heads * head_dim, in]."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"a rotary weight of {rows} rows does not split into {num_heads} "
                         "heads of pairs")
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape))
