"""The EAGLE-3 head with a DeepSeek MLA layer: `Eagle3DeepseekV2ForCausalLM`, as SGLang and
vLLM serve it and TorchSpec trains it (Kimi-K2.x heads whose draft cache is the target's
latent layout).

The layer is the Llama head's (workers/spec/draft_head.py: norms, MLP, residual, fc, lm_head)
with multi-head latent attention over the 2H-wide input `cat(input_layernorm(embeds),
hidden_norm(hidden))`: `q_a_proj` (or `q_proj`) and `kv_a_proj_with_mqa` read 2H, the rest is
the target's MLA (`MlaAttention` of workers/models/deepseek_v3.py, built through its public
constructor: its linear factory widens those two inputs). Where the published readers of
these heads differ from the target's transformers code, the head follows them: the latent
norms (`q_a_layernorm`, `kv_a_layernorm`) use the config's rms_norm_eps (SGLang's and vLLM's
DeepseekV2 attention, TorchSpec's trainer) rather than transformers' 1e-6; rope is always
interleaved (draft_config refuses `rope_interleave: false`).

The head's cache is one latent row per token, [num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim] = [kv_a_layernorm(c_kv) ‖ rope(k_pe)] (`DraftConfig.kv_layer_shape`). The
paged forward is `MlaAttention.forward` itself, through the latent backend of its device
(workers/runner/attention_backend.py's LATENT); the dense forwards and the draft levels
attend gathered latents the absorbed way (`MlaAttention.absorb`: q_nope·W_UK as the latent
query, the latents as keys and values, `unabsorb`: ·W_UV per head), the arithmetic of the
absorbed paged path.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from specd.workers.models.deepseek_v3 import MlaAttention
from specd.workers.models.layers import RotaryEmbedding
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.attention_backend import LATENT
from specd.workers.spec.draft_config import DraftConfig
from specd.workers.spec.draft_head import Eagle3Head

# The MLA projections that read the layer's input, 2H wide in an EAGLE-3 layer.
WIDE_INPUTS = ("q_a_proj", "q_proj", "kv_a_proj_with_mqa")


def _draft_linear(in_features: int, out_features: int, bias: bool,
                  names: tuple[str, ...]) -> nn.Module:
    """MlaAttention's linear factory for a draft layer: the projections of the layer's input
    read [input_layernorm(embeds) ‖ hidden_norm(hidden)], twice the hidden size."""
    wide = names[0].rpartition(".")[2] in WIDE_INPUTS
    return nn.Linear(2 * in_features if wide else in_features, out_features, bias=bias)


class MlaDraftHead(Eagle3Head):
    """An EAGLE-3 head with an MLA layer (module docstring); `config.mla_layer` describes it.
    Build with `load_draft_head`; `device`: where its paged attention runs (the latent
    backend is chosen from it) and its rope tables live."""

    def __init__(self, config: DraftConfig, device: torch.device) -> None:
        mla_cfg = config.mla_layer
        if mla_cfg is None or mla_cfg.mla is None:
            raise ValueError("MlaDraftHead needs a DraftConfig with an mla_layer")
        attn = MlaAttention(mla_cfg, "midlayer.self_attn", _draft_linear,
                            LATENT.attention(device))
        # The heads' readers and trainer normalise the latents with rms_norm_eps.
        attn.kv_a_layernorm.eps = mla_cfg.rms_norm_eps
        if attn.has_q_lora:
            attn.q_a_layernorm.eps = mla_cfg.rms_norm_eps
        super().__init__(config, attn)
        self.mla_config = mla_cfg
        self.rotary = RotaryEmbedding(attn.rope, mla_cfg.rope_theta, mla_cfg.rope_scaling,
                                      device)

    @property
    def attn(self) -> MlaAttention:
        """The layer's attention (`midlayer.self_attn`, an MlaAttention by construction)."""
        return cast(MlaAttention, self.midlayer.self_attn)

    def place_rope(self, device: torch.device) -> None:
        cfg = self.mla_config
        self.rotary = RotaryEmbedding(self.attn.rope, cfg.rope_theta, cfg.rope_scaling, device)

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str,
                     target_embed_weight: torch.Tensor | None = None) -> None:
        """Load and check the published tensors, then split kv_b_proj into W_UK and W_UV."""
        super().load_weights(tensors, source, target_embed_weight)
        with torch.no_grad():
            self.attn.process_weights_after_loading()

    # --- the three ways ---

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                hidden: torch.Tensor, kv_cache: torch.Tensor | None = None,
                meta: AttentionMetadata | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention_input(self.embed(input_ids, embeds), hidden)  # [N, 2H]
        if kv_cache is None:
            if meta is not None:
                raise ValueError("MlaDraftHead.forward: attention metadata given without a "
                                 "kv_cache")
            n = x.shape[0]
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            return self.forward_dense_input(x[None], hidden[None], positions[None],
                                            causal[None])[0]
        if meta is None:
            raise ValueError("MlaDraftHead.forward: a kv_cache needs this step's attention "
                             "metadata")
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        return self.after_attention(self.attn(x, cos_sin, kv_cache, meta), hidden)

    def forward_dense(self, embeds: torch.Tensor, hidden: torch.Tensor,
                      positions: torch.Tensor, mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
        t = embeds.shape[-2]
        if mask is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=embeds.device).tril()
        batch_mask = mask if mask.dim() == 3 else mask.expand(embeds.shape[0], t, t)
        return self.forward_dense_input(self.attention_input(embeds, hidden), hidden,
                                        positions, batch_mask)

    def forward_dense_input(self, x: torch.Tensor, hidden: torch.Tensor,
                            positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, 2H] (the attention's input), mask bool [B, T, T] -> [B, T, H]."""
        q_nope, q_pe, latent = self._project(x, positions)
        return self.after_attention(self._attend(q_nope, q_pe, latent, mask), hidden)

    def gather_prefix(self, kv_cache: torch.Tensor, slots: torch.Tensor
                      ) -> tuple[torch.Tensor, ...]:
        """(the prefixes' latent rows [B, L, kv_lora_rank + qk_rope_head_dim],)"""
        return (kv_cache.view(-1, kv_cache.shape[-1])[slots],)

    def draft_level(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    prefix: tuple[torch.Tensor, ...], scratch: list[tuple[torch.Tensor, ...]],
                    mask: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, latent = self._project(self.attention_input(embeds, hidden), positions)
        scratch.append((latent,))
        latents = torch.cat([prefix[0], *(s[0] for s in scratch)], dim=1)  # [B, L + n*K, R+P]
        return self.after_attention(self._attend(q_nope, q_pe, latents, mask), hidden)

    # --- MLA arithmetic on gathered latents ---

    def _project(self, x: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, 2H], positions [B, T] -> q_nope [B, T, heads, nope], roped q_pe
        [B, T, heads, rope] and the latent rows [B, T, R + rope] = [kv_a_layernorm(c) ‖
        rope(k_pe)], as MlaAttention.forward computes them."""
        attn = self.attn
        b, t = x.shape[:2]
        rows = x.reshape(b * t, -1)
        q = (attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(rows))) if attn.has_q_lora
             else attn.q_proj(rows))
        q_nope, q_pe = q.view(b * t, attn.num_heads, -1).split([attn.nope, attn.rope], dim=-1)
        c, k_pe = attn.kv_a_proj_with_mqa(rows).split([attn.rank, attn.rope], dim=-1)
        cos_sin = self.rotary.cos_sin(positions.reshape(-1), x.dtype)
        q_pe = attn.rotate(q_pe, *cos_sin)
        k_pe = attn.rotate(k_pe[:, None, :], *cos_sin)[:, 0]
        latent = torch.cat((attn.kv_a_layernorm(c), k_pe), dim=-1)
        return (q_nope.view(b, t, attn.num_heads, -1), q_pe.view(b, t, attn.num_heads, -1),
                latent.view(b, t, -1))

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Absorbed attention of q_nope [B, T, heads, nope] and q_pe [B, T, heads, rope]
        over latents [B, S, R + rope] under mask bool [B, T, S] -> o_proj output [B, T, H]."""
        attn = self.attn
        b, t, heads, nope = q_nope.shape
        q_latent = attn.absorb(q_nope.reshape(b * t, heads, nope)).view(b, t, heads, -1)
        q = torch.cat((q_latent, q_pe), dim=-1).transpose(1, 2)  # [B, heads, T, R + rope]
        keys = latents[:, None]  # [B, 1, S, R + rope]: one latent head for all query heads
        out = F.scaled_dot_product_attention(q, keys, keys[..., :attn.rank],
                                             attn_mask=mask[:, None], scale=attn.scale,
                                             enable_gqa=True)  # [B, heads, T, R]
        values = attn.unabsorb(out.transpose(1, 2).reshape(b * t, heads, -1))  # [BT, heads, v]
        return attn.o_proj(values.reshape(b, t, heads * attn.v_dim))

