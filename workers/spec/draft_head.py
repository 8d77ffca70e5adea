"""What every EAGLE-3 draft head has, whatever its layer's attention: `Eagle3Head`.

The layer and the head around it (fc, norms, MLP, residual, norm_output, lm_head, the
vocabulary maps) are described in workers/spec/draft_model.py's docstring; a subclass
supplies the attention: `DraftHead` (a Llama layer, draft_model.py) and `MlaDraftHead` (an
MLA layer, draft_mla.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.models.layers import RMSNorm
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.spec.draft_config import DraftConfig
from specd.workers.spec.head_weights import load_head_weights


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The head's decoder layer; `self_attn` is the head's attention (Llama or MLA)."""

    def __init__(self, cfg: DraftConfig, self_attn: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Eagle3Head(nn.Module, ABC):
    """What every EAGLE-3 head has (module docstring); parameter and buffer names are the
    published checkpoint's. A subclass supplies the layer's attention and its three ways
    of running it (`forward`, `forward_dense`, `gather_prefix` + `draft_level`).

    `embed_tokens` holds the target's embedding weight (the same storage) unless the
    checkpoint has its own.
    """

    d2t: torch.Tensor  # int64 [draft_vocab_size]: target id = draft id + d2t[draft id]
    t2d: torch.Tensor  # bool [vocab_size]: target tokens in the draft vocabulary

    def __init__(self, config: DraftConfig, self_attn: nn.Module) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(config, self_attn)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    # --- the layer around its attention ---

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[..., 3 * target_hidden] target hidden states (low, mid, high) -> [..., H]."""
        return self.fc(aux_hidden)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds, hidden [..., H] -> the attention's input [..., 2H]."""
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)

    def after_attention(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The attention's output [..., H] (after o_proj) and the layer's input hidden
        [..., H] -> the state fed back to the next step (normed under norm_output)."""
        layer = self.midlayer
        residual = layer.hidden_norm(hidden) if self.config.norm_before_residual else hidden
        h = attn_out + residual
        out = layer.mlp(layer.post_attention_layernorm(h)) + h
        return self.norm(out) if self.config.norm_output else out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The fed-back state [..., H] -> draft-vocabulary logits [..., draft_vocab_size]."""
        return self.lm_head(out if self.config.norm_output else self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (same shape)."""
        return draft_ids + self.d2t[draft_ids]

    def embed(self, input_ids: torch.Tensor | None, embeds: torch.Tensor | None
              ) -> torch.Tensor:
        """`embeds` when given, else the embedding of `input_ids`."""
        if embeds is not None:
            return embeds
        if input_ids is None:
            raise ValueError(f"{type(self).__name__}.forward: give input_ids or embeds")
        return self.embed_tokens(input_ids)

    # --- the attention, run three ways (subclasses) ---

    @abstractmethod
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                hidden: torch.Tensor, kv_cache: torch.Tensor | None = None,
                meta: AttentionMetadata | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One step over N rows laid out as the target model's (the shared contract).

        input_ids [N] (or embeds [N, H]); positions [N]; hidden [N, H]: `fuse(aux)` for rows
        that follow verified tokens, the head's previous output for rows after draft tokens.
        kv_cache/meta: the head's own paged cache layer (`DraftConfig.kv_layer_shape`) and
        this step's metadata (None: one dense causal sequence). Returns the fed-back state
        [N, H]; `logits` gives the scores.
        """

    @abstractmethod
    def forward_dense(self, embeds: torch.Tensor, hidden: torch.Tensor,
                      positions: torch.Tensor, mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Batched dense forward: embeds/hidden [B, T, H], positions [B, T] -> [B, T, H].

        mask: bool [T, T] or [B, T, T], True where row i may see key j; None = causal.
        """

    @abstractmethod
    def gather_prefix(self, kv_cache: torch.Tensor, slots: torch.Tensor
                      ) -> tuple[torch.Tensor, ...]:
        """The cache rows of `slots` [B, L] (the sequences' paged prefixes), in the layout
        `draft_level` attends."""

    @abstractmethod
    def draft_level(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    prefix: tuple[torch.Tensor, ...], scratch: list[tuple[torch.Tensor, ...]],
                    mask: torch.Tensor) -> torch.Tensor:
        """One level of tree drafting: the level's K nodes per sequence (embeds, hidden
        [B, K, H] at positions [B, K]) attend the gathered prefix and every node so far;
        this level's keys are appended to `scratch` (one entry per level, none of them in
        the paged cache). mask: bool [B, K, L + levels * K] over [prefix ‖ scratch], this
        level included. Returns the nodes' fed-back states [B, K, H]."""

    @abstractmethod
    def place_rope(self, device: torch.device) -> None:
        """Compute the rope tables (float32, not parameters) on `device`: after a
        meta-device build they hold no values."""

    # --- weights ---

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str,
                     target_embed_weight: torch.Tensor | None = None) -> None:
        """Load published tensors (names as in the checkpoint) into this head, checked:
        workers/spec/head_weights.py (ValueError naming `source` and the tensor)."""
        load_head_weights(self, tensors, source, target_embed_weight)
