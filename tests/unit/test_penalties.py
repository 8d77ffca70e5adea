"""Penalties and logit biases against brute force, and exact along a draft tree's paths.

The reference walks every row and token in Python, in the order the sampler documents
(vLLM's): logit_bias, repetition_penalty (over prompt and output), frequency_penalty and
presence_penalty (over the output only). transformers' own repetition processor is a second,
independent oracle for the repetition rule. Along a draft tree, node i's row must be the
plain penalty of the sequence extended by the drafts on node i's path, found here by
following parent links one node at a time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.engine.sequence import Sequence, any_counts_its_tokens
from specd.workers.runner.sampler import penalize, probs_from_logits, sample
from specd.workers.spec.accept import accept_tree, penalize_tree
from specd.workers.spec.tree import DraftTree, path_counts, tree_mask_from_parents


@dataclass(frozen=True)
class History:
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_unknown_tokens: int = 0


def reference_penalize(logits: list[float], p: SamplingParams, h: History) -> list[float]:
    """One row, token by token."""
    out = []
    for t, x in enumerate(logits):
        x += p.logit_bias.get(t, 0.0)
        if t in h.prompt_token_ids or t in h.output_token_ids:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = h.output_token_ids.count(t)
        x -= p.frequency_penalty * count
        x -= p.presence_penalty * (count > 0)
        out.append(x)
    return out


def random_case(rng: random.Random, vocab: int) -> tuple[SamplingParams, History]:
    bias = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.choice([0, 0, 2]))}
    params = SamplingParams(
        temperature=rng.choice([0.0, 1.0]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.7, rng.uniform(0.1, 3.0)]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -1.5, rng.uniform(-2, 2)]),
        presence_penalty=rng.choice([0.0, 0.0, 0.8, -2.0, rng.uniform(-2, 2)]),
        logit_bias=bias)
    history = History(tuple(rng.randrange(vocab) for _ in range(rng.randrange(1, 12))),
                      tuple(rng.randrange(vocab) for _ in range(rng.randrange(0, 12))))
    return params, history


def test_penalize_matches_a_token_by_token_loop_for_mixed_rows() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 3, 17, 40):
        cases = [random_case(rng, vocab) for _ in range(48)]
        params, histories = [c[0] for c in cases], [c[1] for c in cases]
        logits = torch.randn(len(cases), vocab, generator=gen) * 4
        logits[0, 0] = 0.0  # a logit of exactly 0 stays 0 under repetition
        got = penalize(logits, params, histories)
        expected = torch.tensor([reference_penalize(row, p, h) for row, p, h
                                 in zip(logits.tolist(), params, histories, strict=True)])
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


def test_logit_bias_comes_before_the_repetition_penalty() -> None:
    # 1.0 + bias -2 = -1, then repetition 2 multiplies the negative logit: -2 (the other
    # order would give 1.0 / 2 - 2 = -1.5).
    params = SamplingParams(repetition_penalty=2.0, logit_bias={0: -2.0})
    got = penalize(torch.tensor([[1.0, 0.5]]), [params], [History((0,), ())])
    assert got.tolist() == [[-2.0, 0.5]]


def test_repetition_penalty_matches_transformers_processor() -> None:
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen) * 3
    ids = [[1, 2, 2, 7, 49], [0, 3, 3, 3, 10], [4, 5, 6, 7, 8]]
    for penalty in (0.5, 1.3, 2.0):
        processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
        expected = processor(torch.tensor(ids), logits.clone())
        histories = [History(tuple(r[:2]), tuple(r[2:])) for r in ids]
        got = penalize(logits, [SamplingParams(repetition_penalty=penalty)] * 3, histories)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rows_without_penalties_are_untouched_and_no_work_without_any() -> None:
    logits = torch.randn(3, 9)
    plain = SamplingParams()
    assert penalize(logits, [plain] * 3, [History((1,), (2,))] * 3) is logits
    got = penalize(logits, [plain, SamplingParams(presence_penalty=1.0), plain],
                   [History((1,), (2,))] * 3)
    assert torch.equal(got[[0, 2]], logits[[0, 2]])
    assert got[1, 2] == logits[1, 2] - 1.0


def test_history_penalties_refuse_tokens_still_being_computed() -> None:
    unknown = History((1,), (2,), num_unknown_tokens=1)
    with pytest.raises(ValueError, match="still being computed"):
        penalize(torch.zeros(1, 4), [SamplingParams(frequency_penalty=1.0)], [unknown])
    # A bias alone needs no history: tokens in flight do not matter to it.
    got = penalize(torch.zeros(1, 4), [SamplingParams(logit_bias={3: 5.0})], [unknown])
    assert got.tolist() == [[0.0, 0.0, 0.0, 5.0]]


def test_only_penalties_that_count_tokens_need_whole_steps() -> None:
    plain = Sequence("a", [1], SamplingParams())
    biased = Sequence("b", [1], SamplingParams(logit_bias={3: 1.0}))
    assert not any_counts_its_tokens([plain, biased])
    for penalty in ({"repetition_penalty": 1.1}, {"frequency_penalty": -0.1},
                    {"presence_penalty": 0.1}):
        penalized = Sequence("c", [1], SamplingParams(**penalty))
        assert any_counts_its_tokens([plain, penalized])


def test_a_sequence_with_a_sample_in_flight_has_unknown_tokens() -> None:
    seq = Sequence("a", [1], SamplingParams(repetition_penalty=1.2))
    seq.pending_sample_ids = [4]  # the step being launched samples this one: all known
    assert seq.num_unknown_tokens == 0
    seq.pending_sample_ids = [3, 4]  # the step in flight has not told its token yet
    with pytest.raises(ValueError, match="still being computed"):
        penalize(torch.zeros(1, 4), [seq.sampling], [seq])


def test_greedy_takes_the_argmax_of_the_penalized_logits() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0]])
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(logit_bias={2: 3.0})]
    histories = [History((0,), ()), History((5,), ())]
    penalized = penalize(logits, params, histories)
    assert sample(penalized, params, [None, None]).tolist() == [1, 2]
    assert probs_from_logits(penalized, params).argmax(dim=-1).tolist() == [1, 2]


def random_tree(rng: random.Random, num_nodes: int, vocab: int) -> tuple[list[int], list[int]]:
    """Parents (each before its child, -1 for the root) and tokens of a random tree."""
    parents = [-1] + [rng.randrange(i) for i in range(1, num_nodes)]
    return parents, [rng.randrange(vocab) for _ in range(num_nodes)]


def path_of(parents: list[int], tokens: list[int], node: int) -> list[int]:
    """The drafts from the root's child down to `node` (root excluded), by parent links."""
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def make_tree(trees: list[tuple[list[int], list[int]]]) -> DraftTree:
    parents = torch.tensor([p for p, _ in trees])
    tokens = torch.tensor([t for _, t in trees])
    depths = torch.tensor([[len(path_of(p, t, i)) for i in range(len(p))] for p, t in trees])
    return DraftTree(token_ids=tokens, parents=parents, depths=depths,
                     tree_mask=tree_mask_from_parents(parents))


def test_path_counts_follow_each_nodes_parent_links() -> None:
    rng = random.Random(2)
    vocab = 6  # few tokens: paths repeat them
    trees = [random_tree(rng, 9, vocab) for _ in range(5)]
    counts = path_counts(make_tree(trees), vocab)
    for b, (parents, tokens) in enumerate(trees):
        for i in range(len(parents)):
            path = path_of(parents, tokens, i)
            assert counts[b, i].tolist() == [float(path.count(v)) for v in range(vocab)]


def test_penalize_tree_is_the_plain_penalty_after_each_nodes_path() -> None:
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    vocab, num_nodes = 7, 8
    trees = [random_tree(rng, num_nodes, vocab) for _ in range(6)]
    trees[0] = ([-1, 0, 1, 2, 3, 4, 5, 6], trees[0][1])  # a chain
    cases = [random_case(rng, vocab) for _ in trees]
    cases[1] = (SamplingParams(), cases[1][1])  # a tree without penalties in the batch
    logits = torch.randn(len(trees), num_nodes, vocab, generator=gen) * 3
    got = penalize_tree(logits, make_tree(trees), [c[0] for c in cases], [c[1] for c in cases])
    for b, ((parents, tokens), (params, h)) in enumerate(zip(trees, cases, strict=True)):
        for i in range(num_nodes):
            extended = History(h.prompt_token_ids,
                               h.output_token_ids + tuple(path_of(parents, tokens, i)))
            expected = reference_penalize(logits[b, i].tolist(), params, extended)
            torch.testing.assert_close(got[b, i], torch.tensor(expected), rtol=1e-6, atol=1e-5)


def test_greedy_acceptance_stops_where_a_penalty_changes_the_argmax() -> None:
    # A chain drafting token 1 three times. The target prefers 1 everywhere by 0.5, but a
    # frequency penalty of 0.3 per earlier 1 makes 0 win once two 1s precede: the history
    # holds one 1, so the first draft is accepted and the second rejected (bonus 0).
    vocab = 3
    logits = torch.tensor([[0.0, 0.5, -5.0]]).repeat(4, 1)[None]  # [1, 4, V]
    tree = make_tree([([-1, 0, 1, 2], [9 % vocab, 1, 1, 1])])
    params = [SamplingParams(frequency_penalty=0.3)]
    target = penalize_tree(logits, tree, params, [History((2,), (1,))])
    acc = accept_tree(tree, target, params, [None])
    assert acc.token_lists() == [[1, 0]]
