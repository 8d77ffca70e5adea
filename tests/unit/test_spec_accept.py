"""Acceptance: greedy against brute force; rejection sampling against the target distribution.

The sampled tests draw N = 100,000 independent two-token continuations through speculative
rounds and compare the joint distribution of the first two emitted tokens with the target's
(a bigram model, so it is computable: P(a, b) = p(a | root) p(b | a), after temperature,
top-k and top-p). Pearson's chi-square test at significance 1e-3. Power: for an output
distribution at total-variation distance d from the target, the noncentrality is at least
4 N d^2 (Cauchy-Schwarz), i.e. >= 160 at d = 2%; with at most 63 degrees of freedom the
statistic then averages >= 223 against a critical value of about 103, so a 2% TV error
fails with probability > 1 - 1e-6. `test_chi_square_detects_a_two_percent_tv_error` checks
that on a distribution 2% away. Seeds are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.runner.sampler import probs_from_logits
from specd.workers.spec.accept import accept_greedy, accept_sampled, accept_tree
from specd.workers.spec.tree import (
    DraftTree,
    build_tree,
    chain_tree,
    expand_tree,
    start_tree,
    tree_mask_from_parents,
)

VOCAB = 8
NUM_SAMPLES = 100_000
ALPHA = 1e-3
SAMPLED = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)


def bigram(seed: int, params: SamplingParams | None = None) -> torch.Tensor:
    """A random bigram table [V, V]: row a is the next-token distribution after token a."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5
    if params is None:
        return torch.softmax(logits, dim=-1)
    return probs_from_logits(logits, [params] * VOCAB)


def draft_trees(q_table: torch.Tensor, roots: torch.Tensor, topk: int, steps: int,
                num_draft_tokens: int) -> DraftTree:
    """Deterministic top-k trees from the draft bigram (as the drafter builds them)."""
    logq = q_table.clamp(min=1e-30).log()
    cands, frontier = start_tree(*logq[roots].topk(topk, dim=-1))
    for _ in range(steps - 1):
        values, ids = logq[frontier.token_ids].topk(topk, dim=-1)  # [B, K, K]
        cands, frontier = expand_tree(cands, frontier, values, ids)
    return build_tree(cands, roots, num_draft_tokens)


def rows_of(tree: DraftTree, index: torch.Tensor) -> DraftTree:
    """The trees of `tree` at `index` (a tree per possible root, looked up per sample)."""
    return DraftTree(*(getattr(tree, f)[index] for f in
                       ("token_ids", "parents", "depths", "tree_mask")))


def first_two_tokens(target: torch.Tensor, make_tree, root: int, gen: torch.Generator,
                     draft_probs_of=None) -> torch.Tensor:
    """[N, 2]: the first two tokens generated after `root` by speculative rounds (a second
    round, rooted at the first token, for samples whose first round emitted one token)."""

    def round_(roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tree = make_tree(roots)
        probs = target[tree.token_ids]  # [B, T, V]: the target's row after each node
        draft_probs = None if draft_probs_of is None else draft_probs_of(tree)
        acc = accept_sampled(tree, probs, [None] * len(roots), draft_probs, gen)
        second = torch.where(acc.num_accepted >= 1, acc.token_ids[:, 1], -1)
        return acc.token_ids[:, 0], second

    first, second = round_(torch.full((NUM_SAMPLES,), root))
    need = second < 0
    second[need] = round_(first[need])[0]
    return torch.stack([first, second], dim=1)


def chi_square(samples: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(Pearson statistic, critical value at ALPHA) over the V*V cells; cells expected < 5
    are pooled. A sample in a zero-probability cell makes the statistic infinite."""
    flat = samples[:, 0] * VOCAB + samples[:, 1]
    observed = torch.bincount(flat, minlength=VOCAB * VOCAB).double()
    expected = expected_probs.flatten().double() * len(samples)
    if bool((observed[expected == 0] > 0).any()):
        return math.inf, 0.0
    small, big = (expected < 5) & (expected > 0), expected >= 5
    obs = torch.cat([observed[big], observed[small].sum()[None]])
    exp = torch.cat([expected[big], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, chi2_quantile_999(int(keep.sum()) - 1)


def chi2_quantile_999(df: int) -> float:
    """The 0.999 quantile of chi-square(df), Wilson-Hilferty (within 1% for df >= 10)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def joint(target: torch.Tensor, root: int) -> torch.Tensor:
    return target[root][:, None] * target  # [V, V]: P(a | root) P(b | a)


@pytest.mark.parametrize("topk, steps, num_draft_tokens", [(1, 3, 4), (3, 3, 8), (2, 4, 10)])
def test_tree_rejection_sampling_is_lossless(topk, steps, num_draft_tokens):
    target = bigram(1, SAMPLED)
    draft = bigram(2)  # a different model: plenty of rejections
    gen = torch.Generator().manual_seed(10 + topk)
    per_root = draft_trees(draft, torch.arange(VOCAB), topk, steps, num_draft_tokens)
    samples = first_two_tokens(target, lambda r: rows_of(per_root, r), 3, gen)
    stat, critical = chi_square(samples, joint(target, 3))
    assert stat < critical, (stat, critical)


def test_sampled_chain_drafts_with_draft_probabilities_are_lossless():
    """Drafts drawn from q (not top-k): the min(1, p/q) rule with real q rows."""
    target = bigram(3, SAMPLED)
    draft = bigram(4)
    gen = torch.Generator().manual_seed(5)

    def make_tree(roots: torch.Tensor) -> DraftTree:
        tokens, last = [], roots
        for _ in range(3):
            last = torch.multinomial(draft[last], 1, generator=gen)[:, 0]
            tokens.append(last)
        return chain_tree(roots, torch.stack(tokens, dim=1))

    def draft_probs_of(tree: DraftTree) -> torch.Tensor:
        # Node i was drawn from q(. | its parent's token); the root's row is never read.
        return draft[tree.token_ids.gather(1, tree.parents.clamp(min=0))]

    samples = first_two_tokens(target, make_tree, 0, gen, draft_probs_of)
    stat, critical = chi_square(samples, joint(target, 0))
    assert stat < critical, (stat, critical)


def test_chi_square_detects_a_two_percent_tv_error():
    target = bigram(1, SAMPLED)
    exact = joint(target, 3).flatten()
    # Move 2% of the mass from the most likely cell to the least likely allowed one.
    wrong = exact.clone()
    allowed = (exact > 0).nonzero()[:, 0]
    wrong[exact.argmax()] -= 0.02
    wrong[allowed[exact[allowed].argmin()]] += 0.02
    gen = torch.Generator().manual_seed(0)
    flat = torch.multinomial(wrong, NUM_SAMPLES, replacement=True, generator=gen)
    stat, critical = chi_square(torch.stack([flat // VOCAB, flat % VOCAB], dim=1),
                                exact.view(VOCAB, VOCAB))
    assert stat > critical


def brute_force_greedy(tree: DraftTree, argmax: torch.Tensor, b: int):
    tokens, parents = tree.token_ids[b].tolist(), tree.parents[b].tolist()
    node, path = 0, list[int]()
    while True:
        children = [c for c in range(len(tokens)) if parents[c] == node]
        match = [c for c in children if tokens[c] == int(argmax[b, node])]
        if not match:
            return path, [tokens[c] for c in path] + [int(argmax[b, node])]
        node = match[0]
        path.append(node)


def test_greedy_acceptance_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    q = bigram(5)
    roots = torch.randint(0, VOCAB, (200,), generator=gen)
    tree = draft_trees(q, roots, 3, 4, 12)
    # The target's argmax agrees with the draft's favourite child often but not always.
    favourite = q.argmax(-1)[tree.token_ids]
    noise = torch.randint(0, VOCAB, tree.token_ids.shape, generator=gen)
    argmax = torch.where(torch.rand(tree.token_ids.shape, generator=gen) < 0.7, favourite, noise)
    acc = accept_greedy(tree, argmax)
    lengths = set()
    for b in range(len(roots)):
        path, tokens = brute_force_greedy(tree, argmax, b)
        assert acc.node_lists()[b] == path
        assert acc.token_lists()[b] == tokens
        lengths.add(len(path))
    assert lengths == {0, 1, 2, 3, 4}  # every outcome from none to the full depth occurs


def test_greedy_output_is_the_plain_greedy_sequence():
    target = bigram(6)
    best = target.argmax(-1)
    roots = torch.arange(VOCAB)
    tree = draft_trees(bigram(7), roots, 2, 4, 9)
    acc = accept_greedy(tree, best[tree.token_ids])
    for b, root in enumerate(roots.tolist()):
        expected, token = [], root
        for _ in range(len(acc.token_lists()[b])):
            token = int(best[token])
            expected.append(token)
        assert acc.token_lists()[b] == expected


def test_one_hot_targets_make_rejection_sampling_greedy():
    gen = torch.Generator().manual_seed(1)
    roots = torch.randint(0, VOCAB, (300,), generator=gen)
    tree = draft_trees(bigram(8), roots, 2, 3, 7)
    logits = torch.randn(300, tree.num_nodes, VOCAB, generator=gen)
    greedy = accept_greedy(tree, logits.argmax(-1))
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float()
    sampled = accept_sampled(tree, one_hot, [None] * 300, default_generator=gen)
    assert sampled.token_lists() == greedy.token_lists()
    assert sampled.node_lists() == greedy.node_lists()


def test_accept_tree_greedy_draws_no_random_numbers_and_seeds_reproduce():
    gen = torch.Generator().manual_seed(2)
    roots = torch.randint(0, VOCAB, (4,), generator=gen)
    tree = draft_trees(bigram(9), roots, 2, 3, 6)
    logits = torch.randn(4, tree.num_nodes, VOCAB, generator=gen)
    expected = accept_greedy(tree, logits.argmax(-1)).token_lists()
    seeded = torch.Generator().manual_seed(42)
    state = seeded.get_state()
    acc = accept_tree(tree, logits, [SamplingParams()] * 4, [seeded] * 4)
    assert torch.equal(seeded.get_state(), state)
    assert acc.token_lists() == expected
    mixed = [SamplingParams(), SamplingParams(temperature=1.0, seed=1)] * 2

    def run() -> list[list[int]]:
        gens = [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(7)]
        acc = accept_tree(tree, logits, mixed, gens, torch.Generator().manual_seed(3))
        return acc.token_lists()

    first = run()
    assert first == run()
    for b in (0, 2):  # the greedy rows of a mixed batch still follow the argmax
        assert first[b] == expected[b]


def test_shape_errors_name_the_argument():
    tree = chain_tree(torch.tensor([0]), torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="target_argmax"):
        accept_greedy(tree, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="generators"):
        accept_sampled(tree, torch.full((1, 3, VOCAB), 1 / VOCAB), [])
    with pytest.raises(ValueError, match="draft_probs"):
        accept_sampled(tree, torch.full((1, 3, VOCAB), 1 / VOCAB), [None],
                       torch.full((1, 2, VOCAB), 1 / VOCAB))


def pad(tree: DraftTree, num_nodes: int) -> DraftTree:
    """The same trees with padding nodes (parent -1) appended up to num_nodes."""
    extra = num_nodes - tree.num_nodes
    batch = tree.token_ids.shape[0]

    def cat(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([x, torch.full((batch, extra), value)], dim=1)

    return DraftTree(cat(tree.token_ids, 0), cat(tree.parents, -1), cat(tree.depths, 0),
                     cat(tree.tree_mask, 0))


def test_padding_nodes_are_never_reached():
    gen = torch.Generator().manual_seed(3)
    roots = torch.randint(0, VOCAB, (64,), generator=gen)
    tree = draft_trees(bigram(10), roots, 2, 3, 5)
    padded = pad(tree, 9)
    logits = torch.randn(64, 9, VOCAB, generator=gen)
    logits[:, 5:, 0] = 100.0  # padding rows would pull toward token 0 if ever read
    plain = accept_greedy(tree, logits[:, :5].argmax(-1))
    assert accept_greedy(padded, logits.argmax(-1)).token_lists() == plain.token_lists()
    probs = torch.softmax(logits, dim=-1)
    sampled = accept_sampled(padded, probs, [None] * 64, default_generator=gen)
    assert all(n < 5 for nodes in sampled.node_lists() for n in nodes)


def test_kv_moves_make_the_accepted_path_contiguous():
    # Tree: root 0; children 1, 2; node 3 under 2; node 4 under 3.
    tree = DraftTree(token_ids=torch.tensor([[9, 1, 2, 3, 4]]),
                     parents=torch.tensor([[-1, 0, 0, 2, 3]]),
                     depths=torch.tensor([[0, 1, 1, 2, 3]]),
                     tree_mask=torch.tensor([[1, 3, 5, 13, 29]]))
    argmax = torch.tensor([[2, 0, 3, 4, 7]])  # follows 2 -> 3 -> 4, bonus 7
    acc = accept_greedy(tree, argmax)
    assert acc.node_lists() == [[2, 3, 4]]
    assert acc.token_lists() == [[2, 3, 4, 7]]
    assert acc.kv_moves() == [[(2, 1), (3, 2), (4, 3)]]
    chain = accept_greedy(chain_tree(torch.tensor([9]), torch.tensor([[1, 2]])),
                          torch.tensor([[1, 2, 5]]))
    assert chain.kv_moves() == [[]]


@pytest.mark.parametrize(("topk", "steps", "num_draft_tokens"), [(1, 4, 5), (3, 3, 8)])
def test_fixed_loops_read_nothing_and_accept_the_same(topk, steps, num_draft_tokens):
    # Overlap scheduling accepts with fixed loops (no host reads of the trees or of the
    # walk): the outcome must be the early-stopping walk's, greedy and sampled alike.
    gen = torch.Generator().manual_seed(11)
    roots = torch.randint(0, VOCAB, (64,), generator=gen)
    tree = draft_trees(bigram(12), roots, topk, steps, num_draft_tokens)
    logits = torch.randn(64, tree.num_nodes, VOCAB, generator=gen) * 3
    for params in (SamplingParams(), SAMPLED):
        early = accept_tree(tree, logits, [params] * 64, [None] * 64,
                            torch.Generator().manual_seed(4))
        fixed = accept_tree(tree, logits, [params] * 64, [None] * 64,
                            torch.Generator().manual_seed(4), max_depth=steps,
                            max_children=topk)
        assert fixed.token_lists() == early.token_lists()
        assert fixed.node_lists() == early.node_lists()
        assert fixed.accepted_nodes.shape == (64, steps)


def test_tiny_temperatures_accept_greedily_as_the_sampler_samples():
    # `is_greedy` decides for acceptance as for the sampler: a temperature of 1e-40 (alone or
    # with filters that round to nothing in float32) follows the argmax and draws no random
    # numbers, also beside sampled trees in the same batch.
    gen = torch.Generator().manual_seed(13)
    roots = torch.randint(0, VOCAB, (4,), generator=gen)
    tree = draft_trees(bigram(14), roots, 2, 3, 6)
    logits = torch.randn(4, tree.num_nodes, VOCAB, generator=gen)
    expected = accept_greedy(tree, logits.argmax(-1)).token_lists()
    tiny = [SamplingParams(temperature=1e-40, seed=5),
            SamplingParams(temperature=1e-40, top_k=5, top_p=1e-300, seed=6)]
    seeded = torch.Generator().manual_seed(42)
    state = seeded.get_state()
    acc = accept_tree(tree, logits, tiny * 2, [seeded] * 4)
    assert torch.equal(seeded.get_state(), state)
    assert acc.token_lists() == expected
    mixed = accept_tree(tree, logits, tiny + [SAMPLED] * 2, [None] * 4,
                        torch.Generator().manual_seed(3))
    assert mixed.token_lists()[:2] == expected[:2]


def test_a_residual_with_subnormal_mass_is_renormalized():
    # The first child (token 0) has q = 0 and p = 0: rejected for sure, leaving
    # max(p - q, 0) = 1e-44 on token 3 alone. That residual is a distribution all on token 3,
    # so the second child, token 3 drafted with q = 1, is accepted for sure.
    tree = DraftTree(token_ids=torch.tensor([[5, 0, 3]]), parents=torch.tensor([[-1, 0, 0]]),
                     depths=torch.tensor([[0, 1, 1]]),
                     tree_mask=tree_mask_from_parents(torch.tensor([[-1, 0, 0]])))
    target = torch.tensor([[[0.0, 0.5, 0.5, 1e-44], [0.25] * 4, [0.0, 0.0, 1.0, 0.0]]])
    draft = torch.tensor([[[0.25] * 4, [0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    acc = accept_sampled(tree, target, [torch.Generator().manual_seed(0)], draft)
    assert acc.node_lists() == [[2]]
    assert acc.token_lists() == [[3, 2]]
