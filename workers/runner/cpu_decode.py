"""Decode and verify steps on the CPU as one compiled function (torch.compile, inductor).

On the CPU a small-batch decode step of the fixture is a few milliseconds of GEMMs and as
much again of per-op overhead: ~40 small ops per layer, each paying the dispatcher and the
Python around it. Compiling the whole step (every layer) fuses the element-wise work
(norms, rotary, SiLU, residuals, softmax) into a few generated C++ loops; for bfloat16
weights inductor's freezing packs them for oneDNN itself. `--cpu-compile` turns it on (off
by default: the warm-up compiles for minutes on two cores; inductor caches the unfrozen
float32 graphs on disk, so a later start of the same code compiles in well under a minute).

Contract of the compiled function (`_decode`): input ids and positions [G, T] (T = 1 for
plain decode, the drafts + 1 for verification); the sequences' K/V histories, a list of
layer 0's K, layer 0's V, layer 1's K, ..., each [G, kv_heads, W, d] and contiguous
(decode: rows [0, G) of the kept copy of decode_stage.DecodeStage, W its capacity, the
step's rows permuted into the copy's row order; verify: gathered from the paged cache),
hist_ok [G, W] (True at positions before this step's tokens) and new_ok [G, T, T] (row i
sees this step's key j: causal, or the draft tree's ancestors). It reads no cache and
writes nothing: attention is over the history plus the step's own keys, and the new K/V
come back [L, G * T, kv_heads, d] for the caller to store in the paged cache (and append to
the kept copy). G and W are marked dynamic, so
one compilation serves every batch size >= 2 and every length; batch size 1 and each T
compile apart (decode and verify at batch 1 and above: four compilations, all in the
warm-up).

A compilation that fails is not swallowed: one ERROR record with the traceback, then every
step runs eagerly and `status` says why.

With a `BackgroundCompiles` (`--cpu-compile-background`, cpu_compile_thread.py) a kind's
first step runs eagerly and hands a copy of its inputs to the compile thread; its steps run
compiled once that kind is compiled (the four kinds: `KINDS`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from specd.logs import one_line
from specd.workers.models.decoder import DecoderForCausalLM
from specd.workers.runner.attention import AttentionMetadata, store_kv
from specd.workers.runner.cpu_compile_thread import BackgroundCompiles

log = logging.getLogger("specd.cpu_decode")

# The compiled step kinds: batch 1 compiles apart from batches of 2 and more (dynamic).
KINDS = ("decode, batch 1", "decode, batch 2+", "verify, batch 1", "verify, batch 2+")


def step_kind(num_seqs: int, num_query_rows: int) -> str:
    """The compiled kind of a step of `num_seqs` sequences of `num_query_rows` rows each."""
    return KINDS[(0 if num_query_rows == 1 else 2) + (num_seqs > 1)]


def attend_history_and_new(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                           k_hist: torch.Tensor, v_hist: torch.Tensor, hist_ok: torch.Tensor,
                           new_ok: torch.Tensor, scale: float) -> torch.Tensor:
    """T query rows per sequence over its history and the step's own T keys.

    q [G * T, heads, d] and k_new, v_new [G * T, kvh, d], sequence by sequence; k_hist,
    v_hist [G, kvh, W, d]; hist_ok bool [G, W]; new_ok bool [G, T, T]: row i may see the
    step's key j (causal, or a draft tree's ancestors) -> [G * T, heads, d] in q's dtype.
    Head h reads KV head h // (heads / kvh) (transformers' repeat_kv); the softmax and the
    merge are float32.
    """
    g, t = new_ok.shape[:2]
    heads, d = q.shape[1:]
    kvh = k_new.shape[1]
    grp = heads // kvh
    # Query rows of a KV head: [G, kvh, T * grp, d], row t * grp + j = token t, head j.
    qg = q.view(g, t, kvh, grp, d).permute(0, 2, 1, 3, 4).reshape(g, kvh, t * grp, d)
    kn = k_new.view(g, t, kvh, d).permute(0, 2, 1, 3).float()  # [G, kvh, T, d]
    vn = v_new.view(g, t, kvh, d).permute(0, 2, 1, 3).float()
    seen = new_ok[:, None, :, None, :].expand(g, 1, t, grp, t).reshape(g, 1, t * grp, t)
    s_new = torch.einsum("gkqd,gktd->gkqt", qg.float(), kn) * scale
    s_new = s_new.masked_fill(~seen, float("-inf"))  # [G, kvh, T * grp, T]
    if g == 1:
        # One sequence: ATen's CPU flash attention over the history (it also returns the
        # log-sum-exp), merged with the new keys by weight; measured fastest at batch 1.
        # A row with no history gets whatever the kernel makes of it, at weight 0.
        bias = torch.zeros(hist_ok.shape, dtype=q.dtype).masked_fill(~hist_ok, float("-inf"))
        o_hist, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k_hist, v_hist, 0.0, False, attn_mask=bias[:, None, None, :], scale=scale)[:2]
        lse = torch.where(hist_ok.any(dim=-1)[:, None, None], lse, float("-inf"))
        top = torch.maximum(lse, s_new.amax(dim=-1))  # finite: a row sees its own key
        w_hist, w_new = torch.exp(lse - top), torch.exp(s_new - top[..., None])
        out = ((o_hist.float().nan_to_num(0.0) * w_hist[..., None]
                + torch.einsum("gkqt,gktd->gkqd", w_new, vn))
               / (w_hist + w_new.sum(dim=-1))[..., None])
    else:
        # A batch: batched matmuls (4x faster than the flash kernel at 64 sequences of 2
        # query rows each); the history stays in its dtype.
        s_hist = torch.einsum("gkqd,gkwd->gkqw", qg, k_hist).float() * scale  # [G,kvh,Q,W]
        s_hist = s_hist.masked_fill(~hist_ok[:, None, None, :], float("-inf"))
        p = torch.softmax(torch.cat([s_hist, s_new], dim=-1), dim=-1)
        width = k_hist.shape[2]
        out = (torch.einsum("gkqw,gkwd->gkqd", p[..., :width].to(v_hist.dtype), v_hist).float()
               + torch.einsum("gkqt,gktd->gkqd", p[..., width:], vn))
    return (out.view(g, kvh, t, grp, d).permute(0, 2, 1, 3, 4).reshape(g * t, heads, d)
            .to(q.dtype))


def report_compile_failure(logger: logging.Logger, message: str, exc: Exception) -> str:
    """Log a failed compilation once, as one ERROR record with the reason and traceback
    (event `cpu_compile_failed`; call from the except block); returns the reason for status."""
    reason = one_line(f"compilation failed: {type(exc).__name__}: {exc}")
    # The traceback comes with exc_info, once (an extra field would print it again).
    logger.error(message, exc_info=True, extra={"event": "cpu_compile_failed", "reason": reason})
    return reason


def _mark_dynamic(input_ids: torch.Tensor, positions: torch.Tensor, hist: list[torch.Tensor],
                  hist_ok: torch.Tensor, new_ok: torch.Tensor) -> None:
    """Batch size G (unless 1: dynamo compiles size 1 apart anyway) and history width W."""
    if input_ids.shape[0] > 1:
        batch_dims = ((input_ids, 0), (positions, 0), (hist_ok, 0), (new_ok, 0),
                      *((h, 0) for h in hist))  # hist: every layer's K and V
        for t, dim in batch_dims:
            torch._dynamo.mark_dynamic(t, dim)
    for t, dim in ((hist_ok, 1), *((h, 2) for h in hist)):
        torch._dynamo.mark_dynamic(t, dim)


class CompiledDecode:
    """The compiled plain-decode step of `model` (CPU), driven by the runner's DecodeStage."""

    def __init__(self, model: DecoderForCausalLM, capture_layers: Sequence[int],
                 verify_len: int | None = None,
                 background: BackgroundCompiles | None = None) -> None:
        self.model = model
        self.background = background  # None: a kind compiles at its first call, in place
        # Only verify steps of this many rows per sequence are compiled: drafts cut short
        # (near max_tokens) would each compile a new T in the middle of serving.
        self.verify_len = verify_len
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
        # Freezing (weights as constants, packed for oneDNN) only for bfloat16 weights,
        # where the packing is what pays. Inductor's on-disk graph cache skips graphs with
        # frozen constants, so a frozen float32 step compiled again at every start (fixture,
        # plain decode, this VM: 211 s to a warm start frozen, 45 s not; 8.1 vs 7.9 ms a step).
        self.freeze = next(model.parameters()).dtype == torch.bfloat16
        self.error: str | None = None  # why it fell back to eager, for status
        self.num_steps = 0  # compiled decode steps
        self.num_row_order_steps = 0  # of which ran in the kept copy's row order
        self.num_verify_steps = 0

    def applies(self, meta: AttentionMetadata) -> bool:
        """A step of one group of equal query lengths: plain decode with a kept K/V plan,
        or a verify step of `verify_len` rows per sequence (causal or tree-masked)."""
        if self.error is not None or len(meta.groups) != 1 or not meta.groups[0].is_all_rows:
            return False
        group = meta.groups[0]
        if group.num_query_rows == 1:
            return group.stage_plan is not None
        return group.stage_plan is None and group.num_query_rows == self.verify_len

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_caches: Sequence[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(hidden, aux) of the step, its K/V stored in the cache (and the kept copy, for
        decode); None if compilation failed (logged; the caller runs the step eagerly, and
        every later one) or, in the background, this kind is not compiled yet (the caller
        runs this step eagerly)."""
        group = meta.groups[0]
        g, t = group.num_seqs, group.num_query_rows
        kind = step_kind(g, t)
        background = self.background
        if (background is not None and background.is_submitted(kind)
                and not background.is_ready(kind)):
            return None  # compiling: eager until it is done
        plan = group.stage_plan
        ids, pos = input_ids.view(g, t), positions.view(g, t)
        if plan is not None:
            # Whole kept copies, not [:width] slices: a slice is contiguous only when it is
            # full, and dynamo would compile that case apart. The mask hides the headroom.
            copies = [plan.stage.history(kv, group.key_blocks, plan) for kv in kv_caches]
            hist = [half[:g] for copy in copies for half in copy]  # K, V per layer
            hist_len = plan.new_positions  # [G]: history positions before the new token
            new_ok = torch.ones(g, 1, 1, dtype=torch.bool)
            if not plan.is_identity:  # the step runs in the copy's row order
                ids, pos, hist_len = ids[plan.order], pos[plan.order], hist_len[plan.order]
        else:
            hist = [half for kv in kv_caches for half in _gather(kv, group.key_blocks, g)]
            hist_len = meta.seq_lens.long() - t
            new_ok = _new_rows_mask(meta.tree_mask, g, t)
        hist_ok = torch.arange(hist[0].shape[2])[None, :] < hist_len[:, None]  # [G, W]
        if background is not None and not background.is_ready(kind):
            self._submit(background, kind, ids, pos, hist, hist_ok, new_ok)
            return None
        _mark_dynamic(ids, pos, hist, hist_ok, new_ok)
        try:
            # Freezing is read when a call compiles.
            with torch._inductor.config.patch(freezing=self.freeze):
                hidden, aux, k_new, v_new = self._compiled(ids, pos, hist, hist_ok, new_ok)
        except Exception as exc:  # noqa: BLE001 - reported here, then eager by design
            self.error = report_compile_failure(log, "compiled CPU decode failed; steps run "
                                                "eagerly", exc)
            # A kept copy is still valid for the eager step: `history` changed it only on
            # refresh, which the eager step repeats (after writing its token).
            return None
        if plan is not None and not plan.is_identity:  # back to batch order
            back = plan.row_of
            hidden, k_new, v_new = hidden[back], k_new[:, back], v_new[:, back]
            aux = None if aux is None else aux[back]
        for layer, kv in enumerate(kv_caches):
            store_kv(k_new[layer], v_new[layer], kv, meta.slot_mapping)
            if plan is not None:
                plan.stage.append(kv, plan, k_new[layer], v_new[layer])
        if t == 1:
            self.num_steps += 1
            self.num_row_order_steps += plan is not None and not plan.is_identity
        else:
            self.num_verify_steps += 1
        return hidden, aux

    def _submit(self, background: BackgroundCompiles, kind: str, ids: torch.Tensor,
                pos: torch.Tensor, hist: list[torch.Tensor], hist_ok: torch.Tensor,
                new_ok: torch.Tensor) -> None:
        """Compile `kind` on the compile thread, on copies of this step's inputs (the kept
        K/V copy and the cache change under it; `_decode` writes nothing)."""
        args = (ids.clone(), pos.clone(), [h.clone() for h in hist], hist_ok.clone(),
                new_ok.clone())

        def compile_kind() -> None:
            _mark_dynamic(*args)
            with torch._inductor.config.patch(freezing=self.freeze):
                self._compiled(*args)

        def failed(exc: Exception) -> None:
            self.error = report_compile_failure(log, "compiled CPU decode failed; steps run "
                                                "eagerly", exc)

        background.submit(kind, compile_kind, failed)

    def status(self) -> str:
        """What is compiled (a fact of start-up: the daemon reports it once, at readiness;
        the step counters are for tests and profiling)."""
        if self.error is not None:
            return f"cpu compiled decode off ({self.error})"
        verify = "" if self.verify_len is None else f", verify of {self.verify_len} rows"
        return f"cpu compiled decode (decode{verify})"

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hist: list[torch.Tensor], hist_ok: torch.Tensor, new_ok: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """See the module docstring: input ids and positions [G, T] -> (hidden [G * T, H],
        aux or None, k_new, v_new [L, G * T, kvh, d])."""
        m = self.model
        h = m.model.embed_tokens(input_ids.reshape(-1))
        cos_sin = m.rotary.cos_sin(positions.reshape(-1), h.dtype)
        captured = [h] if self._capture_embeddings else []
        keys, values = [], []
        for i, layer in enumerate(m.model.layers):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(h), cos_sin)
            keys.append(k)
            values.append(v)
            out = attend_history_and_new(q, k, v, hist[2 * i], hist[2 * i + 1], hist_ok,
                                         new_ok, attn.scale)
            # Row-parallel o_proj and down_proj under tensor parallelism: the all-reduces
            # are inside the compiled step (nothing at size 1), as in DecoderLayer.forward.
            h = h + layer.par.all_reduce(attn.o_proj(out.reshape(h.shape[0], -1)))
            h = h + layer.par.all_reduce(layer.mlp(layer.post_attention_layernorm(h)))
            if self._capture_after[i]:
                captured.append(h)
        aux = torch.cat(captured, dim=-1) if self.capture_layers else None
        return m.model.norm(h), aux, torch.stack(keys), torch.stack(values)


def _gather(kv_cache_layer: torch.Tensor, key_blocks: torch.Tensor, num_seqs: int
            ) -> torch.Tensor:
    """[2, G, kv_heads, W, d]: each sequence's blocks (key_blocks [G * mb]) in order."""
    num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
    blocks = kv_cache_layer.index_select(1, key_blocks)  # [2, G * mb, bs, kvh, d]
    return blocks.view(2, num_seqs, -1, num_kv_heads, head_dim).transpose(2, 3).contiguous()


def _new_rows_mask(tree_mask: torch.Tensor | None, num_seqs: int, t: int) -> torch.Tensor:
    """bool [G, T, T]: row i sees the step's key j (bit j of the tree mask; causal without)."""
    if tree_mask is None:
        return torch.ones(t, t, dtype=torch.bool).tril().expand(num_seqs, t, t).contiguous()
    bits = tree_mask.view(num_seqs, t)[:, :, None] >> torch.arange(t)
    return (bits & 1).bool()
