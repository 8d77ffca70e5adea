"""Draft trees: chain and EAGLE-2 dynamic tree against a brute-force reference."""

from __future__ import annotations

import math

import pytest
import torch

from specd.workers.spec.tree import (
    build_tree,
    chain_tree,
    expand_tree,
    start_tree,
    tree_mask_from_parents,
)


def draft(root_lp, root_ids, child_lps, child_ids, num_draft_tokens):
    """Run the tree functions as the drafter does; also return every frontier."""
    cands, frontier = start_tree(root_lp, root_ids)
    frontiers = [frontier]
    for lp, ids in zip(child_lps, child_ids, strict=True):
        cands, frontier = expand_tree(cands, frontier, lp, ids)
        frontiers.append(frontier)
    return build_tree(cands, torch.arange(root_lp.shape[0]) + 1000, num_draft_tokens), frontiers


def brute_force(b, root_lp, root_ids, child_lps, child_ids, num_draft_tokens):
    """SGLang's algorithm with plain lists for sequence b: (kept tokens, parents, depths)."""
    topk = root_lp.shape[1]
    cands = [(float(root_lp[b, k]), int(root_ids[b, k]), -1, 1) for k in range(topk)]
    frontier = list(range(topk))
    for lp, ids in zip(child_lps, child_ids, strict=True):
        new = [(cands[c][0] + float(lp[b, slot, j]), int(ids[b, slot, j]), c, cands[c][3] + 1)
               for slot, c in enumerate(frontier) for j in range(lp.shape[2])]
        base = len(cands)
        cands += new
        frontier = [base + i for i in sorted(range(len(new)), key=lambda i: (-new[i][0], i))[:topk]]
    best = sorted(range(len(cands)), key=lambda i: (-cands[i][0], i))[: num_draft_tokens - 1]
    kept = sorted(best)
    node = {c: n + 1 for n, c in enumerate(kept)}
    parents = [-1] + [0 if cands[c][2] < 0 else node[cands[c][2]] for c in kept]
    return [1000 + b] + [cands[c][1] for c in kept], parents, [0] + [cands[c][3] for c in kept]


StepInputs = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]


def random_step_inputs(gen: torch.Generator, batch: int, topk: int, num_steps: int,
                       vocab: int = 50) -> StepInputs:
    """Root top-k and per-step child top-k (log-probs, ids) from random distributions."""
    def top(shape):
        logits = torch.randn(*shape[:-1], vocab, generator=gen) * 2
        values, ids = torch.log_softmax(logits, -1).topk(shape[-1], dim=-1)
        return values, ids

    root_lp, root_ids = top((batch, topk))
    steps = [top((batch, topk, topk)) for _ in range(num_steps - 1)]
    return root_lp, root_ids, [s[0] for s in steps], [s[1] for s in steps]


def ancestors_or_self(parents, i):
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


@pytest.mark.parametrize("topk, num_steps, num_draft_tokens", [(1, 5, 6), (2, 3, 5), (4, 5, 8),
                                                               (3, 4, 20)])
def test_dynamic_tree_matches_brute_force(topk, num_steps, num_draft_tokens):
    gen = torch.Generator().manual_seed(topk * 100 + num_steps)
    batch = 3
    inputs = random_step_inputs(gen, batch, topk, num_steps)
    tree, _ = draft(*inputs, num_draft_tokens)
    assert tree.token_ids.shape == (batch, num_draft_tokens)
    for b in range(batch):
        tokens, parents, depths = brute_force(b, *inputs, num_draft_tokens)
        assert tree.token_ids[b].tolist() == tokens
        assert tree.parents[b].tolist() == parents
        assert tree.depths[b].tolist() == depths


def test_parents_precede_children_and_mask_bits_are_ancestors_or_self():
    gen = torch.Generator().manual_seed(7)
    tree, _ = draft(*random_step_inputs(gen, 4, 4, 6), 24)
    for b in range(4):
        parents = tree.parents[b].tolist()
        assert parents[0] == -1
        assert all(0 <= p < i for i, p in enumerate(parents) if i > 0)
        for i in range(tree.num_nodes):
            bits = {j for j in range(tree.num_nodes) if (int(tree.tree_mask[b, i]) >> j) & 1}
            assert bits == ancestors_or_self(parents, i)
            assert tree.depths[b, i] == len(bits) - 1


def test_a_child_never_outscores_its_parent():
    gen = torch.Generator().manual_seed(3)
    root_lp, root_ids, child_lps, child_ids = random_step_inputs(gen, 2, 3, 4)
    cands, frontier = start_tree(root_lp, root_ids)
    for lp, ids in zip(child_lps, child_ids, strict=True):
        cands, frontier = expand_tree(cands, frontier, lp, ids)
    for b in range(2):
        for c, p in enumerate(cands.parents[b].tolist()):
            if p >= 0:
                assert cands.scores[b, c] <= cands.scores[b, p]


def test_topk_one_is_the_chain():
    gen = torch.Generator().manual_seed(1)
    root_lp, root_ids, child_lps, child_ids = random_step_inputs(gen, 2, 1, 5)
    tree, _ = draft(root_lp, root_ids, child_lps, child_ids, 6)
    drafts = torch.cat([root_ids] + [ids[:, 0] for ids in child_ids], dim=1)
    chain = chain_tree(torch.tensor([1000, 1001]), drafts)
    for field in ("token_ids", "parents", "depths", "tree_mask"):
        assert torch.equal(getattr(tree, field), getattr(chain, field)), field
    assert chain.tree_mask[0].tolist() == [(1 << (i + 1)) - 1 for i in range(6)]
    assert torch.equal(chain.draft_token_ids, drafts)


def test_positions_are_root_position_plus_depth():
    tree = chain_tree(torch.tensor([5, 6]), torch.tensor([[1, 2], [3, 4]]))
    assert tree.positions(torch.tensor([10, 20])).tolist() == [[10, 11, 12], [20, 21, 22]]


def test_ties_keep_the_parent_before_its_child():
    # Every child has probability 1 (log 0): children tie with their parents.
    root_lp = torch.log(torch.tensor([[0.5, 0.5]]))
    root_ids = torch.tensor([[1, 2]])
    child_lp = torch.tensor([[[0.0, -math.inf], [0.0, -math.inf]]])
    child_ids = torch.tensor([[[3, 4], [5, 6]]])
    tree, _ = draft(root_lp, root_ids, [child_lp], [child_ids], 4)
    assert tree.token_ids[0].tolist() == [1000, 1, 2, 3]
    assert tree.parents[0].tolist() == [-1, 0, 0, 1]


def test_scratch_masks_name_the_frontier_ancestors_rows():
    gen = torch.Generator().manual_seed(5)
    topk = 3
    _, frontiers = draft(*random_step_inputs(gen, 2, topk, 4), 6)
    for b in range(2):
        # Scratch row of (depth d, slot k) is (d-1)*topk + k; ancestors follow parent_slots.
        for d, frontier in enumerate(frontiers, start=1):
            for k in range(topk):
                expected, slot = set(), k
                for depth in range(d, 0, -1):
                    expected.add((depth - 1) * topk + slot)
                    slot = int(frontiers[depth - 1].parent_slots[b, slot])
                mask = int(frontier.scratch_masks[b, k])
                assert {j for j in range(64) if (mask >> j) & 1} == expected


def test_tree_mask_from_parents_handles_64_nodes():
    parents = torch.arange(64)[None] - 1  # a 64-node chain
    masks = tree_mask_from_parents(parents)
    assert int(masks[0, 63]) == -1  # all 64 bits set
    with pytest.raises(ValueError, match="64"):
        tree_mask_from_parents(torch.arange(65)[None] - 1)


def test_invalid_inputs_raise():
    lp = torch.tensor([[float("nan"), -1.0]])
    with pytest.raises(ValueError, match="NaN"):
        start_tree(lp, torch.tensor([[1, 2]]))
    cands, _ = start_tree(torch.tensor([[-1.0, -2.0]]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_tree(cands, torch.tensor([0]), 4)  # only 2 candidates
    with pytest.raises(ValueError, match="topk"):
        cands, frontier = start_tree(torch.zeros(1, 8), torch.arange(8)[None])
        for _ in range(8):
            cands, frontier = expand_tree(cands, frontier, torch.zeros(1, 8, 1),
                                          torch.zeros(1, 8, 1, dtype=torch.long))
