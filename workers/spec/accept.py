"""Acceptance of a verified draft tree: pure torch functions over a batch of trees.

Node 0 of each tree is the root (see `tree.DraftTree`); the target's verify pass gives one
row of logits per node: row i is the target's next-token distribution after node i's path.

Greedy (`accept_greedy`): from the root, follow the child whose token is the target's argmax
at the current node; stop when no child matches. The argmax at the last accepted node is the
bonus token. Output is therefore the plain greedy output, token for token.

Sampled (`accept_sampled`), the multi-draft rejection rule of SpecInfer / EAGLE, lossless:
at the current node with target distribution p (top-k/top-p/min-p already applied), try the
children c_1, c_2, ... in index order. Child c_j, drafted from distribution q_j, is accepted
with probability min(1, p(c_j) / q_j(c_j)); on rejection p <- norm(max(p - q_j, 0)) and the
next child is tried. Accepting moves to the child (p = its target row); when every child is
rejected, or the node has none, the last token is drawn from p. Each try is one step of
standard speculative sampling (Leviathan et al.), so the token emitted at every position has
exactly the target's distribution, provided each c_j was drawn from q_j given the siblings
tried before it. The drafter here picks children deterministically (top-k), i.e. q_j is
one-hot at c_j: accept with probability p(c_j), else remove c_j from p and renormalize.
`draft_probs` supplies real q_j rows when drafts are sampled.

Penalties (`penalize_tree`): the target distribution at node i is the one plain decoding
would use after node i's path, so repetition, frequency and presence penalties count the
sequence's tokens plus the drafts on that path (root excluded: it is already the sequence's
last token), node by node, for chains and trees alike. The drafter proposes from the draft
head's own, unpenalized distribution; acceptance needs only the target side exact.

Random numbers: a uniform per node and one draw for the last token, per sequence from its
own generator when it has one (reproducible per request), else from the default generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.runner.host_copy import upload
from specd.workers.runner.sampler import (
    TokenHistory,
    apply_penalties,
    counted_histories,
    history_tensors,
    probs_from_logits,
    sample_from_probs,
)
from specd.workers.spec.tree import DraftTree, path_counts


@dataclass(frozen=True)
class Acceptance:
    """The outcome for a batch of B trees (int64 tensors, -1 where padded).

    num_accepted [B]: accepted drafts. accepted_nodes [B, D]: their node indices, root to
    leaf (root excluded). token_ids [B, D + 1]: the emitted tokens, i.e. the accepted nodes'
    tokens then the bonus token (1 .. depth + 1 of them). `token_lists()` gives them per
    sequence, as the scheduler appends them.
    """

    num_accepted: torch.Tensor
    accepted_nodes: torch.Tensor
    token_ids: torch.Tensor

    def token_lists(self) -> list[list[int]]:
        return [row[: n + 1] for row, n in zip(self.token_ids.tolist(),
                                               self.num_accepted.tolist(), strict=True)]

    def node_lists(self) -> list[list[int]]:
        return [row[:n] for row, n in zip(self.accepted_nodes.tolist(),
                                          self.num_accepted.tolist(), strict=True)]

    def kv_moves(self) -> list[list[tuple[int, int]]]:
        """Per sequence, (node, depth) for each accepted node whose verify row is not at its
        final place: its K/V must move from the root's slot + node to the root's slot +
        depth (the accepted path becomes contiguous; other draft slots are dropped). Empty
        for chains, where node i sits at depth i."""
        return [[(n, d) for d, n in enumerate(nodes, start=1) if n != d]
                for nodes in self.node_lists()]


def accept_greedy(tree: DraftTree, target_argmax: torch.Tensor,
                  max_depth: int | None = None) -> Acceptance:
    """target_argmax [B, T]: the target's argmax after each node (its logits' argmax).
    max_depth: a bound on the trees' depth; given, the walk reads nothing on the host (a
    fixed number of levels, D = max_depth columns in the result), else it stops early."""
    _check_shape(tree, target_argmax, "target_argmax")
    batch, _ = tree.token_ids.shape
    rows = torch.arange(batch, device=target_argmax.device)
    cur = torch.zeros(batch, dtype=torch.long, device=target_argmax.device)
    active = torch.ones(batch, dtype=torch.bool, device=target_argmax.device)
    path = []
    for _ in range(int(tree.depths.max()) if max_depth is None else max_depth):
        want = target_argmax[rows, cur]  # [B]
        match = (tree.parents == cur[:, None]) & (tree.token_ids == want[:, None]) & active[:, None]
        found = match.any(dim=1)
        # First matching child (lowest index); argmax of a bool row returns the first True.
        child = match.to(torch.int8).argmax(dim=1)
        path.append(torch.where(found, child, -1))
        cur = torch.where(found, child, cur)
        active = found
        if max_depth is None and not bool(found.any()):
            break
    bonus = target_argmax[rows, cur]
    return _result(path, tree, bonus)


def accept_sampled(tree: DraftTree, target_probs: torch.Tensor,
                   generators: Sequence[torch.Generator | None],
                   draft_probs: torch.Tensor | None = None,
                   default_generator: torch.Generator | None = None,
                   max_depth: int | None = None, max_children: int | None = None
                   ) -> Acceptance:
    """Tree rejection sampling.

    target_probs [B, T, V]: each node's filtered target distribution (`probs_from_logits`;
    greedy rows one-hot, which makes this rule greedy acceptance). draft_probs [B, T, V] or
    None: the distribution each node was drafted from (None = chosen deterministically).
    generators: one per sequence (None = `default_generator`, None = torch's global one).
    max_depth, max_children: bounds on the trees' depth and on any node's children; given,
    the walk reads nothing on the host (fixed loops), else it reads both from the trees.
    """
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, T, V], got {tuple(target_probs.shape)}")
    _check_shape(tree, target_probs[..., 0], "target_probs")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs must have target_probs' shape {tuple(target_probs.shape)}, "
                         f"got {tuple(draft_probs.shape)}")
    batch, num_nodes, _ = target_probs.shape
    if len(generators) != batch:
        raise ValueError(
            f"generators must have one entry per tree ({batch}), got {len(generators)}")
    uniforms = _uniforms(batch, num_nodes, generators, default_generator, target_probs.device)
    path, residual = _walk(tree, target_probs.float(), uniforms, draft_probs, max_depth,
                           max_children)
    last = sample_from_probs(residual, generators, default_generator)
    return _result(path, tree, last)


def _walk(tree: DraftTree, probs: torch.Tensor, uniforms: torch.Tensor,
          draft_probs: torch.Tensor | None, max_depth: int | None = None,
          max_children: int | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The rejection walk, all trees at once. Returns the accepted node per depth ([B] each,
    -1 once a tree stopped) and the distribution [B, V] the last token is drawn from."""
    batch = probs.shape[0]
    rows = torch.arange(batch, device=probs.device)
    cur = torch.zeros(batch, dtype=torch.long, device=probs.device)
    residual = probs[:, 0]  # [B, V]
    active = torch.ones(batch, dtype=torch.bool, device=probs.device)
    path = []
    fixed = max_depth is not None and max_children is not None
    for _ in range(max_depth if max_depth is not None else int(tree.depths.max())):
        is_child = (tree.parents == cur[:, None]) & active[:, None]  # [B, T]
        rank = is_child.cumsum(dim=1) - 1  # order among the current node's children
        found = torch.zeros_like(active)
        chosen = cur.clone()
        num_slots = max_children if fixed else int(is_child.sum(dim=1).max())
        for slot in range(num_slots or 0):
            trying = is_child & (rank == slot)
            has = trying.any(dim=1) & ~found  # [B]
            child = trying.to(torch.int8).argmax(dim=1)
            token = tree.token_ids[rows, child]
            p_token = residual[rows, token]
            q_row = None if draft_probs is None else draft_probs[rows, child].float()  # [B, V]
            q_token = 1.0 if q_row is None else q_row[rows, token]
            # u < p / q  <=>  u * q < p, with probability min(1, p / q) for u ~ U[0, 1).
            accepted = has & (uniforms[rows, child] * q_token < p_token)
            found |= accepted
            chosen = torch.where(accepted, child, chosen)
            residual = torch.where((has & ~accepted)[:, None],
                                   _without(residual, token, q_row), residual)
        path.append(torch.where(found, chosen, -1))
        residual = torch.where(found[:, None], probs[rows, chosen], residual)
        cur, active = chosen, found
        if not fixed and not bool(found.any()):
            break
    return path, residual


def _without(p: torch.Tensor, token: torch.Tensor, q_row: torch.Tensor | None) -> torch.Tensor:
    """norm(max(p - q, 0)) [B, V]; q one-hot at `token` when q_row is None.

    A row whose difference is all zero (p <= q everywhere, i.e. p == q up to rounding, where
    acceptance is certain but for rounding) keeps p, so no NaN can appear. A positive total,
    however small (a subnormal), is divided by as it is: the next sibling's acceptance reads
    this row, so it must sum to 1.
    """
    diff = p.scatter(1, token[:, None], 0.0) if q_row is None else (p - q_row).clamp(min=0.0)
    total = diff.sum(dim=1, keepdim=True)  # [B, 1]
    return torch.where(total > 0, diff / torch.where(total > 0, total, 1.0), p)


def _uniforms(batch: int, num_nodes: int, generators: Sequence[torch.Generator | None],
              default_generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """[B, T] uniforms in [0, 1): a row per tree, from its own generator when it has one."""
    out = torch.empty(batch, num_nodes, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        # The index goes up through pinned memory: a pageable copy would wait for the step
        # in flight (overlap scheduling).
        out[upload(torch.tensor(unseeded, dtype=torch.int64), device)] = torch.rand(
            len(unseeded), num_nodes, device=device, generator=default_generator)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand(num_nodes, device=device, generator=g)
    return out


def _result(path: list[torch.Tensor], tree: DraftTree, last: torch.Tensor) -> Acceptance:
    """Pack the per-depth accepted nodes ([B] each, -1 after a tree stopped) and last token."""
    batch = tree.token_ids.shape[0]
    nodes = (torch.stack(path, dim=1) if path
             else torch.empty(batch, 0, dtype=torch.long, device=last.device))  # [B, D]
    num_accepted = (nodes >= 0).sum(dim=1)
    tokens = torch.where(nodes >= 0, tree.token_ids.gather(1, nodes.clamp(min=0)), -1)
    tokens = torch.cat([tokens, torch.full_like(last[:, None], -1)], dim=1)  # [B, D + 1]
    tokens.scatter_(1, num_accepted[:, None], last[:, None])  # the bonus after the accepted
    return Acceptance(num_accepted=num_accepted, accepted_nodes=nodes, token_ids=tokens)


def _check_shape(tree: DraftTree, per_node: torch.Tensor, name: str) -> None:
    if per_node.shape != tree.token_ids.shape:
        raise ValueError(f"{name} must be [B, T] = {tuple(tree.token_ids.shape)} per node, got "
                         f"{tuple(per_node.shape)}")


def accept_tree(tree: DraftTree, target_logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                default_generator: torch.Generator | None = None,
                max_depth: int | None = None, max_children: int | None = None) -> Acceptance:
    """The engine's entry point: target_logits [B, T, V] of the verify pass, params and
    generators one per tree. All-greedy batches take `accept_greedy` (no random numbers);
    otherwise every tree goes through `accept_sampled` on `probs_from_logits` (greedy rows
    are one-hot there, so they still follow the argmax). max_depth and max_children (both
    or neither): bounds that make the walk read nothing on the host (overlap scheduling)."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, T, V], got {tuple(target_logits.shape)}")
    if len(params) != target_logits.shape[0]:
        raise ValueError(f"params must have one entry per tree ({target_logits.shape[0]}), "
                         f"got {len(params)}")
    if all(p.is_greedy for p in params):
        return accept_greedy(tree, target_logits.argmax(dim=-1), max_depth)
    batch, num_nodes, vocab = target_logits.shape
    row_params = [p for p in params for _ in range(num_nodes)]
    probs = probs_from_logits(target_logits.reshape(batch * num_nodes, vocab), row_params)
    return accept_sampled(tree, probs.view(batch, num_nodes, vocab), generators,
                          default_generator=default_generator, max_depth=max_depth,
                          max_children=max_children)


def penalize_tree(target_logits: torch.Tensor, tree: DraftTree, params: Sequence[SamplingParams],
                  histories: Sequence[TokenHistory]) -> torch.Tensor:
    """target_logits [B, T, V] with each tree's logit_bias and penalties applied, row i as
    `sampler.penalize` would after the sequence's tokens and node i's path (module
    docstring); `target_logits` itself when no tree's request changes its logits.
    histories: one per tree, the tokens its sequence holds (the root included)."""
    rows = [b for b, p in enumerate(params) if p.changes_logits]
    if not rows:
        return target_logits
    _, num_nodes, vocab = target_logits.shape
    device = target_logits.device
    index = upload(torch.tensor(rows, dtype=torch.int64), device)
    counted = counted_histories([params[b] for b in rows], [histories[b] for b in rows])
    prompt_mask, output_counts = history_tensors(counted, vocab, device)
    sub = DraftTree(token_ids=tree.token_ids[index], parents=tree.parents[index],
                    depths=tree.depths[index], tree_mask=tree.tree_mask[index])
    counts = output_counts[:, None, :] + path_counts(sub, vocab)  # [R, T, V]
    changed = apply_penalties(
        target_logits.float()[index].flatten(0, 1),
        [params[b] for b in rows for _ in range(num_nodes)],
        prompt_mask[:, None, :].expand(-1, num_nodes, -1).flatten(0, 1), counts.flatten(0, 1))
    return target_logits.float().index_copy(0, index, changed.view(len(rows), num_nodes, vocab))
