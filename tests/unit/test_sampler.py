"""The sampler against brute force: filters by enumeration, sampling by a chi-square test.

The reference states each filter per token, by enumerating the vocabulary, which is a
different formulation from the sorted prefix sums in the implementation:
    top-k keeps t iff fewer than k tokens are strictly more probable than t;
    top-p keeps t iff the (renormalized) mass of tokens strictly more probable than t is < p;
    min-p keeps t iff p_t >= min_p * max_j p_j.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.runner.sampler import probs_from_logits, sample, sample_from_probs, top_logprobs


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """The filtered distribution, in float64, by enumeration over the vocabulary."""
    vocab = range(len(logits))
    if p.is_greedy:
        best = max(vocab, key=lambda t: (logits[t], -t))  # lowest id among equal maxima
        return [1.0 if t == best else 0.0 for t in vocab]
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    probs = _normalize([math.exp(x - top) for x in scaled])
    if p.top_k > 0:
        probs = _normalize([
            q if sum(1 for r in probs if r > q) < p.top_k else 0.0 for q in probs])
    probs = _normalize([
        q if q > 0 and sum(r for r in probs if r > q) < p.top_p else 0.0 for q in probs])
    largest = max(probs)
    return _normalize([q if q >= p.min_p * largest else 0.0 for q in probs])


def _normalize(values: list[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values]


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.3, 1.0, 1.7]),
        top_k=rng.choice([-1, 0, 1, 2, 3, 5, 20]),
        top_p=rng.choice([1.0, 0.9, 0.5, 0.2, rng.uniform(0.05, 1.0)]),
        min_p=rng.choice([0.0, 0.0, 0.1, 0.3, rng.uniform(0.0, 0.9)]),
    )


def test_probs_match_enumeration_for_mixed_rows() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 2, 5, 8, 13):
        params = [random_params(rng) for _ in range(64)]
        logits = torch.randn(len(params), vocab, generator=gen) * 3
        probs = probs_from_logits(logits, params)
        expected = torch.tensor(
            [reference_probs(row, p) for row, p in zip(logits.tolist(), params, strict=True)],
            dtype=torch.float64)
        assert probs.dtype == torch.float32
        torch.testing.assert_close(probs.double(), expected, rtol=0, atol=1e-6)


def test_ties_at_a_filter_boundary_are_kept_whole() -> None:
    # Equal logits give bitwise-equal probabilities, so ties here are exact.
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0]] * 3)
    params = [
        SamplingParams(temperature=1.0, top_k=1),  # two tokens share the largest logit
        SamplingParams(temperature=1.0, top_k=3),  # the 3rd and 4th largest are tied
        SamplingParams(temperature=1.0, top_p=0.01),  # the first token alone reaches p
    ]
    probs = probs_from_logits(logits, params)
    assert probs[0].tolist() == pytest.approx([0, 0.5, 0, 0.5, 0])
    assert (probs[1] > 0).tolist() == [False, True, True, True, True]
    assert probs[2].tolist() == pytest.approx([0, 0.5, 0, 0.5, 0])
    for row, p, got in zip(logits.tolist(), params, probs, strict=True):
        assert got.tolist() == pytest.approx(reference_probs(row, p), abs=1e-6)


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 5.0, 5.0]])
    params = [SamplingParams(temperature=0.0)] * 2
    gen = torch.Generator().manual_seed(1)
    state = gen.get_state()
    assert sample(logits, params, [gen, None]).tolist() == [1, 0]
    assert torch.equal(gen.get_state(), state), "greedy rows must draw no random numbers"
    assert probs_from_logits(logits, params).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_min_p_is_relative_to_the_largest_probability() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probs_from_logits(logits, [SamplingParams(temperature=1.0, min_p=0.5)])
    assert probs[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def chi_square_p_value(counts: list[int], expected: list[float]) -> float:
    """Pearson's goodness-of-fit test over the support of `expected`: P(X^2 >= observed)."""
    total = sum(counts)
    support = [i for i, e in enumerate(expected) if e > 0]
    stat = sum((counts[i] - total * expected[i]) ** 2 / (total * expected[i]) for i in support)
    dof = len(support) - 1
    if dof == 0:
        return 1.0
    # The chi-square survival function is the regularized upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2, top_k=4),
])
def test_empirical_frequencies_match_the_filtered_distribution(params: SamplingParams) -> None:
    """20,000 draws; the chi-square test must not reject at the 0.1% level (fixed seeds, so
    the outcome is deterministic), and filtered-out tokens must never be drawn."""
    logits = torch.tensor([1.0, 0.2, -0.5, 0.9, 0.0, -2.0])
    num_draws = 20_000
    batch = logits.expand(num_draws, -1)
    tokens = sample(batch, [params] * num_draws, [None] * num_draws,
                    default_generator=torch.Generator().manual_seed(1234))
    counts = torch.bincount(tokens, minlength=logits.numel()).tolist()
    expected = reference_probs(logits.tolist(), params)
    assert all(c == 0 for c, e in zip(counts, expected, strict=True) if e == 0)
    assert chi_square_p_value(counts, expected) > 1e-3


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))

    def draw(batch_size: int, row: int) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        tokens = []
        for _ in range(20):
            batch = logits.expand(batch_size, -1)
            gens: list[torch.Generator | None] = [None] * batch_size
            gens[row] = gen
            tokens.append(int(sample(batch, [params] * batch_size, gens)[row]))
        return tokens

    alone = draw(1, 0)
    assert draw(1, 0) == alone
    assert draw(5, 3) == alone, "other rows must not disturb a seeded row's draws"
    other = torch.Generator().manual_seed(8)
    different = [int(sample(logits, [params], [other])[0]) for _ in range(20)]
    assert different != alone


def test_sample_from_probs_returns_the_hot_index_of_one_hot_rows() -> None:
    probs = torch.eye(7)[[3, 0, 6]]
    assert sample_from_probs(probs, [None, None, None]).tolist() == [3, 0, 6]


def test_top_logprobs_use_the_raw_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 2.0, -1.0], [0.0, 0.5, 0.25, 3.0]])
    raw = torch.log_softmax(logits, dim=-1)
    result = top_logprobs(logits, torch.tensor([1, 3]), [2, 0])
    assert result[0].logprob == pytest.approx(float(raw[0, 1]))
    assert result[0].top_ids == [0, 2]  # tied: ascending token id
    assert result[0].top_logprobs == pytest.approx([float(raw[0, 0]), float(raw[0, 2])])
    assert result[1].logprob == pytest.approx(float(raw[1, 3]))
    assert result[1].top_ids == [] and result[1].top_logprobs == []
    assert [r.top_ids for r in top_logprobs(logits, [0, 0], 10)] == [[0, 2, 1, 3], [3, 1, 2, 0]]


def test_bad_shapes_name_the_argument() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="params"):
        probs_from_logits(logits, [SamplingParams()])
    with pytest.raises(ValueError, match="generators"):
        sample(logits, [SamplingParams()] * 2, [None])
    with pytest.raises(ValueError, match=r"logits must be \[M, V\]"):
        probs_from_logits(torch.zeros(4), [SamplingParams()])
    with pytest.raises(ValueError, match="token_ids"):
        top_logprobs(logits, [1, 2, 3], 1)


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token_and_its_ties() -> None:
    # 1e-300 is 0 in float32: no prefix "reaches" it, yet the most likely token must remain.
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0]])
    for top_p in (1e-300, 5e-324):
        params = [SamplingParams(temperature=0.7, top_p=top_p)]
        assert probs_from_logits(logits, params)[0].tolist() == [0.0, 0.5, 0.0, 0.5]
        assert int(sample(logits, params, [None])[0]) in (1, 3)


def test_temperatures_below_1e_minus_5_are_greedy_with_or_without_filters() -> None:
    logits = torch.tensor([[0.1, 0.3, 0.2, 0.3, -0.5]])
    for params in (SamplingParams(temperature=1e-40),
                   SamplingParams(temperature=1e-40, top_k=5),
                   SamplingParams(temperature=9.9e-6, top_p=0.5, min_p=0.5)):
        assert params.is_greedy
        gen = torch.Generator().manual_seed(0)
        state = gen.get_state()
        assert sample(logits, [params], [gen]).tolist() == [1]  # lowest id among the maxima
        assert torch.equal(gen.get_state(), state), "greedy rows draw no random numbers"
        assert probs_from_logits(logits, [params]).tolist() == [[0, 1, 0, 0, 0]]
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_extreme_logits_and_temperatures_give_finite_distributions() -> None:
    inf, big = math.inf, torch.finfo(torch.float32).max
    logits = torch.tensor([
        [big, -big, 0.0, -inf],  # logit / temperature and logit - max overflow
        [inf, 1.0, inf, -inf],  # a +inf logit takes all the mass, shared among ties
        [-inf, -inf, -inf, -inf],  # nothing to prefer: uniform, but finite
        [1e4, 0.0, -1e4, -inf],  # a huge temperature: uniform over the unmasked tokens
    ])
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1e300)]
    probs = probs_from_logits(logits, params)
    assert probs.tolist() == [
        [1.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0], [0.25] * 4, pytest.approx([1 / 3] * 3 + [0])]
    tokens = sample(logits, params, [None] * 4)
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())
