"""Draft-tree bookkeeping: a chain (top-k 1) or an EAGLE-2 dynamic tree. Pure torch functions.

Drafting a batch of B sequences with top-k K over N steps (as SGLang's `eagle_worker`):

    cands, frontier = start_tree(logprobs_topk, ids_topk)        # the root's K children
    for _ in range(N - 1):                                      # one draft forward per step
        # the drafter runs the head on the frontier nodes and takes each one's top-K
        cands, frontier = expand_tree(cands, frontier, child_logprobs, child_ids)
    tree = build_tree(cands, root_ids, num_draft_tokens)

Every candidate carries its cumulative log-probability (sum over its path). `expand_tree`
keeps the K best of the K*K children as the next frontier; `build_tree` keeps the
`num_draft_tokens - 1` best candidates overall and orders them by creation, so parents come
before children (a child never scores above its parent, and ties go to the earlier node).

The tree the target verifies has T = num_draft_tokens nodes: node 0 is the root (the last
accepted token, whose target pass has not run yet), nodes 1..T-1 the drafts. `tree_mask[b, i]`
has bit j set iff node i may see node j: itself, its ancestors and the root (the attention
contract's tree mask, T <= 64). A node's rope position is the root's position + its depth.

Scratch rows. To expand frontier nodes at depth d the drafter feeds every frontier node of
depths 1..d (in that order, K per depth: node k of depth d is scratch row (d-1)*K + k) after
the draft's cached prefix; `Frontier.scratch_masks` are those rows' bit masks among the
scratch rows (ancestors and itself), so the draft forward follows the same tree-mask contract.
For a chain (K = 1) every earlier scratch row is an ancestor, so a causal mask is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TREE_NODES = 64  # one int64 bit mask per row


@dataclass(frozen=True)
class Candidates:
    """Every drafted node so far, in creation order: [B, C] each.

    parents: candidate index of the parent, -1 for the root's children. depths: 1 for the
    root's children. scores: cumulative log-probability of the path from the root.
    """

    token_ids: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor


@dataclass(frozen=True)
class Frontier:
    """The K nodes per sequence the next draft step expands: [B, K] each.

    cand_ids: their candidate indices. parent_slots: which node of the previous frontier each
    extends (0 for depth 1, where all extend the root); the drafter gathers the head's outputs
    with it to form their hidden inputs. scratch_masks: int64 bit masks over scratch rows.
    """

    cand_ids: torch.Tensor
    scores: torch.Tensor
    token_ids: torch.Tensor
    parent_slots: torch.Tensor
    scratch_masks: torch.Tensor
    depth: int


@dataclass(frozen=True)
class DraftTree:
    """The tree one verify pass checks: [B, T] each, node 0 the root.

    token_ids: target-vocabulary ids (column 0 the root token). parents: parent node index
    (-1 for the root), always < the node's own index. depths: 0 for the root.
    tree_mask: int64, bit j of row i set iff node i may see node j.
    Trees of different sizes share a batch by padding: a padding node has parent -1 at an
    index > 0, so no walk ever reaches it.
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    tree_mask: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    def positions(self, root_positions: torch.Tensor) -> torch.Tensor:
        """Rope positions [B, T] given each root's position [B]."""
        return root_positions[:, None] + self.depths

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """[B, T - 1]: the drafts, what `Sequence.spec_token_ids` holds."""
        return self.token_ids[:, 1:]


def start_tree(logprobs: torch.Tensor, token_ids: torch.Tensor, check: bool = True
               ) -> tuple[Candidates, Frontier]:
    """The root's top-K children: logprobs and target token ids [B, K] (best first or not).

    Returns the candidates so far (these K) and the first frontier (depth 1). check=False
    skips the NaN check (it reads the device: not allowed while a CUDA graph captures); the
    caller then checks on the host (the draft loop returns per-row NaN flags).
    """
    if logprobs.shape != token_ids.shape or logprobs.dim() != 2:
        raise ValueError(f"start_tree: logprobs {tuple(logprobs.shape)} and token_ids "
                         f"{tuple(token_ids.shape)} must both be [B, K]")
    if check:
        _check_finite(logprobs)
    batch, topk = logprobs.shape
    scores = logprobs.float().clamp(max=0.0)
    slots = torch.arange(topk, device=logprobs.device).expand(batch, -1)
    cands = Candidates(
        token_ids=token_ids.long(), scores=scores,
        parents=torch.full_like(slots, -1), depths=torch.ones_like(slots))
    frontier = Frontier(
        cand_ids=slots, scores=scores, token_ids=token_ids.long(),
        parent_slots=torch.zeros_like(slots), scratch_masks=_bits(slots), depth=1)
    return cands, frontier


def expand_tree(cands: Candidates, frontier: Frontier, child_logprobs: torch.Tensor,
                child_ids: torch.Tensor, check: bool = True) -> tuple[Candidates, Frontier]:
    """Add the frontier's children and pick the next frontier.

    child_logprobs, child_ids: [B, K, K'], the top-K' children of each frontier node (the
    head's log-probabilities given that node, target-vocabulary ids). All K*K' children
    become candidates; the K best by cumulative score (ties: the earlier) form the frontier.
    check: as in `start_tree`.
    """
    batch, topk = frontier.cand_ids.shape
    if child_logprobs.shape != child_ids.shape or child_logprobs.shape[:2] != (batch, topk):
        raise ValueError(f"expand_tree: child_logprobs {tuple(child_logprobs.shape)} and "
                         f"child_ids {tuple(child_ids.shape)} must both be [{batch}, {topk}, K]")
    if check:
        _check_finite(child_logprobs)
    # [B, K, K'] -> [B, K*K'], row-major: children of frontier node k are contiguous.
    scores = (frontier.scores[:, :, None] + child_logprobs.float().clamp(max=0.0)).flatten(1)
    parent_slots = torch.arange(topk, device=scores.device).repeat_interleave(
        child_logprobs.shape[2]).expand(batch, -1)  # [B, K*K']
    parents = frontier.cand_ids.gather(1, parent_slots)
    offset = cands.token_ids.shape[1]
    cands = Candidates(
        token_ids=torch.cat([cands.token_ids, child_ids.flatten(1).long()], dim=1),
        scores=torch.cat([cands.scores, scores], dim=1),
        parents=torch.cat([cands.parents, parents], dim=1),
        depths=torch.cat([cands.depths, torch.full_like(parents, frontier.depth + 1)], dim=1))
    order = _best_first(scores)[:, :topk]  # [B, K] indices among the new children
    chosen_slots = parent_slots.gather(1, order)
    slot_ids = torch.arange(topk, device=scores.device).expand(batch, -1)
    first_row = frontier.depth * topk  # scratch row of this frontier's node 0
    if first_row + topk > MAX_TREE_NODES:
        raise ValueError(f"expand_tree: depth {frontier.depth + 1} with top-k {topk} needs "
                         f"scratch rows past {MAX_TREE_NODES}; topk * num_steps must be <= 64")
    masks = frontier.scratch_masks.gather(1, chosen_slots) | _bits(first_row + slot_ids)
    next_frontier = Frontier(
        cand_ids=offset + order, scores=scores.gather(1, order),
        token_ids=cands.token_ids[:, offset:].gather(1, order),
        parent_slots=chosen_slots, scratch_masks=masks, depth=frontier.depth + 1)
    return cands, next_frontier


def build_tree(cands: Candidates, root_ids: torch.Tensor, num_draft_tokens: int,
               check: bool = True) -> DraftTree:
    """Keep the `num_draft_tokens - 1` best candidates and lay the tree out for verification.

    root_ids [B]: the last accepted token of each sequence. num_draft_tokens counts the root
    (as SGLang's `--speculative-num-draft-tokens`); at most the number of candidates + 1.
    check=False skips the check that every kept node's parent was kept (it reads the
    device); the caller then checks the parents on the host (`check_parents`).
    """
    num_kept = num_draft_tokens - 1
    batch, num_cands = cands.scores.shape
    if not 1 <= num_draft_tokens <= MAX_TREE_NODES or num_kept > num_cands:
        limit = min(MAX_TREE_NODES, num_cands + 1)
        raise ValueError(f"build_tree: num_draft_tokens must be in [1, {limit}] "
                         f"({num_cands} candidates), got {num_draft_tokens}")
    device = cands.scores.device
    kept = _best_first(cands.scores)[:, :num_kept].sort(dim=1).values  # [B, D] creation order
    # Candidate index -> node index (1..D); the root's children point at node 0.
    node_of = torch.full((batch, num_cands + 1), -1, dtype=torch.long, device=device)
    node_of[:, num_cands] = 0  # slot for parent -1 (the root)
    nodes = torch.arange(1, num_kept + 1, device=device).expand(batch, -1)
    node_of.scatter_(1, kept, nodes)
    cand_parents = cands.parents.gather(1, kept)
    parents = node_of.gather(1, torch.where(cand_parents < 0, num_cands, cand_parents))
    if check and bool((parents < 0).any()):
        raise ValueError(_DROPPED_PARENT)
    minus_one = torch.full((batch, 1), -1, dtype=torch.long, device=device)
    zero = torch.zeros((batch, 1), dtype=torch.long, device=device)
    all_parents = torch.cat([minus_one, parents], dim=1)
    return DraftTree(
        token_ids=torch.cat([root_ids.long()[:, None], cands.token_ids.gather(1, kept)], dim=1),
        parents=all_parents,
        depths=torch.cat([zero, cands.depths.gather(1, kept)], dim=1),
        tree_mask=tree_mask_from_parents(all_parents))


_DROPPED_PARENT = "build_tree: a kept node's parent was dropped (scores not monotone)"


def signed64(mask: int) -> int:
    """A 64-bit tree-mask pattern as the int64 torch stores (bit 63 is the sign bit)."""
    return mask - (1 << 64) if mask >= 1 << 63 else mask


def check_parents(parents: list[list[int]]) -> None:
    """Host-side form of build_tree's check: only node 0 of each row has parent -1."""
    if any(p < 0 for row in parents for p in row[1:]):
        raise ValueError(_DROPPED_PARENT)


def chain_tree(root_ids: torch.Tensor, draft_ids: torch.Tensor) -> DraftTree:
    """A chain: root_ids [B], draft_ids [B, n] -> a tree of n + 1 nodes, node i's parent i-1."""
    batch, num = draft_ids.shape
    device = draft_ids.device
    idx = torch.arange(num + 1, device=device).expand(batch, -1)
    return DraftTree(
        token_ids=torch.cat([root_ids.long()[:, None], draft_ids.long()], dim=1),
        parents=idx - 1, depths=idx.clone(),
        tree_mask=(torch.ones_like(idx) << (idx + 1)) - 1)  # node i sees nodes 0..i


def tree_mask_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """int64 [B, T] bit masks from parents [B, T] (-1 = root, each parent before its child)."""
    batch, num_nodes = parents.shape
    if num_nodes > MAX_TREE_NODES:
        raise ValueError(f"a tree has at most {MAX_TREE_NODES} nodes, got {num_nodes}")
    masks = _bits(torch.arange(num_nodes, device=parents.device)).expand(batch, -1).clone()
    for i in range(1, num_nodes):
        parent = parents[:, i].clamp(min=0)
        masks[:, i] |= torch.where(parents[:, i] >= 0, masks.gather(1, parent[:, None])[:, 0], 0)
    return masks


def path_counts(tree: DraftTree, vocab_size: int) -> torch.Tensor:
    """How often each token occurs on each node's path, float32 [B, T, V]: the drafts from
    the root's child down to the node itself, the root excluded (the root is the last token
    the sequence already holds). Row i is what penalties add to the sequence's output
    counts for the target's distribution after node i. Reads nothing on the host."""
    batch, num_nodes = tree.token_ids.shape
    bits = torch.arange(num_nodes, device=tree.parents.device)
    masks = tree_mask_from_parents(tree.parents)  # [B, T]
    # on_path[b, i, j]: node j is node i or an ancestor of it, and not the root.
    on_path = ((masks[:, :, None] >> bits) & 1).bool()  # [B, T, T]
    on_path[:, :, 0] = False
    counts = torch.zeros(batch, num_nodes, vocab_size, dtype=torch.float32,
                         device=tree.token_ids.device)
    index = tree.token_ids[:, None, :].expand(batch, num_nodes, num_nodes)  # token of node j
    return counts.scatter_add_(2, index, on_path.float())


def _bits(positions: torch.Tensor) -> torch.Tensor:
    """int64 1 << positions (bit 63 is the sign bit; the pattern is what counts)."""
    return torch.ones_like(positions, dtype=torch.long) << positions.long()


def _best_first(scores: torch.Tensor) -> torch.Tensor:
    """Indices [B, C] by descending score, ties by ascending index (stable)."""
    return torch.sort(-scores, dim=1, stable=True).indices


def _check_finite(logprobs: torch.Tensor) -> None:
    if bool(torch.isnan(logprobs).any()):
        raise ValueError("draft log-probabilities contain NaN")
