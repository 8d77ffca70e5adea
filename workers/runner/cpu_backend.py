"""The CPU backend: every CPU-specific execution path behind the `Backend` interface.

* Packed linears (layers.PackedLinear): bfloat16 linears get oneDNN's weight layout once,
  at construction, instead of per call, where the CPU runs oneDNN's bf16 GEMM (AVX-512 or
  avx_ne_convert); elsewhere they stay `nn.Linear`, and `linears_status` says why. float32
  linears run on the kernel measured fastest on this machine at load, or the one
  `--cpu-linear` names (cpu_linears.py): MKL's sgemm, oneDNN's packed GEMM, or `mm` on a
  transposed weight; with `--cpu-compile` not oneDNN's, which compiled steps cannot lower,
  so that the eager steps beside them (a fallback, the background compilation's first
  steps) compute the same GEMMs and greedy output does not depend on the path a step took.
* Kept decode K/V (decode_stage.py): plain decode attends over a copy of the decode
  group's K/V kept from one step to the next, so a step does not re-gather every history.
* With `--cpu-compile`: decode and verify steps as one compiled function (cpu_decode.py);
  a plain step that mixes one-token rows with a prefill is split into the compiled decode
  and an eager forward of the rest, merged back into the batch's row layout; the draft
  loop compiled too (cpu_draft.py). A compilation that fails is logged once and the steps
  run eagerly (status says why). With `--cpu-compile-background` each kind compiles on a
  thread of its own from a copy of its first step's inputs (cpu_compile_thread.py) while
  the eager path serves; until every submitted kind is compiled the fallback
  `cpu_compile_pending` names those still compiling.

Under tensor parallelism every rank holds this backend over its shard: rank 0 plans each
step's kept K/V, and the other ranks apply its plans to their own copies (`adopt`); the
compiled decode has the all-reduces inside.

The kept K/V and the compiled decode read per-head K and V: they serve the dense decoder.
A model with a latent cache (MLA, deepseek_v3.py) gathers its latent rows from the cache in
every step, so for it neither exists; `--cpu-compile` then compiles the draft loop only,
and says so once at start-up (an ERROR record and status).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import torch

from specd.workers.engine.batch import ScheduledBatch
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.models.decoder import DecoderForCausalLM
from specd.workers.models.layers import bf16_packing_unsupported, can_pack, prepare_cpu_linears
from specd.workers.models.registry import CausalLM
from specd.workers.parallel.peers import NO_PEERS, Peers
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.backend import (
    Backend,
    DraftLoop,
    DraftLoopRunner,
    DraftLoopShape,
    EagerDraftLoop,
    Fallback,
    InputIds,
    Outputs,
    StepForward,
    follower_inputs,
)
from specd.workers.runner.cpu_compile_thread import BackgroundCompiles
from specd.workers.runner.cpu_decode import CompiledDecode
from specd.workers.runner.cpu_draft import CompiledDraftLoop
from specd.workers.runner.cpu_linears import choose_float32_kernel
from specd.workers.runner.decode_stage import DecodeStage
from specd.workers.runner.step_inputs import StepInputs, prepare_inputs

log = logging.getLogger("specd.cpu_backend")


class CpuBackend(Backend):
    """The CPU paths (see module docstring). compile: `--cpu-compile`; verify_len: the rows
    per sequence of the speculative worker's verify steps (compiled beside decode), or
    None without a head; tensor_parallel: this rank is one of several. `stage` (the kept
    decode K/V) is None for a latent-cache model."""

    def __init__(self, model: CausalLM, capture_layers: Sequence[int],
                 kv_caches: list[torch.Tensor], block_size: int, compile: bool,
                 verify_len: int | None, peers: Peers = NO_PEERS,
                 compile_in_background: bool = False, linear_kernel: str = "auto",
                 tensor_parallel: bool = False) -> None:
        super().__init__(model, capture_layers, kv_caches, block_size, peers)
        # The compile thread (`--cpu-compile-background`), None when kinds compile in place.
        self.background = BackgroundCompiles() if compile and compile_in_background else None
        self.compiles = compile
        self.model_dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
        # The float32 linears' kernel, measured here unless named (cpu_linears.py).
        self.linear_choice = choose_float32_kernel(model, linear_kernel, compile,
                                                   tensor_parallel)
        self.num_packed_linears = self._pack_linears(model)
        self.unpacked_reason = _unpacked_reason(model)
        if self.unpacked_reason:
            log.warning("bfloat16 linears not packed for oneDNN: %s", self.unpacked_reason,
                        extra={"event": "cpu_linears_unpacked", "reason": self.unpacked_reason})
        # The dense-K/V paths: for the dense decoder only (module docstring).
        dense = model if isinstance(model, DecoderForCausalLM) else None
        self.stage = DecodeStage(block_size) if dense is not None else None
        self.compiled_decode = (CompiledDecode(dense, self.capture_layers, verify_len,
                                               self.background)
                                if compile and dense is not None else None)
        self.no_compiled_decode = ""  # why --cpu-compile compiles no decode, for status
        if compile and dense is None:
            self.no_compiled_decode = (f"{type(model).__name__} has a latent KV cache; the "
                                       "compiled decode reads dense K/V")
            log.error("compiled CPU decode unavailable; decode and verify run eagerly, the "
                      "draft loop is compiled", extra={"event": "cpu_compile_unavailable",
                                                       "reason": self.no_compiled_decode})
        self.num_split_steps = 0  # plain steps run as compiled decode + the rest (figures)

    def forward_step(self, batch: ScheduledBatch, input_ids: InputIds) -> StepForward:
        """A plain step: the decode group over the kept K/V (compiled when it can be), split
        from the rest of the batch when the step mixes both (see `_split`)."""
        parts = self._split(batch)
        if parts is not None:
            return self._forward_parts(batch, input_ids, *parts)
        inputs = prepare_inputs(batch, self.block_size, self.device, self.stage)
        hidden, aux = self.forward(input_ids(inputs), inputs)
        return StepForward(hidden, aux, inputs.sample_rows, inputs.sample_seqs,
                           inputs.sample_ids)

    def run(self, input_ids: torch.Tensor, inputs: StepInputs) -> Outputs:
        if not any(g.stage_plan is not None for g in inputs.meta.groups):
            self._forget()  # this forward writes K/V the kept copy would miss
        try:
            return self._run(input_ids, inputs)
        except BaseException:
            self._forget()  # some layers may have appended, others not
            raise

    def run_part(self, input_ids: torch.Tensor, inputs: StepInputs) -> Outputs:
        """One part of a split plain step (`_forward_parts`), announced to the other ranks
        (op "run"): the step without `run`'s upkeep of the kept K/V, which the parts do."""
        with self.peers.call("run", input_ids, inputs.positions, inputs.meta):
            return self._run(input_ids, inputs)

    def kv_changed(self) -> None:
        with self.peers.call("kv_changed"):
            self._forget()

    def follow(self, op: str, args: tuple[object, ...]) -> None:
        """Rank 0's calls (Backend.follow), and "run": one part of a split step."""
        if op != "run":
            super().follow(op, args)
            return
        input_ids, positions, meta = args
        inputs = follower_inputs(input_ids, positions, self.adopt(meta))
        try:
            self._run(inputs.input_ids, inputs)
        except BaseException:
            self._forget()  # as rank 0's `_forward_parts` does
            raise

    def adopt(self, meta: object) -> AttentionMetadata:
        """Rank 0's metadata, each kept-K/V plan made this rank's: rank 0's stage planned
        the step, this rank's stage holds this rank's K/V of the same rows."""
        received = super().adopt(meta)
        stage = self.stage
        if stage is None or all(g.stage_plan is None for g in received.groups):
            return received
        groups = tuple(g if g.stage_plan is None
                       else replace(g, stage_plan=stage.follow(g.stage_plan))
                       for g in received.groups)
        return replace(received, groups=groups)

    def _forget(self) -> None:
        if self.stage is not None:
            self.stage.invalidate()

    def prepare_draft_head(self, head: torch.nn.Module) -> None:
        """The head's linears on the target's kernels (`prepare_cpu_linears`): its five
        draft levels a step are small GEMMs, where the kernel's per-call cost shows most."""
        self._pack_linears(head)

    def _pack_linears(self, module: torch.nn.Module) -> int:
        """`module`'s linears replaced for their kernels (module docstring; how many): with
        compile each packed bfloat16 linear also keeps its plain weight for the compiled
        steps."""
        return prepare_cpu_linears(module, self.linear_choice.kernel or "mkl",
                                   keep_plain=self.compiles)

    def make_draft_loop(self, loop: DraftLoop, shape: DraftLoopShape) -> DraftLoopRunner:
        del shape  # compiled with dynamic batch and width
        return (CompiledDraftLoop(loop, self.background) if self.compiles
                else EagerDraftLoop(loop))

    def target_fallbacks(self) -> list[Fallback]:
        """--cpu-compile's decode that is unavailable (a latent-cache model) or whose
        compilation failed: decode and verify run eagerly."""
        fallbacks = []
        compiled = self.compiled_decode
        reason = self.no_compiled_decode or (compiled.error if compiled is not None else None)
        if reason:
            fallbacks.append(Fallback("cpu_compile_decode",
                                      f"decode and verify run eagerly: {reason}"))
        pending = self.background.pending() if self.background is not None else []
        if pending:
            fallbacks.append(Fallback("cpu_compile_pending", "compiling in the background, "
                                      f"eager until compiled: {'; '.join(pending)}"))
        return fallbacks

    def linears_status(self) -> str:
        if self.linear_choice.kernel is not None:
            return self.linear_choice.describe()
        if self.num_packed_linears:
            return (f"packed for oneDNN ({self.num_packed_linears} "
                    f"{self.model_dtype_name} linears)")
        if self.unpacked_reason:
            return f"nn.Linear ({self.unpacked_reason})"
        return "nn.Linear (nothing to pack)"

    def status(self) -> str:
        if self.no_compiled_decode:
            return f"cpu compiled decode off ({self.no_compiled_decode})"
        return "off" if self.compiled_decode is None else self.compiled_decode.status()

    def _run(self, input_ids: torch.Tensor, inputs: StepInputs) -> Outputs:
        """The compiled step if it applies (and compiled), else the eager model."""
        compiled = self.compiled_decode
        if compiled is not None and compiled.applies(inputs.meta):
            result = compiled.run(input_ids, inputs.positions, inputs.meta, self.kv_caches)
            if result is not None:
                return result
        return self.eager(input_ids, inputs)

    def _split(self, batch: ScheduledBatch) -> tuple[list[int], list[int]] | None:
        """(decode, rest): indices into `batch.scheduled` of its one-token rows and of the
        others, when the step mixes both and the compiled decode can take the first; else
        None (one forward for the whole batch).

        A new request's prefill joining the decoding batch (every step or two under a
        steady load) would otherwise run the whole batch eagerly: on the 2-core CPU at 32
        sequences such a step took ~2.8x an appending compiled decode step, split ~2.5x
        (most of it the eager prefill, ~21 ms for ~110 tokens)."""
        compiled = self.compiled_decode
        if compiled is None or compiled.error is not None or self.stage is None:
            return None
        decode = [i for i, s in enumerate(batch.scheduled) if s.num_new_tokens == 1]
        if not decode or len(decode) == len(batch.scheduled):
            return None
        rest = [i for i, s in enumerate(batch.scheduled) if s.num_new_tokens != 1]
        return decode, rest

    def _forward_parts(self, batch: ScheduledBatch, input_ids: InputIds, decode: list[int],
                       rest: list[int]) -> StepForward:
        """The model over `batch` in two forwards, the decode rows first (kept K/V, the
        compiled step), then the rest (eager, without the stage: those rows write only
        their own sequences' K/V, which the kept copy does not hold). Hidden and aux come
        back in the batch's row layout."""
        offsets = [0]
        for s in batch.scheduled:
            offsets.append(offsets[-1] + s.num_new_tokens)
        hidden_parts: list[torch.Tensor] = []
        aux_parts: list[torch.Tensor] = []
        rows_parts: list[torch.Tensor] = []
        sample_rows: list[torch.Tensor] = []
        sample_seqs: list[Seq] = []
        sample_ids: list[int] = []
        try:
            for indices, stage in ((decode, self.stage), (rest, None)):
                part = ScheduledBatch([batch.scheduled[i] for i in indices])
                inputs = prepare_inputs(part, self.block_size, self.device, stage)
                hidden, aux = self.run_part(input_ids(inputs), inputs)
                rows = torch.tensor([r for i in indices for r in range(offsets[i], offsets[i + 1])],
                                    dtype=torch.int64, device=self.device)
                hidden_parts.append(hidden)
                if aux is not None:  # every part captures the same layers, or none does
                    aux_parts.append(aux)
                rows_parts.append(rows)
                sample_rows.append(rows[inputs.sample_rows])
                sample_seqs += inputs.sample_seqs
                sample_ids += inputs.sample_ids
        except BaseException:
            self._forget()  # some layers may have appended, others not
            raise
        self.num_split_steps += 1
        return StepForward(
            hidden=_merge_rows(hidden_parts, rows_parts, offsets[-1]),
            aux=_merge_rows(aux_parts, rows_parts, offsets[-1]) if aux_parts else None,
            sample_rows=torch.cat(sample_rows), sample_seqs=sample_seqs,
            sample_ids=sample_ids)


def _unpacked_reason(model: torch.nn.Module) -> str:
    """Why a model's bfloat16 linears stayed `nn.Linear` ("" when none did)."""
    if not any(can_pack(m) and m.weight.dtype == torch.bfloat16 for m in model.modules()):
        return ""
    return bf16_packing_unsupported() or ""


def _merge_rows(parts: list[torch.Tensor], rows: list[torch.Tensor], num_rows: int
                ) -> torch.Tensor:
    """[num_rows, ...]: part k's rows placed at `rows[k]` (the parts cover every row)."""
    out = parts[0].new_empty((num_rows, *parts[0].shape[1:]))
    for part, index in zip(parts, rows, strict=True):
        out[index] = part
    return out
