"""One request's grammar state, and the token masks of a draft tree from it.

`RequestGrammar` holds an llguidance matcher advanced on the output tokens the request
keeps (`advance`, after each step is applied). Its masks for one verify (`fill_tree`) come
from the matcher state of each node's path, the root being the state after the kept tokens:

    visit(node):                       # the matcher is in the state after node's path
        row[node] = mask of the state
        for child in children(node):  # in node order
            if row[node] allows child's token:
                consume(child's token); visit(child); roll back one token
            # else: the child is dead (acceptance can never reach it: the target's
            # probability of its token at node is 0), and so is its subtree

A chain is the tree whose node i has parent i - 1. The matcher ends where it started, each
node's token consumed and rolled back once: a tree of T nodes costs at most T masks and T
consume/rollback pairs. Rows of dead nodes are left as they were (all tokens allowed): no
walk reads them. A plain sample is the tree of the root alone.

End of sequence: the model's EOS ids are allowed where the grammar's output is complete
(the matcher accepts). An EOS is never fed to the matcher (llguidance's bookkeeping of an EOS
after a grammar that has stopped does not roll back consistently): the grammar has `ended`,
and from then on only EOS is allowed (a request with `ignore_eos` goes on emitting it).

A grammar fails (its matcher in llguidance's error state: a library limit reached while
computing a mask, or a token it cannot take) at most once; the failure is kept (`error`)
and the request is ended by the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance
import numpy as np


class RequestGrammar:
    """A request's matcher over a vocabulary of `num_words` mask words whose end-of-sequence
    ids are `eos_token_ids`; `num_consumed` output tokens taken, `ended` after an EOS,
    `error` once it failed."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: Iterable[int],
                 num_words: int) -> None:
        self.matcher = matcher
        self.eos_token_ids = frozenset(eos_token_ids)
        self.eos_row = np.zeros(num_words, dtype=np.int32)  # the mask once ended
        for token_id in self.eos_token_ids:
            self.eos_row.view(np.uint32)[token_id >> 5] |= np.uint32(1 << (token_id & 31))
        self.num_consumed = 0
        self.ended = False
        self.error: str | None = None

    def advance(self, output_token_ids: Sequence[int]) -> str | None:
        """Take the output tokens not taken yet; the grammar's error, if it failed (now or
        before)."""
        for token_id in output_token_ids[self.num_consumed:]:
            if self.error is not None:
                break
            if token_id in self.eos_token_ids:
                if not (self.ended or self.matcher.is_accepting()):
                    self._fail(f"end of sequence {token_id} before the grammar is complete")
                self.ended = True
            elif self.ended or not self.matcher.consume_token(token_id):
                self._fail(f"token {token_id} does not satisfy the grammar")
            self.num_consumed += 1
        return self.error

    def fill_tree(self, masks: np.ndarray, first_row: int, token_ids: Sequence[int],
                  parents: Sequence[int]) -> None:
        """Rows first_row .. first_row + T - 1 of `masks` (int32 [R, W], one bit per token
        id, on the host) for the T nodes of a tree (module docstring): token_ids[i] and
        parents[i] of node i, node 0 the root (its token is already consumed, its parent
        -1), each parent before its children. Dead nodes' rows are left as they were."""
        children: list[list[int]] = [[] for _ in parents]
        for node, parent in enumerate(parents[1:], start=1):
            children[parent].append(node)
        # (node, its children visited so far, whether its token was consumed); nodes at or
        # under an EOS consume nothing (module docstring).
        stack: list[tuple[int, int, bool]] = [(0, 0, False)]
        self._fill_row(masks, first_row, self.ended)
        while stack and self.error is None:
            node, done, consumed = stack.pop()
            if done == len(children[node]):
                if consumed:
                    self._roll_back()
                continue
            stack.append((node, done + 1, consumed))
            child = children[node][done]
            token_id = token_ids[child]
            if not _allows(masks[first_row + node], token_id):
                continue  # dead, and its subtree with it
            ends = token_id in self.eos_token_ids
            if not ends and not self.matcher.consume_token(token_id):
                self._fail(f"draft token {token_id} was allowed by the mask and refused by "
                           "the grammar")
                break
            self._fill_row(masks, first_row + child, ends)
            stack.append((child, 0, not ends))

    def _fill_row(self, masks: np.ndarray, row: int, ended: bool) -> None:
        target = masks[row]
        if ended:
            target[:] = self.eos_row
            return
        self.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        if self.matcher.is_error():
            self._fail("computing its token mask failed")

    def _roll_back(self) -> None:
        if not self.matcher.rollback(1):
            self._fail("rolling a draft token back failed")

    def _fail(self, what: str) -> None:
        if self.error is None:
            self.error = f"the grammar failed: {what}: {_first_line(self.matcher.get_error())}"


def _allows(row: np.ndarray, token_id: int) -> bool:
    """Whether mask `row` (int32 words, bit b of word w = token 32 w + b) allows `token_id`."""
    word = token_id >> 5
    return 0 <= word < row.shape[0] and bool((int(row[word]) >> (token_id & 31)) & 1)


def _first_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[0] if lines else "no message from the library"
