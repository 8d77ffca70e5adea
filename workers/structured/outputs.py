"""`StructuredOutput`: the engine's constrained requests, their grammars and each step's masks.

* **Requests.** `add` compiles a request's constraint (grammar.py: once per distinct
  constraint, cached) into its own `RequestGrammar`; a constraint that does not compile is a
  ValueError (the request is refused). `release` forgets it when it ends.
* **Tokens kept.** After each step is applied, `advance` feeds every constrained sequence's
  new output tokens to its grammar; a grammar that fails names its request, which the
  engine ends with an error (the others go on).
* **Masks.** `start_masks(batch, trees)` is called as a step is launched, before its
  forward: it lays out the step's constrained rows (a plain sample: the state after the
  kept tokens; a verify: every node of the tree the step verifies, from the state of its
  path, chains included) and fills them on one mask thread (llguidance computes with the GIL
  released) while the forward runs; the sampler and the verifier wait for them only when
  they apply them (masks.py). Masks need the request's every earlier token on the host,
  so a constrained request runs in whole steps and is never verified lagged
  (`SamplingParams.counts_its_tokens`); a step that would break that is a ValueError.

Without a tokenizer in the model directory (test models addressed by token ids) structured
output is off: `status` says why, and `add` refuses every constraint with that reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from specd.ipc.structured import StructuredOutput as Constraint
from specd.workers.engine.batch import ScheduledBatch
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.spec.step import HostTree
from specd.workers.structured.grammar import GrammarCompiler
from specd.workers.structured.masks import NO_MASKS, MaskFigures, StepMasks
from specd.workers.structured.matcher import RequestGrammar
from specd.workers.structured.vocabulary import load_vocabulary, tokenizer_file

log = logging.getLogger("specd.structured")


@dataclass(frozen=True)
class _Rows:
    """One request's rows of a step: from `first`, one per node of the tree given by
    `token_ids` and `parents` (a plain sample: the root alone)."""

    grammar: RequestGrammar
    first: int
    token_ids: list[int]
    parents: list[int]


class StructuredOutput:
    """The constrained requests of an engine serving the model in `model_dir` (`vocab_size`
    logits, `eos_token_ids` ending a sequence) on `device`. See the module docstring."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: Iterable[int],
                 device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)  # int32 words per mask row
        self.device = device
        path = tokenizer_file(model_dir)
        self.compiler: GrammarCompiler | None = None
        if path is None:
            self.status = f"off: no tokenizer in {model_dir}"
        else:
            try:
                self.compiler = GrammarCompiler(
                    load_vocabulary(model_dir, vocab_size, list(eos_token_ids)))
                self.status = f"llguidance {llguidance.__version__} ({path.name})"
            except ValueError as exc:
                # The model serves without constraints (a tokenizer llguidance cannot read,
                # a test model's word-level one): a mode, logged and in status; constrained
                # requests are refused naming it.
                self.status = f"off: {exc}"
                log.warning("structured output is off: %s", exc,
                            extra={"event": "structured_output_off", "reason": str(exc)})
        self.grammars: dict[str, RequestGrammar] = {}
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specd-masks")
        self._last: Future[None] | None = None  # the last fill started
        self.figures = MaskFigures()

    @property
    def enabled(self) -> bool:
        return self.compiler is not None

    def add(self, request_id: str, constraint: Constraint) -> None:
        """Compile `constraint` for a new request. ValueError when structured output is off
        or the constraint does not compile."""
        self.grammars[request_id] = self._grammar(constraint)

    def check(self, constraint: Constraint, token_ids: list[int]) -> str | None:
        """Why `token_ids` is no prefix of a sentence of `constraint` (None: it is one),
        by a fresh matcher (warm-up and tests check outputs so)."""
        return self._grammar(constraint).advance(token_ids)

    def _grammar(self, constraint: Constraint) -> RequestGrammar:
        if self.compiler is None:
            raise ValueError(f"structured output is off for this model ({self.status})")
        return RequestGrammar(self.compiler.matcher(constraint),
                              self.compiler.tokenizer.eos_tokens, self.num_words)

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request (unknown ids are fine)."""
        self._wait_idle()
        self.grammars.pop(request_id, None)

    def advance(self, seqs: Iterable[Seq]) -> dict[str, str]:
        """Feed each unfinished constrained sequence's new output tokens to its grammar;
        request id -> error for those whose grammar failed."""
        self._wait_idle()
        failed: dict[str, str] = {}
        for seq in seqs:
            grammar = self.grammars.get(seq.request_id)
            if grammar is None or seq.is_finished:
                continue
            error = grammar.advance(seq.output_token_ids)
            if error is not None:
                failed[seq.request_id] = error
        return failed

    def forced_drafts(self, request_id: str, limit: int) -> list[int]:
        """The tokens a request's grammar forces next, at most `limit` (llguidance's
        fast-forward tokens: bytes only one continuation allows, canonically tokenized;
        none for an unconstrained request, or one whose grammar ended or failed). The
        speculative worker drafts them: the draft head, blind to the grammar, would rarely
        guess them, and verification takes any draft losslessly."""
        grammar = self.grammars.get(request_id)
        if grammar is None or grammar.ended or grammar.error is not None:
            return []
        self._wait_idle()
        forced: list[int] = grammar.matcher.compute_ff_tokens()
        return forced[:limit]

    def start_masks(self, batch: ScheduledBatch, trees: Mapping[str, HostTree]) -> StepMasks:
        """The masks of `batch`'s constrained rows, filling on the mask thread; `trees`: the
        shapes of the drafts the batch verifies. NO_MASKS when none is constrained."""
        rows: list[_Rows] = []
        layout: dict[str, tuple[int, int]] = {}
        num_rows = 0
        for item in batch.scheduled:
            seq = item.seq
            grammar = self.grammars.get(seq.request_id)
            if grammar is None or not item.needs_sample:
                continue
            token_ids, parents = _tree_rows(item.num_new_tokens, seq, trees, item.lagged_sample_id)
            if grammar.num_consumed != seq.num_output_tokens or seq.num_unknown_tokens:
                raise ValueError(f"request {seq.request_id}: its grammar has consumed "
                                 f"{grammar.num_consumed} of {seq.num_output_tokens} output "
                                 f"tokens ({seq.num_unknown_tokens} unknown): a constrained "
                                 "request must run in whole steps")
            rows.append(_Rows(grammar, num_rows, token_ids, parents))
            layout[seq.request_id] = (num_rows, len(token_ids))
            num_rows += len(token_ids)
        if not rows:
            return NO_MASKS
        self._wait_idle()
        host = torch.full((num_rows, self.num_words), -1, dtype=torch.int32,
                          pin_memory=self.device.type == "cuda")
        self._last = self._thread.submit(_fill, rows, host, self.figures)
        self.figures.num_rows += num_rows
        return StepMasks(layout, host, self._last, self.figures)

    def close(self) -> None:
        """Stop the mask thread (after the fill in progress, if any)."""
        self._thread.shutdown(wait=True)

    def _wait_idle(self) -> None:
        """Wait until the mask thread is done with the matchers. A step that applies its
        masks reads the fill's outcome (and raises what it raised); only a step that raised
        before applying them leaves one unread, and that step's own exception is the one
        reported."""
        if self._last is not None:
            wait([self._last])
            self._last = None


def _tree_rows(num_new_tokens: int, seq: Seq, trees: Mapping[str, HostTree],
               lagged_sample_id: int | None) -> tuple[list[int], list[int]]:
    """The (token ids, parents) of the nodes a constrained item samples at: the verified
    tree's first `num_new_tokens` nodes (the drafts the scheduler kept), or the root alone."""
    if lagged_sample_id is not None:
        raise ValueError(f"request {seq.request_id}: a constrained request verified lagged "
                         "(its drafts' tokens are not on the host)")
    root = seq.all_token_ids[-1]
    if not seq.spec_token_ids:
        return [root], [-1]
    tree = trees.get(seq.request_id)
    if tree is None:
        raise ValueError(f"request {seq.request_id}: drafts without their tree")
    return [root, *seq.spec_token_ids[:num_new_tokens - 1]], tree.parents[:num_new_tokens]


def _fill(rows: list[_Rows], host: torch.Tensor, figures: MaskFigures) -> None:
    """The mask thread's work for one step: every request's rows."""
    started = time.perf_counter()
    masks = host.numpy()
    for r in rows:
        r.grammar.fill_tree(masks, r.first, r.token_ids, r.parents)
    figures.fill_s += time.perf_counter() - started
