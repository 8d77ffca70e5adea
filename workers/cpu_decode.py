"""Plain decode on the CPU as one compiled function (torch.compile, inductor, frozen weights).

On the CPU a small-batch decode step of the fixture is a few milliseconds of GEMMs and as
much again of per-op overhead: ~40 small ops per layer, each paying the dispatcher and the
Python around it. Compiling the whole step (every layer) fuses the element-wise work
(norms, rotary, SiLU, residuals, softmax) into a few generated C++ loops, and inductor's
freezing packs the weights for oneDNN itself. `--cpu-compile` turns it on (off by default:
the first step of each batch-size class compiles for 20-40 s on two cores; the compiled
code is cached on disk by inductor and reused by later processes).

Contract of the compiled function (`_decode`): input ids and positions [G]; per layer the
kept K/V copy [2, G, kv_heads, W, d] of the decode group (decode_stage.DecodeStage, W its
capacity; position S - 1 of each sequence and everything after it stale) and hist_ok
[G, W] (True at positions < S - 1).
It reads no cache and writes nothing: attention is over the history plus the step's own
token (two score blocks, one softmax), and the new K/V come back [L, G, kv_heads, d] for
the caller to store in the paged cache and append to the kept copy. Shapes are dynamic
(G and W are marked dynamic), so one compilation serves every batch size >= 2 and every
length; batch size 1 is a second compilation.

A compilation that fails is not swallowed: one ERROR record with the traceback, then every
step runs eagerly and `status` says why.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence

import torch

from specd.workers.attention import AttentionMetadata, store_kv
from specd.workers.decode_stage import DecodeStage
from specd.workers.models.decoder import DecoderForCausalLM

log = logging.getLogger("specd.cpu_decode")


def attend_history_and_new(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                           k_hist: torch.Tensor, v_hist: torch.Tensor, hist_ok: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query row per sequence over its history and its own new key.

    q [G, heads, d]; k_new, v_new [G, kvh, d]; k_hist, v_hist [G, kvh, W, d]; hist_ok [G, W]
    -> [G, heads, d] in q's dtype. Head h reads KV head h // (heads / kvh) (transformers'
    repeat_kv); the merge is in float32.
    """
    g, heads, d = q.shape
    kvh = k_new.shape[1]
    qg = q.view(g, kvh, heads // kvh, d)  # [G, kvh, grp, d]: a KV head's queries
    s_new = (qg.float() * k_new.float()[:, :, None]).sum(-1) * scale  # [G, kvh, grp]
    if g == 1:
        # One sequence: ATen's CPU flash attention over the history (it also returns the
        # log-sum-exp), merged with the new key by weight; measured fastest at batch 1.
        # A row with no history gets whatever the kernel makes of it, at weight 0.
        bias = torch.zeros(hist_ok.shape, dtype=q.dtype).masked_fill(~hist_ok, float("-inf"))
        o_hist, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k_hist, v_hist, 0.0, False, attn_mask=bias[:, None, None, :], scale=scale)[:2]
        lse = torch.where(hist_ok.any(dim=-1)[:, None, None], lse, float("-inf"))
        top = torch.maximum(lse, s_new)
        w_hist, w_new = torch.exp(lse - top), torch.exp(s_new - top)
        out = ((o_hist.float().nan_to_num(0.0) * w_hist[..., None]
                + v_new.float()[:, :, None] * w_new[..., None]) / (w_hist + w_new)[..., None])
    else:
        # A batch: two batched matmuls (4x faster than the flash kernel at 64 sequences of
        # 2 query rows each); the history stays in its dtype, the softmax is float32.
        s_hist = torch.einsum("gkqd,gkwd->gkqw", qg, k_hist).float() * scale  # [G,kvh,grp,W]
        s_hist = s_hist.masked_fill(~hist_ok[:, None, None, :], float("-inf"))
        p = torch.softmax(torch.cat([s_hist, s_new[..., None]], dim=-1), dim=-1)
        out = (torch.einsum("gkqw,gkwd->gkqd", p[..., :-1].to(v_hist.dtype), v_hist).float()
               + p[..., -1:] * v_new.float()[:, :, None])
    return out.reshape(g, heads, d).to(q.dtype)


def _mark_dynamic(input_ids: torch.Tensor, positions: torch.Tensor, hist: list[torch.Tensor],
                  hist_ok: torch.Tensor) -> None:
    """Batch size G (unless 1: dynamo compiles size 1 apart anyway) and history width W."""
    if input_ids.shape[0] > 1:
        for t, dim in ((input_ids, 0), (positions, 0), (hist_ok, 0), *((h, 1) for h in hist)):
            torch._dynamo.mark_dynamic(t, dim)
    for t, dim in ((hist_ok, 1), *((h, 3) for h in hist)):
        torch._dynamo.mark_dynamic(t, dim)


class CompiledDecode:
    """The compiled plain-decode step of `model` (CPU), driven by the runner's DecodeStage."""

    def __init__(self, model: DecoderForCausalLM, capture_layers: Sequence[int]) -> None:
        self.model = model
        self.capture_layers = tuple(capture_layers)
        # capture_after[i]: keep the residual after block i (layer i + 1 in transformers'
        # numbering), as plain booleans the compiled code reads as constants.
        self._capture_embeddings = 0 in self.capture_layers
        self._capture_after = tuple(i + 1 in self.capture_layers
                                    for i in range(len(model.model.layers)))
        # Guards on the model's modules would cost ~0.5 ms per call; the model never changes
        # after load, so they are skipped (the inputs' shapes and dtypes are still guarded).
        # Only the batch and history dims are dynamic (marked per call): with every dim
        # symbolic, duck sizing would tie a batch of 2 to the 2 KV heads and pin it.
        self._compiled = torch.compile(
            self._decode, dynamic=None,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.error: str | None = None  # why it fell back to eager, for status
        self.num_steps = 0

    def applies(self, meta: AttentionMetadata) -> bool:
        """A plain decode step whose one group has a kept K/V plan."""
        return (self.error is None and len(meta.groups) == 1 and meta.groups[0].is_all_rows
                and meta.groups[0].num_query_rows == 1 and meta.groups[0].stage_plan is not None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: Sequence[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(hidden, aux) of the step, its K/V stored in the cache and the kept copy; None
        if compilation failed (logged; the caller runs the step eagerly, and every later
        one)."""
        group = meta.groups[0]
        plan = group.stage_plan
        if plan is None:
            raise ValueError("CompiledDecode.run needs a decode group with a stage plan")
        stage: DecodeStage = plan.stage
        # Whole kept copies, not [:width] slices: a slice is contiguous only when it is full,
        # and dynamo would compile that case apart. The mask hides the headroom.
        hist = [stage.history(kv, group.key_blocks, plan) for kv in kv_caches]
        width = hist[0].shape[3]
        hist_ok = (torch.arange(width)[None, :] < plan.new_positions[:, None])  # [G, W]
        _mark_dynamic(input_ids, positions, hist, hist_ok)
        try:
            # Freezing (weights as constants, packed for oneDNN) is read when a call compiles.
            with torch._inductor.config.patch(freezing=True):
                hidden, aux, k_new, v_new = self._compiled(input_ids, positions, hist, hist_ok)
        except Exception as exc:  # noqa: BLE001 - reported here, then eager by design
            self.error = f"compilation failed: {type(exc).__name__}: {str(exc)[:200]}"
            log.error("compiled CPU decode failed; decode runs eagerly", exc_info=True,
                      extra={"event": "cpu_compile_failed", "reason": self.error,
                             "traceback": traceback.format_exc()})
            # The kept copy is still valid for the eager step: `history` changed it only on
            # refresh, which the eager step repeats (after writing its token).
            return None
        for layer, kv in enumerate(kv_caches):
            store_kv(k_new[layer], v_new[layer], kv, meta.slot_mapping)
            stage.append(kv, plan, k_new[layer], v_new[layer])
        self.num_steps += 1
        return hidden, aux

    def status(self) -> str:
        if self.error is not None:
            return f"cpu compiled decode off ({self.error})"
        return f"cpu compiled decode ({self.num_steps} steps)"

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hist: list[torch.Tensor], hist_ok: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """See the module docstring: (hidden [G, H], aux or None, k_new, v_new [L, G, kvh, d])."""
        m = self.model
        h = m.model.embed_tokens(input_ids)
        cos_sin = m.rotary.cos_sin(positions, h.dtype)
        captured = [h] if self._capture_embeddings else []
        keys, values = [], []
        for i, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(h), cos_sin)
            keys.append(k)
            values.append(v)
            out = attend_history_and_new(q, k, v, hist[i][0], hist[i][1], hist_ok, attn.scale)
            h = h + attn.o_proj(out.reshape(h.shape[0], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if self._capture_after[i]:
                captured.append(h)
        aux = torch.cat(captured, dim=-1) if self.capture_layers else None
        return m.model.norm(h), aux, torch.stack(keys), torch.stack(values)
