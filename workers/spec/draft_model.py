"""The EAGLE-3 draft head in the layouts SGLang, vLLM, SpecForge and Speculators publish.

Published architecture names: `LlamaForCausalLMEagle3` (SpecForge/SGLang),
`Eagle3LlamaForCausalLM` (vLLM), `LlamaForCausalLM` with a `draft_vocab_size` (the original
EAGLE-3 releases) and `Eagle3Speculator` (Speculators, config nested under
`transformer_layer_config`); workers/spec/draft_config.py parses each, and
workers/spec/head_files.py reads config.json and the weights (safetensors or
`pytorch_model.bin`, single or sharded).

One Llama decoder layer (`midlayer`) reads two inputs side by side: the token embedding
and a hidden state. For a token that follows the verified prefix the hidden state is
`fc(cat(low, mid, high))`, three of the target's hidden states fused down to `hidden_size`;
for a token that follows a draft token it is the head's own output for that token (taken
before `norm`). The layer's attention projects `cat(input_layernorm(embeds),
hidden_norm(hidden))` (2*H wide); the residual stream is the hidden path:

    residual = hidden_norm(hidden) if norm_before_residual else hidden
    h = attn(cat(input_layernorm(embeds), hidden_norm(hidden))) + residual
    out = mlp(post_attention_layernorm(h)) + h               # fed back to the next step
    draft_logits = lm_head(norm(out))                        # [N, draft_vocab_size]

Draft token d is target token `d + d2t[d]`; `t2d` marks the target tokens the draft vocabulary
holds (derived from `d2t` when a checkpoint has none, as NVIDIA ModelOpt exports). The token
embedding is the target's unless the checkpoint carries `embed_tokens.weight`.

Which target hidden states feed `fc` comes from `eagle_aux_hidden_state_layer_ids`, read by
the rule of the format that wrote it (`draft_config.AUX_ID_OFFSET`) into transformers'
`output_hidden_states` numbering (0 = the embedding output, k = the output of decoder block
k-1); the reference default for a target of L blocks is (2, L // 2, L - 3).

The attention goes through `attend`: with a KV cache and attention metadata it writes this
step's K/V into the paged cache and attends through the head's per-head backend, chosen once
from its device (workers/runner/attention_backend.py); without them it is dense causal
attention over one sequence (tests, the dense tools). The trainer
uses `qkv`/`finish`/`logits` to run its own attention for training-time-test unrolling.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.models.layers import RMSNorm
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.attention_backend import PER_HEAD, PerHeadAttention
from specd.workers.spec.draft_config import DraftConfig
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


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


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


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, heads, d] by positions [..., T] (rotate-half layout, as Llama)."""
    freqs = positions[..., None].float() * inv_freq  # [..., T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]  # [..., T, 1, d]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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


class DraftHead(nn.Module):
    """An EAGLE-3 head; parameter and buffer names are the published checkpoint's.

    Build with `load_draft_head` (or `DraftHead(config, device)` + `load_weights`).
    `embed_tokens` holds the target's embedding weight (the same storage) unless the
    checkpoint has its own. `device`: where its paged attention runs (the backend is chosen
    from it here; the dense forwards run anywhere).
    """

    d2t: torch.Tensor  # int64 [draft_vocab_size]: target id = draft id + d2t[draft id]
    t2d: torch.Tensor  # bool [vocab_size]: target tokens in the draft vocabulary
    inv_freq: torch.Tensor  # float32 [head_dim // 2]

    def __init__(self, config: DraftConfig, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.attention = PER_HEAD.attention(device)
        h = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.scale = config.head_dim ** -0.5

    # --- building blocks (shared by the engine path and the trainer) ---

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[..., 3 * target_hidden] target hidden states (low, mid, high) -> [..., H]."""
        return self.fc(aux_hidden)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [..., T, heads, d], k and v [..., T, kv_heads, d].

        embeds, hidden: [..., T, H]; positions: [..., T] rope positions.
        """
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        cfg = self.config
        q = layer.self_attn.q_proj(x).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
        k = layer.self_attn.k_proj(x).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        v = layer.self_attn.v_proj(x).unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
        return apply_rope(q, positions, self.inv_freq), apply_rope(k, positions, self.inv_freq), v

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """attn [..., T, heads, d] and the layer's input hidden [..., T, H] -> output (pre-norm)."""
        layer = self.midlayer
        residual = layer.hidden_norm(hidden) if self.config.norm_before_residual else hidden
        h = layer.self_attn.o_proj(attn.flatten(-2)) + residual
        return layer.mlp(layer.post_attention_layernorm(h)) + h

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm output [..., H] -> draft-vocabulary logits [..., draft_vocab_size]."""
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (same shape)."""
        return draft_ids + self.d2t[draft_ids]

    # --- forwards ---

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                hidden: torch.Tensor, kv_cache: torch.Tensor | None = None,
                meta: AttentionMetadata | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One step over N rows laid out as the target model's (the shared contract).

        input_ids [N] (or embeds [N, H]); positions [N]; hidden [N, H]: `fuse(aux)` for rows
        that follow verified tokens, the head's previous output for rows after draft tokens.
        kv_cache/meta: the head's own paged cache layer and this step's metadata (None: one
        dense causal sequence). Returns the pre-norm output [N, H]; `logits` gives the scores.
        """
        if embeds is None:
            if input_ids is None:
                raise ValueError("DraftHead.forward: give input_ids or embeds")
            embeds = self.embed_tokens(input_ids)
        q, k, v = self.qkv(embeds, hidden, positions)
        return self.finish(attend(q, k, v, kv_cache, meta, self.scale, self.attention), hidden)

    def forward_dense(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """Batched dense forward: embeds/hidden [B, T, H], positions [B, T] -> output [B, T, H].

        mask: bool [T, T] or [B, T, T], True where row i may see key j; None = causal.
        """
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

    # --- weights ---

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str,
                     target_embed_weight: torch.Tensor | None = None) -> None:
        """Load published tensors (names as in the checkpoint) into this head.

        Accepts the SGLang `model.` prefix and the Speculators/vLLM `layers.0.` alias of
        `midlayer.`. `d2t` may be absent only when the draft vocabulary is the target's; `t2d`
        may be absent (it follows from `d2t`). ValueError (naming `source`) for missing,
        unexpected or misshapen tensors.
        """
        tensors = {_canonical_name(n): t for n, t in tensors.items()}
        cfg = self.config
        expected = {n: tuple(p.shape) for n, p in self.named_parameters()}
        expected.update({"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
        optional = {"embed_tokens.weight", "t2d"}
        if cfg.draft_vocab_size == cfg.vocab_size:
            optional.add("d2t")
        missing = sorted(set(expected) - set(tensors) - optional)
        unexpected = sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{source}: not an EAGLE-3 head in the published layout: "
                             f"missing tensors {missing}, unexpected tensors {unexpected}")
        if "embed_tokens.weight" not in tensors:
            if target_embed_weight is None:
                raise ValueError(f"{source}: has no embed_tokens.weight and no target embedding "
                                 "was given to share")
            tensors["embed_tokens.weight"] = target_embed_weight
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {expected[name]} from config.json")
        self._load_vocab_maps(tensors, source)
        with torch.no_grad():
            for name, param in self.named_parameters():
                value = tensors[name]
                if value is target_embed_weight:
                    # Share the target's storage (a copy only if the dtype differs).
                    param.data = value.to(device=param.device, dtype=param.dtype)
                else:
                    param.copy_(value)

    def _load_vocab_maps(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """d2t of any integer dtype (int32 in some exports) becomes int64; t2d must be the
        set d2t maps onto (vLLM ignores t2d; specd checks it, or derives it when absent)."""
        cfg = self.config
        if "d2t" not in tensors:
            if "t2d" in tensors:
                raise ValueError(f"{source}: has t2d but no d2t (d2t names the target tokens)")
            self.d2t.zero_()
            self.t2d.fill_(True)
            return
        d2t = tensors["d2t"]
        if d2t.dtype.is_floating_point or d2t.dtype.is_complex or d2t.dtype == torch.bool:
            raise ValueError(f"{source}: d2t must hold integers, got {d2t.dtype}")
        target_ids = d2t.long() + torch.arange(cfg.draft_vocab_size, device=d2t.device)
        if bool((target_ids < 0).any()) or bool((target_ids >= cfg.vocab_size).any()):
            raise ValueError(f"{source}: d2t maps draft ids outside the target vocabulary "
                             f"[0, {cfg.vocab_size})")
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=d2t.device)
        t2d[target_ids] = True
        if int(t2d.sum()) != cfg.draft_vocab_size:
            raise ValueError(f"{source}: d2t maps two draft ids to the same target token")
        if "t2d" in tensors:
            stored = tensors["t2d"]
            if stored.dtype != torch.bool:
                raise ValueError(f"{source}: t2d must be bool, got {stored.dtype}")
            if not torch.equal(stored.to(t2d.device), t2d):
                raise ValueError(f"{source}: t2d does not mark exactly the "
                                 f"{cfg.draft_vocab_size} target tokens that d2t maps to")
        self.d2t.copy_(d2t)  # to int64
        self.t2d.copy_(t2d)


def _canonical_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def load_draft_head(path: str | Path, target_embed_weight: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    ) -> DraftHead:
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
                     device: str | torch.device) -> DraftHead:
    """The head of `config` with uninitialized storage in `dtype` on `device` (the meta
    device: no memory, what `specctl plan` counts), its rope frequencies float32 for
    accuracy: every tensor `load_draft_head` fills, before it fills them."""
    with torch.device("meta"):
        head = DraftHead(config, torch.device(device))
    head = head.to_empty(device=device).to(dtype)
    head.inv_freq = rope_inv_freq(config).to(device)
    return head
