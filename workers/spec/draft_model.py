"""The EAGLE-3 draft head in the layouts SGLang, vLLM, SpecForge and Speculators publish.

Published architecture names: `LlamaForCausalLMEagle3` (SpecForge/SGLang),
`Eagle3LlamaForCausalLM` (vLLM), `LlamaForCausalLM` with a `draft_vocab_size` (the original
EAGLE-3 releases) and `Eagle3Speculator` (Speculators, config nested under
`transformer_layer_config`), each a Llama layer (`DraftHead`, here); and
`Eagle3DeepseekV2ForCausalLM`, a DeepSeek MLA layer (`MlaDraftHead`,
workers/spec/draft_mla.py). workers/spec/draft_config.py parses each, and
workers/spec/head_files.py reads config.json and the weights (safetensors or
`pytorch_model.bin`, single or sharded), workers/spec/head_weights.py checks and loads them;
what every head has is `Eagle3Head` (workers/spec/draft_head.py).

One decoder layer (`midlayer`) reads two inputs side by side: the token embedding and a
hidden state. For a token that follows the verified prefix the hidden state is
`fc(cat(low, mid, high))`, three of the target's hidden states fused down to `hidden_size`;
for a token that follows a draft token it is the head's own output for that token. The
layer's attention projects `cat(input_layernorm(embeds), hidden_norm(hidden))` (2*H wide);
the residual stream is the hidden path (`Eagle3Head.after_attention`):

    residual = hidden_norm(hidden) if norm_before_residual else hidden
    h = attn(cat(input_layernorm(embeds), hidden_norm(hidden))) + residual
    out = mlp(post_attention_layernorm(h)) + h
    out = norm(out) if norm_output else out                  # fed back to the next step
    draft_logits = lm_head(out if norm_output else norm(out))  # [N, draft_vocab_size]

Draft token d is target token `d + d2t[d]`; `t2d` marks the target tokens the draft vocabulary
holds (derived from `d2t` when a checkpoint has none, as NVIDIA ModelOpt exports). The token
embedding is the target's unless the checkpoint carries `embed_tokens.weight`.

Which target hidden states feed `fc` comes from `eagle_aux_hidden_state_layer_ids`, read by
the rule of the format that wrote it (`draft_config.AUX_ID_OFFSET`) into transformers'
`output_hidden_states` numbering (0 = the embedding output, k = the output of decoder block
k-1); the reference default for a target of L blocks is (2, L // 2, L - 3).

Each head's attention runs three ways over its own cache (`DraftConfig.kv_layer_shape`):
paged (`forward` with a KV cache and attention metadata: it writes this step's K/V, or MLA
latents, and attends the sequence's cached prefix through the backend of its cache layout,
chosen once from its device, workers/runner/attention_backend.py; without them, dense causal
attention over one sequence, for tests and the dense tools), batched dense
(`forward_dense`), and one level of tree drafting over a gathered prefix plus the tree nodes
so far (`gather_prefix`, `draft_level`: workers/spec/drafting.py's draft loop). The trainer
uses the Llama head's `qkv`/`finish`/`logits` to run its own attention for training-time-test
unrolling.
"""


from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.models.layers import apply_rotary
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.attention_backend import PER_HEAD, PerHeadAttention
from specd.workers.spec.draft_config import DraftConfig
from specd.workers.spec.draft_head import Eagle3Head
from specd.workers.spec.draft_mla import MlaDraftHead
from specd.workers.spec.head_files import read_draft_config, read_head_tensors


class Attention(nn.Module):
    """Projections only; the attention itself is `attend` (paged) or the caller's (training)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, cfg.hidden_size, bias=False)


def rope_inv_freq(cfg: DraftConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies (Llama-3 scaling when configured)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if cfg.rope_type == "llama3":
        low_wavelen = cfg.original_max_position / cfg.low_freq_factor
        high_wavelen = cfg.original_max_position / cfg.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (cfg.original_max_position / wavelen - cfg.low_freq_factor) / (
            cfg.high_freq_factor - cfg.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.rope_factor, inv)
        mid = (1 - smooth) * inv / cfg.rope_factor + smooth * inv
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] -> (cos, sin) [..., T, 1, d/2] in `dtype`, for `apply_rotary`
    (rotate-half layout, as Llama: pair (i, i + d/2) turns by frequency i)."""
    freqs = positions[..., None].float() * inv_freq  # [..., T, d/2]
    return freqs.cos().to(dtype)[..., None, :], freqs.sin().to(dtype)[..., None, :]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None,
           meta: AttentionMetadata | None, scale: float, attention: PerHeadAttention
           ) -> torch.Tensor:
    """Attention for N query rows: q [N, heads, d], k/v [N, kv_heads, d] -> [N, heads, d].

    With `kv_cache` [2, num_blocks, block_size, kv_heads, d] and `meta` (AttentionMetadata of
    `specd.workers.runner.attention`), K/V are written at `meta.slot_mapping` and `attention`
    runs over each sequence's cached prefix (tree mask as in the shared contract), in the
    cache's dtype. Without them, the rows are one sequence attended causally (dense; tests
    and tools).
    """
    if kv_cache is None:
        if meta is not None:
            raise ValueError("attend: attention metadata given without a kv_cache")
        return _dense_causal(q, k, v, scale)
    if meta is None:
        raise ValueError("attend: a kv_cache needs this step's attention metadata")
    attention.store(k.to(kv_cache.dtype), v.to(kv_cache.dtype), kv_cache, meta.slot_mapping)
    return attention.attend(q.to(kv_cache.dtype), kv_cache, meta, scale).to(q.dtype)


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # [N, H, d] -> [1, H, N, d] for SDPA; GQA by repeating kv heads.
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return out[0].transpose(0, 1)


class DraftHead(Eagle3Head):
    """An EAGLE-3 head with a Llama layer. Build with `load_draft_head` (or
    `DraftHead(config, device)` + `load_weights`). `device`: where its paged attention runs
    (the backend is chosen from it here; the dense forwards run anywhere)."""

    inv_freq: torch.Tensor  # float32 [head_dim // 2]

    def __init__(self, config: DraftConfig, device: torch.device) -> None:
        super().__init__(config, Attention(config))
        self.attention = PER_HEAD.attention(device)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.scale = config.head_dim ** -0.5

    @property
    def attn(self) -> Attention:
        """The layer's attention projections (`midlayer.self_attn`)."""
        return cast(Attention, self.midlayer.self_attn)

    # --- building blocks (shared by the engine path and the trainer) ---

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [..., T, heads, d], k and v [..., T, kv_heads, d].

        embeds, hidden: [..., T, H]; positions: [..., T] rope positions.
        """
        x = self.attention_input(embeds, hidden)
        attn, cfg = self.attn, self.config
        q = attn.q_proj(x).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
        k = attn.k_proj(x).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        v = attn.v_proj(x).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        cos, sin = rope_cos_sin(positions, self.inv_freq, q.dtype)  # once for q and k
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attn [..., T, heads, d] and the layer's input hidden [..., T, H] -> the fed-back
        state [..., T, H]."""
        return self.after_attention(self.attn.o_proj(attn.flatten(-2)), hidden)

    # --- the three ways ---

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                hidden: torch.Tensor, kv_cache: torch.Tensor | None = None,
                meta: AttentionMetadata | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(self.embed(input_ids, embeds), hidden, positions)
        return self.finish(attend(q, k, v, kv_cache, meta, self.scale, self.attention), hidden)

    def forward_dense(self, embeds: torch.Tensor, hidden: torch.Tensor,
                      positions: torch.Tensor, mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
        q, k, v = self.qkv(embeds, hidden, positions)
        group = q.shape[-2] // k.shape[-2]
        qh = q.transpose(-2, -3)  # [B, heads, T, d]
        kh = k.repeat_interleave(group, dim=-2).transpose(-2, -3)
        vh = v.repeat_interleave(group, dim=-2).transpose(-2, -3)
        if mask is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            attn_mask = mask[:, None] if mask.dim() == 3 else mask
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask,
                                                 scale=self.scale)
        return self.finish(out.transpose(-2, -3), hidden)

    def gather_prefix(self, kv_cache: torch.Tensor, slots: torch.Tensor
                      ) -> tuple[torch.Tensor, ...]:
        """(K, V) of the prefixes, each [B, L, kv_heads, d]."""
        flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        return flat[0][slots], flat[1][slots]

    def draft_level(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    prefix: tuple[torch.Tensor, ...], scratch: list[tuple[torch.Tensor, ...]],
                    mask: torch.Tensor) -> torch.Tensor:
        q, key, value = self.qkv(embeds, hidden, positions)  # [B, K, heads|kvh, d]
        scratch.append((key, value))
        keys = torch.cat([prefix[0], *(k for k, _ in scratch)], dim=1)  # [B, L + n*K, kvh, d]
        values = torch.cat([prefix[1], *(v for _, v in scratch)], dim=1)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None], scale=self.scale, enable_gqa=True)  # [B, heads, K, d]
        return self.finish(attn.transpose(1, 2), hidden)

    def place_rope(self, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(self.config).to(device)


def build_head(config: DraftConfig, device: torch.device) -> Eagle3Head:
    """The head `config` describes, for `device` (its attention backend, its rope tables;
    MLA: `MlaDraftHead`)."""
    if config.mla_layer is None:
        return DraftHead(config, device)
    return MlaDraftHead(config, device)


def load_draft_head(path: str | Path, target_embed_weight: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    ) -> Eagle3Head:
    """Load a head from a directory holding config.json and its weights in a published
    layout (`head_files.WEIGHT_FILES`).

    target_embed_weight [vocab_size, hidden_size]: the target's token embedding, shared when
    the checkpoint carries none. Raises FileNotFoundError / ValueError naming the file.
    """
    root = Path(path)
    config = read_draft_config(root)
    tensors, weights_path = read_head_tensors(root, device)
    head = empty_draft_head(config, dtype, device)
    head.load_weights(tensors, str(weights_path), target_embed_weight)
    return head.eval()


def empty_draft_head(config: DraftConfig, dtype: torch.dtype,
                     device: str | torch.device) -> Eagle3Head:
    """The head of `config` with uninitialized storage in `dtype` on `device` (the meta
    device: no memory, what `specctl plan` counts), its rope tables float32 for accuracy:
    every tensor `load_draft_head` fills, before it fills them."""
    with torch.device("meta"):
        head = build_head(config, torch.device(device))
    head = head.to_empty(device=device).to(dtype)
    head.place_rope(torch.device(device))
    return head
