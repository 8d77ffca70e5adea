"""Sampling and acceptance cannot fail on any request the protocol accepts (property tests).

Hypothesis drives the sampler and the speculative acceptance rules over the parameter space
`SamplingParams` accepts, its bounds and float32's extremes included (a top_p of 1e-300 or
5e-324 rounds to 0 in float32, a temperature of 1e-40 to a subnormal, one above 3.4e38 to
inf), and over adversarial logits: masked (-inf) entries, huge finite values, ties, a
vocabulary of one token. The contract checked:

    probs_from_logits: finite, >= 0, rows sum to 1; the argmax token has probability > 0;
        a more likely token never gets less probability; masked tokens get none; greedy
        rows are one-hot at the argmax.
    sample / sample_from_probs: a valid token of positive probability; greedy rows give the
        argmax; the same generators give the same tokens.
    top_logprobs: the top-n in descending order, valid distinct ids, no NaN, the chosen
        token's log-probability finite.
    accept_tree / accept_sampled: a path down the tree, every emitted token of positive
        target probability at its node, greedy trees the plain greedy walk.
    penalize / penalize_tree: no NaN where the logits had none, masked tokens stay masked,
        and what follows (probs_from_logits) is still a distribution, for any repetition
        penalty > 0 (float32 rounds 1e-300 to 0 and 1e300 to inf), frequency and presence
        penalties in [-2, 2] and biases in [-100, 100].

derandomize=True makes the examples a function of the test alone, so CI is reproducible;
database=None keeps hypothesis from writing into the working tree.
"""

from __future__ import annotations

import math
import sys

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.ipc.sampling import (
    GREEDY_TEMPERATURE,
    MAX_INT64,
    MAX_LOGPROBS,
    MAX_UINT64,
    MIN_INT64,
    SamplingParams,
)
from specd.workers.runner.sampler import (
    penalize,
    probs_from_logits,
    sample,
    sample_from_probs,
    top_logprobs,
)
from specd.workers.spec.accept import accept_greedy, accept_sampled, accept_tree, penalize_tree
from specd.workers.spec.tree import DraftTree, tree_mask_from_parents

# Timing is not a property here (the first torch call of a run is slow); max_examples
# bounds the whole file to a few seconds.
PROPERTY = settings(max_examples=50, deadline=None, derandomize=True, database=None)

FLOAT32_MAX = torch.finfo(torch.float32).max
# Positive doubles that float32 turns into 0 or a subnormal.
TINY = [5e-324, 1e-300, 1e-45, 1e-40, 1e-38]

temperatures = st.one_of(
    st.sampled_from([0.0, *TINY, math.nextafter(GREEDY_TEMPERATURE, 0.0), GREEDY_TEMPERATURE,
                     1e-3, 0.7, 1.0, 1e30, 1e38, 3.5e38, 1e300, sys.float_info.max]),
    st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
)
top_ps = st.one_of(st.sampled_from([*TINY, 0.5, 1.0 - 1e-9, 1.0]),
                   st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
min_ps = st.one_of(st.sampled_from([0.0, *TINY, 0.5, 1.0 - 1e-9, 1.0]),
                   st.floats(min_value=0.0, max_value=1.0))
top_ks = st.one_of(st.sampled_from([-1, 0, 1, 2, MAX_INT64]), st.integers(-1, 16))
seeds = st.one_of(st.none(), st.sampled_from([MIN_INT64, -1, 0, MAX_INT64, MAX_UINT64]),
                  st.integers(MIN_INT64, MAX_UINT64))
params_strategy = st.builds(SamplingParams, temperature=temperatures, top_k=top_ks,
                            top_p=top_ps, min_p=min_ps, seed=seeds,
                            logprobs=st.integers(0, MAX_LOGPROBS))
# Duplicates are likely (ties); +-FLOAT32_MAX and 1e38 make differences overflow.
logit_values = st.one_of(
    st.sampled_from([-math.inf, 0.0, 1.0, -1.0, 30.0, -1e4, 1e38, -1e38, FLOAT32_MAX,
                     -FLOAT32_MAX]),
    st.floats(min_value=-100.0, max_value=100.0, width=32),
)


@st.composite
def logits_strategy(draw: st.DrawFn, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 logits of `shape`; every row keeps a finite logit, as a model's row does
    (masking hides tokens, never the whole vocabulary)."""
    vocab = shape[-1]
    rows = []
    for _ in range(math.prod(shape[:-1])):
        row = draw(st.lists(logit_values, min_size=vocab, max_size=vocab))
        if all(x == -math.inf for x in row):
            row[draw(st.integers(0, vocab - 1))] = draw(st.floats(-100.0, 100.0, width=32))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).view(shape)


@st.composite
def batch_strategy(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingParams]]:
    num_rows, vocab = draw(st.integers(1, 4)), draw(st.integers(1, 10))
    params = draw(st.lists(params_strategy, min_size=num_rows, max_size=num_rows))
    return draw(logits_strategy((num_rows, vocab))), params


@st.composite
def tree_strategy(draw: st.DrawFn, batch: int, vocab: int) -> DraftTree:
    """Random trees of 1..6 nodes (the same count per row); a parent of -1 past node 0 is a
    padding node, which no walk may reach."""
    num_nodes = draw(st.integers(1, 6))
    parents, depths = [], []
    for _ in range(batch):
        row = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, num_nodes)]
        parents.append(row)
        depth = [0] * num_nodes
        for i in range(1, num_nodes):
            depth[i] = depth[row[i]] + 1 if row[i] >= 0 else 0
        depths.append(depth)
    token_ids = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=num_nodes,
                                       max_size=num_nodes), min_size=batch, max_size=batch))
    parent_tensor = torch.tensor(parents)
    return DraftTree(token_ids=torch.tensor(token_ids), parents=parent_tensor,
                     depths=torch.tensor(depths), tree_mask=tree_mask_from_parents(parent_tensor))


def generators_for(params: list[SamplingParams]) -> list[torch.Generator | None]:
    """As the model runner builds them: seeded, non-greedy requests get their own."""
    return [None if p.seed is None or p.is_greedy else torch.Generator().manual_seed(p.seed)
            for p in params]


def check_distribution(probs: torch.Tensor) -> None:
    assert probs.dtype == torch.float32
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(probs.shape[:-1]),
                               rtol=0, atol=1e-5)


@PROPERTY
@given(batch_strategy())
def test_probs_are_a_distribution_that_keeps_the_argmax(
        batch: tuple[torch.Tensor, list[SamplingParams]]) -> None:
    logits, params = batch
    probs = probs_from_logits(logits, params)
    check_distribution(probs)
    best = logits.argmax(dim=-1)  # [M]
    assert bool((probs.gather(1, best[:, None]) > 0).all())
    assert bool((probs[logits == -math.inf] == 0).all())
    more_likely = logits[:, :, None] > logits[:, None, :]  # [M, V, V]: token i above token j
    assert not bool((more_likely & (probs[:, :, None] < probs[:, None, :])).any())
    for row, p, b in zip(probs, params, best.tolist(), strict=True):
        if p.is_greedy:
            assert row.tolist() == [1.0 if t == b else 0.0 for t in range(len(row))]


@PROPERTY
@given(batch_strategy())
def test_sampled_tokens_have_positive_probability_and_repeat_with_the_same_generators(
        batch: tuple[torch.Tensor, list[SamplingParams]]) -> None:
    logits, params = batch

    def draw() -> torch.Tensor:
        return sample(logits, params, generators_for(params), torch.Generator().manual_seed(0))

    tokens = draw()
    assert tokens.dtype == torch.int64 and tokens.shape == (len(params),)
    probs = probs_from_logits(logits, params)
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())
    assert torch.equal(draw(), tokens)
    from_probs = sample_from_probs(probs, [None] * len(params), torch.Generator().manual_seed(1))
    assert bool((probs.gather(1, from_probs[:, None]) > 0).all())
    best = logits.argmax(dim=-1)
    for token, p, b in zip(tokens.tolist(), params, best.tolist(), strict=True):
        if p.is_greedy:
            assert token == b


@PROPERTY
@given(batch_strategy())
def test_top_logprobs_are_ordered_valid_and_finite_for_the_chosen_token(
        batch: tuple[torch.Tensor, list[SamplingParams]]) -> None:
    logits, params = batch
    vocab = logits.shape[1]
    tokens = sample(logits, params, generators_for(params), torch.Generator().manual_seed(2))
    results = top_logprobs(logits, tokens, [p.logprobs for p in params])
    best = logits.argmax(dim=-1).tolist()
    for result, p, b in zip(results, params, best, strict=True):
        assert math.isfinite(result.logprob) and result.logprob <= 0
        assert len(result.top_ids) == len(result.top_logprobs) == min(p.logprobs, vocab)
        assert len(set(result.top_ids)) == len(result.top_ids)
        assert all(0 <= t < vocab for t in result.top_ids)
        assert not any(math.isnan(v) or v > 0 for v in result.top_logprobs)
        assert result.top_logprobs == sorted(result.top_logprobs, reverse=True)
        assert result.top_ids[:1] == [b][: len(result.top_ids)]


def check_path(tree: DraftTree, node_lists: list[list[int]], token_lists: list[list[int]],
               probs: torch.Tensor) -> None:
    """Each sequence's accepted nodes go down its tree from the root, and every emitted token
    (drafts then the bonus) has positive target probability [B, T, V] at its parent node."""
    for b, (nodes, tokens) in enumerate(zip(node_lists, token_lists, strict=True)):
        assert len(tokens) == len(nodes) + 1
        current = 0
        for node, token in zip(nodes + [None], tokens, strict=True):
            assert 0 <= token < probs.shape[-1]
            assert float(probs[b, current, token]) > 0
            if node is not None:
                assert int(tree.parents[b, node]) == current
                assert int(tree.token_ids[b, node]) == token
                current = node


@PROPERTY
@given(st.data())
def test_accept_tree_emits_a_valid_path_and_greedy_trees_follow_the_argmax(
        data: st.DataObject) -> None:
    batch, vocab = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8))
    tree = data.draw(tree_strategy(batch, vocab))
    logits = data.draw(logits_strategy((batch, tree.num_nodes, vocab)))
    params = data.draw(st.lists(params_strategy, min_size=batch, max_size=batch))

    def accept() -> tuple[list[list[int]], list[list[int]]]:
        acc = accept_tree(tree, logits, params, generators_for(params),
                          torch.Generator().manual_seed(3))
        return acc.node_lists(), acc.token_lists()

    nodes, tokens = accept()
    node_params = [p for p in params for _ in range(tree.num_nodes)]
    probs = probs_from_logits(logits.view(-1, vocab), node_params).view(logits.shape)
    check_path(tree, nodes, tokens, probs)
    assert accept() == (nodes, tokens)
    greedy = accept_greedy(tree, logits.argmax(dim=-1))
    for b, p in enumerate(params):
        if p.is_greedy:
            assert tokens[b] == greedy.token_lists()[b]


@PROPERTY
@given(st.data())
def test_rejection_sampling_with_adversarial_draft_probabilities_stays_in_the_support(
        data: st.DataObject) -> None:
    """Draft rows that give the drafted token probability 1, 0, or the target's own row
    (where max(p - q, 0) is all zero once a token is rejected)."""
    batch, vocab = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8))
    tree = data.draw(tree_strategy(batch, vocab))
    logits = data.draw(logits_strategy((batch, tree.num_nodes, vocab)))
    params = data.draw(st.lists(params_strategy, min_size=batch, max_size=batch))
    node_params = [p for p in params for _ in range(tree.num_nodes)]
    probs = probs_from_logits(logits.view(-1, vocab), node_params).view(logits.shape)
    one_hot = torch.nn.functional.one_hot(tree.token_ids, vocab).float()  # [B, T, V]
    without = (1.0 - one_hot) / max(vocab - 1, 1)
    parent_rows = probs.gather(1, tree.parents.clamp(min=0)[:, :, None].expand_as(probs))
    kinds = torch.stack([one_hot, without, parent_rows, torch.full_like(probs, 1.0 / vocab)])
    choice = data.draw(st.lists(st.integers(0, 3), min_size=batch * tree.num_nodes,
                                max_size=batch * tree.num_nodes))
    draft_probs = kinds.gather(0, torch.tensor(choice).view(1, batch, -1, 1).expand(
        1, -1, -1, vocab))[0]
    acc = accept_sampled(tree, probs, generators_for(params), draft_probs,
                         torch.Generator().manual_seed(4))
    check_path(tree, acc.node_lists(), acc.token_lists(), probs)


@pytest.mark.parametrize(("field", "last_accepted", "first_refused"), [
    ("temperature", 0.0, -5e-324), ("temperature", sys.float_info.max, math.inf),
    ("top_k", -1, -2), ("top_k", MAX_INT64, MAX_INT64 + 1),
    ("top_p", 5e-324, 0.0), ("top_p", 1.0, math.nextafter(1.0, 2.0)),
    ("min_p", 0.0, -5e-324), ("min_p", 1.0, math.nextafter(1.0, 2.0)),
    ("seed", MIN_INT64, MIN_INT64 - 1), ("seed", MAX_UINT64, MAX_UINT64 + 1),
    ("max_tokens", 1, 0), ("max_tokens", MAX_INT64, MAX_INT64 + 1),
    ("logprobs", 0, -1), ("logprobs", MAX_LOGPROBS, MAX_LOGPROBS + 1),
    ("stop_token_ids", (0,), (-1,)), ("stop_token_ids", (MAX_INT64,), (MAX_INT64 + 1,)),
])
def test_each_bound_is_usable_and_one_past_it_is_refused_naming_the_field(
        field: str, last_accepted: object, first_refused: object) -> None:
    """The bounds are the wire's (msgpack carries int64/uint64) and torch.Generator's."""
    params = SamplingParams(**{field: last_accepted})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    if params.seed is not None:
        torch.Generator().manual_seed(params.seed)
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: first_refused})


repetition_penalties = st.one_of(
    st.sampled_from([*TINY, 0.5, 1.0, 1.3, 1e38, 1e300, sys.float_info.max]),
    st.floats(min_value=0.0, exclude_min=True, allow_infinity=False))


class History(msgspec.Struct, frozen=True):
    """sampler.TokenHistory for the properties below."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_unknown_tokens: int = 0


@st.composite
def penalized_strategy(draw: st.DrawFn, vocab: int) -> tuple[SamplingParams, History]:
    tokens = st.integers(0, vocab - 1)
    params = SamplingParams(
        temperature=draw(temperatures), top_k=draw(top_ks), top_p=draw(top_ps),
        repetition_penalty=draw(repetition_penalties),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        logit_bias=draw(st.dictionaries(tokens, st.floats(-100.0, 100.0), max_size=3)))
    history = History(draw(st.lists(tokens, min_size=1, max_size=6)),
                      draw(st.lists(tokens, max_size=6)))
    return params, history


def check_penalized(logits: torch.Tensor, changed: torch.Tensor) -> None:
    assert not bool(changed.isnan().any())
    assert bool((changed[logits == -math.inf] == -math.inf).all())


@PROPERTY
@given(st.data())
def test_penalized_logits_keep_masks_and_give_distributions(data: st.DataObject) -> None:
    num_rows, vocab = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 10))
    logits = data.draw(logits_strategy((num_rows, vocab)))
    cases = data.draw(st.lists(penalized_strategy(vocab), min_size=num_rows,
                               max_size=num_rows))
    params = [p for p, _ in cases]
    changed = penalize(logits, params, [h for _, h in cases])
    check_penalized(logits, changed)
    check_distribution(probs_from_logits(changed, params))


@PROPERTY
@given(st.data())
def test_penalized_trees_keep_masks_and_accept_tokens_of_positive_probability(
        data: st.DataObject) -> None:
    batch, vocab = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 8))
    tree = data.draw(tree_strategy(batch, vocab))
    logits = data.draw(logits_strategy((batch, tree.num_nodes, vocab)))
    cases = data.draw(st.lists(penalized_strategy(vocab), min_size=batch, max_size=batch))
    params = [p for p, _ in cases]
    changed = penalize_tree(logits, tree, params, [h for _, h in cases])
    check_penalized(logits, changed)
    acc = accept_tree(tree, changed, params, generators_for(params))
    probs = probs_from_logits(changed.flatten(0, 1), [p for p in params
                                                      for _ in range(tree.num_nodes)])
    probs = probs.view(batch, tree.num_nodes, vocab)
    for b, (tokens, nodes) in enumerate(zip(acc.token_lists(), acc.node_lists(), strict=True)):
        at = [0, *nodes]  # the node each emitted token was decided at
        for token, node in zip(tokens, at, strict=True):
            assert float(probs[b, node, token]) > 0
