"""The draft loop on the CPU as one compiled function (`--cpu-compile`; part of the CPU
backend, cpu_backend.py).

At batch 1 the draft loop is five head forwards of a handful of small ops each, plus the
tree bookkeeping: ~40% of a speculative step on the fixture, mostly per-op overhead, as
plain decode was before `cpu_decode.py`. On CUDA the loop is a captured graph
(`spec/draft_graphs.py`); on the CPU, with `--cpu-compile`, it is compiled by torch.compile
(inductor) instead. Batch size and prefix width are dynamic, so one compilation serves
every width at batch 1 and one every batch above (both made in the warm-up).

Contract: `run(inputs)` returns what the loop returns for `inputs`. A compilation that
fails is not swallowed: one ERROR record with the traceback, then every call runs the loop
eagerly and `status` says why. With a `BackgroundCompiles` (cpu_compile_thread.py) each of
the two kinds is compiled on the compile thread from a copy of its first inputs, and the
loop runs eagerly until then (the loop reads the head's cache and writes nothing).
"""

from __future__ import annotations

import logging

import torch

from specd.workers.runner.backend import DraftLoop, DraftLoopRunner, Fallback
from specd.workers.runner.cpu_compile_thread import BackgroundCompiles
from specd.workers.runner.cpu_decode import report_compile_failure
from specd.workers.spec.draft_graphs import DraftInputs, DraftOutputs

log = logging.getLogger("specd.cpu_draft")


class CompiledDraftLoop(DraftLoopRunner):
    """`loop` (the drafter's `draft_loop`) compiled for the CPU, eager if that failed."""

    def __init__(self, loop: DraftLoop, background: BackgroundCompiles | None = None) -> None:
        self.loop = loop
        self.background = background  # None: a kind compiles at its first call, in place

        def tensors_in(last_out: torch.Tensor, prefix_slots: torch.Tensor,
                       prefix_ok: torch.Tensor, roots: torch.Tensor, root_ids: torch.Tensor
                       ) -> DraftOutputs:
            return loop(DraftInputs(last_out=last_out, prefix_slots=prefix_slots,
                                    prefix_ok=prefix_ok, roots=roots, root_ids=root_ids))

        # The head never changes after load: guards on its modules are skipped, as in
        # cpu_decode (the inputs' shapes and dtypes are still guarded).
        self._compiled = torch.compile(
            tensors_in, dynamic=None,
            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.error: str | None = None
        self.num_calls = 0  # loops that ran compiled

    def run(self, inputs: DraftInputs) -> DraftOutputs:
        result = self._run_compiled(inputs)
        return self.loop(inputs) if result is None else result

    def _run_compiled(self, inputs: DraftInputs) -> DraftOutputs | None:
        if self.error is not None:
            return None
        args = (inputs.last_out, inputs.prefix_slots, inputs.prefix_ok, inputs.roots,
                inputs.root_ids)
        background = self.background
        if background is not None:
            kind = "draft loop, batch " + ("2+" if inputs.last_out.shape[0] > 1 else "1")
            if not background.is_ready(kind):
                if not background.is_submitted(kind):
                    self._submit(background, kind, tuple(t.clone() for t in args))
                return None
        _mark_dynamic(args)
        try:
            result = self._compiled(*args)
        except Exception as exc:  # noqa: BLE001 - reported here, then eager by design
            self.error = report_compile_failure(log, "compiled CPU draft loop failed; "
                                                "drafting runs eagerly", exc)
            return None
        self.num_calls += 1
        return result

    def _submit(self, background: BackgroundCompiles, kind: str,
                args: tuple[torch.Tensor, ...]) -> None:
        def compile_kind() -> None:
            _mark_dynamic(args)
            self._compiled(*args)

        def failed(exc: Exception) -> None:
            self.error = report_compile_failure(log, "compiled CPU draft loop failed; "
                                                "drafting runs eagerly", exc)

        background.submit(kind, compile_kind, failed)

    def fallback(self) -> Fallback | None:
        return None if self.error is None else Fallback(
            "cpu_compile_draft_loop", f"the draft loop runs eagerly: {self.error}")

    def status(self) -> str:
        if self.error is not None:
            return f"draft loop eager ({self.error})"
        return "draft loop compiled"


def _mark_dynamic(args: tuple[torch.Tensor, ...]) -> None:
    """The batch (unless 1: dynamo compiles batch 1 apart anyway) and the prefix width."""
    last_out, prefix_slots, prefix_ok = args[:3]
    if last_out.shape[0] > 1:
        for t in args:
            torch._dynamo.mark_dynamic(t, 0)
    for t in (prefix_slots, prefix_ok):
        torch._dynamo.mark_dynamic(t, 1)
