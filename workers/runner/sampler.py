"""Sampling: pure torch functions from logits to next tokens, one row per request.

Rows in one batch may carry different `SamplingParams`; every function works on the whole
batch at once. A row with a structured-output constraint first has the tokens its grammar
forbids set to -inf (`apply_token_masks`, one bit per token id: workers/structured/). Then
`penalize` changes the logits of the rows that ask for it, in vLLM's order (transformers
applies the same repetition rule):

    logit_bias:          logits[t] += bias[t]
    repetition_penalty:  for t in prompt or output: logits[t] = logits[t] / r if > 0 else * r
    frequency_penalty:   logits[t] -= f * count of t in the output
    presence_penalty:    logits[t] -= p * (t in the output)

Then the filters, in the order transformers and SGLang use:

    probs = softmax(logits / temperature)
    top-k:  keep every token whose prob is >= the k-th largest (ties at the boundary kept)
    top-p:  renormalize, sort descending; keep the smallest prefix whose sum reaches top_p,
            plus every token tied with the last one kept
    min-p:  keep tokens whose prob is >= min_p * the largest prob
    renormalize over the kept tokens

Ties are kept whole so that the result does not depend on how a sort orders equal values.
The most likely token survives every filter whatever the parameters (a top_p that rounds to
0 in float32 included), so every row keeps some mass and no index goes out of range. Greedy
rows (`SamplingParams.is_greedy`: temperature below 1e-5) are one-hot at the argmax (the
lowest token id among equal maxima).

Logits may hold -inf (masked tokens) and huge finite values; rows with +inf or only -inf
still give finite distributions, and a NaN logit an unspecified but in-range token.

Sampling uses the exponential race (`argmax(probs / q)`, q ~ Exp(1)), which draws from
`probs` exactly and lets each seeded row draw its noise from its own generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specd.ipc.sampling import SamplingParams
from specd.workers.engine.batch import TokenLogprobs
from specd.workers.runner.host_copy import upload


class TokenHistory(Protocol):
    """The tokens a row's penalties count: the prompt's and the generated ones the host
    knows, and how many generated tokens before the sampled one it does not know yet
    (samples of a step still in flight; `workers/engine/sequence.py`'s `Sequence` is one)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def num_unknown_tokens(self) -> int: ...


class _NoHistory:
    """The history of a row whose changes do not depend on it (a logit bias only)."""

    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    num_unknown_tokens = 0


def counted_histories(params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
                      ) -> list[TokenHistory]:
    """Per row, the history its penalties count: its own where it has history penalties
    (ValueError if tokens before the sampled one are still unknown: such a request runs in
    whole steps, see `PlainWorker.can_overlap`), else an empty one."""
    counted: list[TokenHistory] = []
    for p, h in zip(params, histories, strict=True):
        if not p.has_history_penalties:
            counted.append(_NoHistory())
        elif h.num_unknown_tokens:
            raise ValueError(f"penalties need every earlier token on the host; "
                             f"{h.num_unknown_tokens} are still being computed")
        else:
            counted.append(h)
    return counted


def penalize(logits: torch.Tensor, params: Sequence[SamplingParams],
             histories: Sequence[TokenHistory]) -> torch.Tensor:
    """Logits [M, V] with each row's logit_bias and penalties applied (module docstring),
    as float32; `logits` itself when no row changes its logits (nothing else is done then).

    histories: one per row, the tokens that row's penalties count.
    """
    rows = [i for i, p in enumerate(params) if p.changes_logits]
    if not rows:
        return logits
    _check_rows(logits, params, "params")
    _check_rows(logits, histories, "histories")
    counted = counted_histories([params[i] for i in rows], [histories[i] for i in rows])
    prompt_mask, output_counts = history_tensors(counted, logits.shape[1], logits.device)
    index = upload(torch.tensor(rows, dtype=torch.int64), logits.device)
    changed = apply_penalties(logits.float()[index], [params[i] for i in rows], prompt_mask,
                              output_counts)
    return logits.float().index_copy(0, index, changed)


def apply_token_masks(logits: torch.Tensor, rows: torch.Tensor, bitmasks: torch.Tensor
                      ) -> torch.Tensor:
    """Float32 logits [M, V] with row rows[r] keeping only the tokens bitmasks[r] allows, the
    others at -inf: rows int64 [R], bitmasks int32 [R, W] with bit b of word w for token
    32 w + b (llguidance's layout; tokens past 32 W are disallowed). Every other row is
    unchanged. A -inf logit stays -inf through penalties and biases, so masking first or
    last gives the same distribution."""
    if logits.dim() != 2 or bitmasks.dim() != 2 or rows.shape[0] != bitmasks.shape[0]:
        raise ValueError(f"logits [M, V], rows [R] and bitmasks [R, W] expected, got "
                         f"{tuple(logits.shape)}, {tuple(rows.shape)}, {tuple(bitmasks.shape)}")
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmasks.device)
    allowed = ((bitmasks[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]  # [R, <= V]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits = logits.float()
    masked = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)


def history_tensors(histories: Sequence[TokenHistory], vocab_size: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per history: which tokens occur in the prompt, bool [R, V], and how often each occurs
    in the output, float32 [R, V]. Token ids must be in [0, vocab_size)."""
    num_rows = len(histories)
    prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    prompt_rows = [r for r, h in enumerate(histories) for _ in h.prompt_token_ids]
    prompt_ids = [t for h in histories for t in h.prompt_token_ids]
    output_rows = [r for r, h in enumerate(histories) for _ in h.output_token_ids]
    output_ids = [t for h in histories for t in h.output_token_ids]
    if prompt_ids:
        prompt_mask[_ids(prompt_rows, device), _ids(prompt_ids, device)] = True
    if output_ids:
        output_counts.index_put_((_ids(output_rows, device), _ids(output_ids, device)),
                                 torch.ones(len(output_ids), device=device), accumulate=True)
    return prompt_mask, output_counts


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    prompt_mask: torch.Tensor, output_counts: torch.Tensor) -> torch.Tensor:
    """The module docstring's rule on float32 logits [R, V]: prompt_mask bool [R, V] (tokens
    of the prompt), output_counts [R, V] (occurrences in the output), one params per row.
    Returns a new tensor; a row without penalties or biases comes back unchanged."""
    _check_rows(logits, params, "params")
    device = logits.device
    logits = logits.float().clone()
    bias_rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
    if bias_rows:
        bias_ids = [t for p in params for t in p.logit_bias]
        bias = [b for p in params for b in p.logit_bias.values()]
        logits.index_put_((_ids(bias_rows, device), _ids(bias_ids, device)),
                          upload(torch.tensor(bias, dtype=torch.float32), device),
                          accumulate=True)
    values = upload(torch.tensor([[_repetition(p), p.frequency_penalty,
                                   p.presence_penalty] for p in params],
                                 dtype=torch.float32), device)  # [R, 3]
    repetition, frequency, presence = (values[:, i:i + 1] for i in range(3))  # [R, 1] each
    in_output = output_counts > 0  # [R, V]
    penalty = torch.where(prompt_mask | in_output, repetition, 1.0)
    # transformers' rule: shrink positive logits, push negative ones further down (and a
    # logit of exactly 0 stays 0 either way).
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - frequency * output_counts - presence * in_output.float()


def probs_from_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: [M, V] float32, rows sum to 1.

    logits: [M, V] (any float dtype; computed in float32). params: one per row.
    Greedy rows are one-hot at the argmax of the raw logits. In every row the argmax token
    has probability > 0 and every value is finite (for logits without NaN).
    """
    _check_rows(logits, params, "params")
    logits = logits.float()
    # Per-row settings go up through pinned memory (upload): a pageable copy would wait
    # for the step in flight, which overlap scheduling launches this one beside.
    temperature = upload(torch.tensor([_temperature(p) for p in params]), logits.device)
    probs = torch.softmax(_shifted(logits) / temperature[:, None], dim=-1)  # [M, V]
    if any(_filters(p) for p in params if not p.is_greedy):
        probs = _filter(probs, params)
    if any(p.is_greedy for p in params):  # decided on the host: no device sync
        greedy = upload(torch.tensor([p.is_greedy for p in params]), logits.device)  # [M]
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One next token per row: int64 [M].

    Greedy rows take the argmax and draw no random numbers. Other rows sample from
    `probs_from_logits`; a row with a generator draws its noise from it alone (so a seeded
    request gives the same tokens whatever else is in the batch); rows with None share
    `default_generator` (None = torch's global generator).
    """
    _check_rows(logits, generators, "generators")
    if all(p.is_greedy for p in params):
        _check_rows(logits, params, "params")
        return logits.argmax(dim=-1)
    return sample_from_probs(probs_from_logits(logits, params), generators, default_generator)


def sample_from_probs(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of `probs` [M, V] (rows sum to 1): int64 [M].

    Exponential race: with q_i ~ Exp(1) independent, argmax_i p_i / q_i is distributed as p.
    A one-hot row always returns its hot index, so greedy rows may go through here too.
    """
    _check_rows(probs, generators, "generators")
    noise = torch.empty_like(probs, dtype=torch.float32)  # [M, V]
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_(generator=default_generator)
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    # Exp(1) can return exactly 0 (then p / q is inf or nan); the smallest normal float keeps
    # p = 0 tokens at 0 and changes the distribution by less than float32 can represent.
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs.float() / noise).argmax(dim=-1)


def top_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], n: int | Sequence[int],
) -> list[TokenLogprobs]:
    """Log-probabilities of the chosen tokens and the top-n alternatives, per row.

    As vLLM does by default, these are under the model's raw distribution: log_softmax of the
    unmodified logits, before temperature and the top-k/top-p/min-p filters. The top-n are in
    descending order, ties by ascending token id. n is one count for every row or one per row.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, V], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    counts = [n] * num_rows if isinstance(n, int) else list(n)
    if len(counts) != num_rows or any(c < 0 for c in counts):
        raise ValueError(f"n must be >= 0, once or once per row ({num_rows}), got {n}")
    chosen_t, values, indices = top_logprob_tensors(logits, token_ids, max(counts, default=0))
    chosen = chosen_t.tolist()
    top_values, top_ids = values.tolist(), indices.tolist()
    return [
        TokenLogprobs(logprob=chosen[i], top_ids=top_ids[i][:c], top_logprobs=top_values[i][:c])
        for i, c in enumerate(counts)
    ]


def top_logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int],
                        n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_logprobs`' figures left on the device: the chosen tokens' log-probabilities
    [M] and the top-n values and ids [M, min(n, V)] (float32, int64), nothing read on the
    host."""
    num_rows = logits.shape[0]
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=logits.device)
    if ids.shape != (num_rows,):
        raise ValueError(f"token_ids must have shape ({num_rows},), got {tuple(ids.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [M, V]
    chosen = logprobs.gather(1, ids[:, None])[:, 0]
    n = min(n, logits.shape[1])
    if n <= 0:
        return chosen, logprobs.new_empty(num_rows, 0), ids.new_empty(num_rows, 0)
    values, indices = logprobs.sort(dim=-1, descending=True, stable=True)  # [M, V]
    return chosen, values[:, :n], indices[:, :n]


def _temperature(p: SamplingParams) -> float:
    """The divisor of a row's logits: 1 for greedy rows (overwritten by the one-hot), else the
    temperature, at most float32's largest: above it the device would hold inf, and
    -inf / inf is NaN. At that temperature a row is already uniform over its finite logits
    unless they span more than ~1e31, so the bound changes nothing else."""
    return 1.0 if p.is_greedy else min(p.temperature, torch.finfo(torch.float32).max)


def _repetition(p: SamplingParams) -> float:
    """A row's repetition penalty within float32's positive normal range: a value that
    rounded to 0 or inf would turn a masked (-inf) or a 0 logit into NaN (-inf * 0, 0 * inf).
    The bounds change nothing else: past them a seen token is already pushed to 0 or
    +-inf."""
    finfo = torch.finfo(torch.float32)
    return min(max(p.repetition_penalty, finfo.tiny), finfo.max)


def _shifted(logits: torch.Tensor) -> torch.Tensor:
    """Each row minus its largest logit: <= 0, and exactly 0 at the largest, so dividing by
    a temperature cannot overflow and the most likely token keeps weight exp(0) = 1. Also
    exactly 0 where the largest is +inf or the whole row is -inf (inf - inf would be NaN)."""
    largest = logits.amax(dim=-1, keepdim=True)  # [M, 1]
    return torch.where(logits == largest, 0.0, logits - largest)


def _filters(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _filter(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p to `probs` [M, V] and renormalize."""
    num_rows, vocab = probs.shape
    device = probs.device
    top_k = upload(torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]),
                   device)
    top_p = upload(torch.tensor([p.top_p for p in params]), device)
    min_p = upload(torch.tensor([p.min_p for p in params]), device)
    # Sorted descending; stable so that equal probs keep token-id order. [M, V] each.
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)

    kth = sorted_probs.gather(1, (top_k - 1)[:, None])  # [M, 1]
    kept = torch.where(sorted_probs >= kth, sorted_probs, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)

    # Exclusive prefix sums: position i is in the smallest prefix reaching top_p iff the
    # mass before it is < top_p. Rows with top_p = 1 skip this (rounding could drop the tail).
    before = kept.cumsum(dim=-1) - kept
    in_prefix = (before < top_p[:, None]) & (kept > 0)
    # Index of the last kept, [M, 1]; at least 0: a top_p that rounds to 0 in float32
    # (1e-300) leaves the prefix empty, and the most likely token must still be kept.
    last = (in_prefix.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    p_threshold = kept.gather(1, last)
    p_threshold = torch.where(top_p[:, None] >= 1.0, 0.0, p_threshold)
    kept = torch.where(kept >= p_threshold, kept, 0.0)

    m_threshold = min_p[:, None] * kept[:, :1]  # kept[:, 0] is the largest
    kept = torch.where(kept >= m_threshold, kept, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, kept)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 values on the device, through pinned memory (`upload`: a pageable copy would
    wait for the step in flight)."""
    return upload(torch.tensor(values, dtype=torch.int64), device)


def _check_rows(logits: torch.Tensor, per_row: Sequence[object], name: str) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, V], got shape {tuple(logits.shape)}")
    if len(per_row) != logits.shape[0]:
        raise ValueError(
            f"{name} must have one entry per logits row ({logits.shape[0]}), got {len(per_row)}")
