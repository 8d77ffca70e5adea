"""`min_tokens`: the tokens that would end a request are masked until it has that many.

A request with `min_tokens` k cannot sample its end-of-sequence tokens (unless ignore_eos)
or its stop_token_ids while fewer than k tokens are generated: their logits are -inf
(vLLM's rule), after the penalties and before temperature and the filters, so greedy and
sampled decoding pick among the other tokens. Log-probabilities stay the raw model's.

A row's count is the tokens generated before the one it samples. A plain row knows it from
its sequence (`len(output_token_ids) + num_unknown_tokens`); node i of a draft tree adds its
depth (the drafts on its path), so verification masks each position as plain decoding
would have there and speculation stays lossless. While the mask can apply, the sequence
counts its tokens (`Sequence.counts_its_tokens`): whole steps, every count on the host.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.runner.host_copy import upload
from specd.workers.runner.sampler import TokenHistory
from specd.workers.spec.tree import DraftTree


def stop_ids(params: SamplingParams, eos_token_ids: Collection[int]) -> list[int]:
    """The token ids min_tokens forbids for a request."""
    eos = [] if params.ignore_eos else sorted(eos_token_ids)
    return sorted({*eos, *params.stop_token_ids})


def num_generated(history: TokenHistory) -> int:
    """The tokens generated before the one a row samples."""
    return len(history.output_token_ids) + history.num_unknown_tokens


def mask_stop_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                     histories: Sequence[TokenHistory], eos_token_ids: Collection[int]
                     ) -> torch.Tensor:
    """logits [M, V] with each row's stop tokens at -inf while it is below min_tokens;
    `logits` itself when no row is."""
    rows = [(r, stop_ids(p, eos_token_ids)) for r, (p, h) in enumerate(zip(params, histories,
                                                                           strict=True))
            if p.masks_stop_tokens and num_generated(h) < p.min_tokens]
    rows = [(r, ids) for r, ids in rows if ids]
    if not rows:
        return logits
    vocab = logits.shape[1]
    row_ids = [r for r, ids in rows for t in ids if t < vocab]
    token_ids = [t for _, ids in rows for t in ids if t < vocab]
    out = logits.float().clone()
    out[_ids(row_ids, out.device), _ids(token_ids, out.device)] = float("-inf")
    return out


def mask_tree_stop_tokens(logits: torch.Tensor, tree: DraftTree,
                          params: Sequence[SamplingParams], histories: Sequence[TokenHistory],
                          eos_token_ids: Collection[int]) -> torch.Tensor:
    """logits [B, T, V] of draft trees with node i of tree b masked as `mask_stop_tokens`
    would mask plain decoding after the tree's root and node i's path (its depth more
    tokens generated); `logits` itself when no tree's request is below min_tokens."""
    trees = [b for b, (p, h) in enumerate(zip(params, histories, strict=True))
             if p.masks_stop_tokens and num_generated(h) < p.min_tokens
             and stop_ids(p, eos_token_ids)]
    if not trees:
        return logits
    device, vocab = logits.device, logits.shape[2]
    out = logits.float().clone()
    for b in trees:
        ids = [t for t in stop_ids(params[b], eos_token_ids) if t < vocab]
        below = params[b].min_tokens - num_generated(histories[b])
        nodes = tree.depths[b] < below  # [T]: nodes whose sample is still below min_tokens
        column = out[b][:, _ids(ids, device)]  # [T, len(ids)]
        out[b][:, _ids(ids, device)] = torch.where(nodes[:, None], float("-inf"), column)
    return out


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=torch.int64), device)
