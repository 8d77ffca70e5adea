"""One step's tensors, built from a `ScheduledBatch` (plain data from the scheduler).

`prepare_inputs` lays the scheduled tokens out sequence by sequence in batch order and builds
their rope positions and attention metadata. The model runner and its backends build plain
steps with it; the speculative worker builds verify steps itself (tree positions and masks)
into the same `StepInputs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd.workers.engine.batch import ScheduledBatch
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.engine.sequence import placeholder_token_id
from specd.workers.runner.attention import AttentionMetadata, build_attention_metadata
from specd.workers.runner.decode_stage import DecodeStage
from specd.workers.runner.host_copy import upload


@dataclass(frozen=True)
class StepInputs:
    """One step's tensors. Tokens are laid out sequence by sequence in batch order.

    input_ids, positions: int64 [N]; meta: the attention metadata shared by all layers;
    sample_rows: int64 [M], the last row of each sequence that samples this step;
    sample_seqs: those M sequences, in the same order; sample_ids: their sample ids;
    num_placeholders: how many input ids are placeholders of in-flight samples (negative).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    sample_seqs: list[Seq]
    sample_ids: list[int] = field(default_factory=list)
    num_placeholders: int = 0


def prepare_inputs(batch: ScheduledBatch, block_size: int, device: torch.device,
                   stage: DecodeStage | None = None) -> StepInputs:
    """Build token ids, rope positions and attention metadata for `batch`.

    Sequence b computes tokens [start, end) of `prompt + output + spec_token_ids` (drafts as a
    chain: position = index); its KV goes to the slots of `seq.block_ids`. `stage`: the CPU
    backend's kept decode K/V, planned here for this step's decode group.
    """
    token_ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[Seq] = []
    sample_ids: list[int] = []
    num_placeholders = 0
    for s in batch.scheduled:
        token_ids += token_slice(s.seq, s.start, s.end)
        positions += range(s.start, s.end)
        known = s.seq.num_tokens + len(s.seq.spec_token_ids)
        num_placeholders += max(0, s.end - max(s.start, known))
        if s.needs_sample:
            sample_rows.append(len(token_ids) - 1)
            sample_seqs.append(s.seq)
            sample_ids.append(-1 if s.sample_id is None else s.sample_id)
    meta = build_attention_metadata(
        query_lens=[s.num_new_tokens for s in batch.scheduled],
        seq_lens=[s.end for s in batch.scheduled],
        block_tables=[s.seq.block_ids for s in batch.scheduled],
        block_size=block_size,
        device=device,
        stage=stage,
    )
    return StepInputs(
        input_ids=upload(torch.tensor(token_ids, dtype=torch.int64), device),
        positions=upload(torch.tensor(positions, dtype=torch.int64), device),
        meta=meta,
        sample_rows=upload(torch.tensor(sample_rows, dtype=torch.int64), device),
        sample_seqs=sample_seqs,
        sample_ids=sample_ids,
        num_placeholders=num_placeholders,
    )


def token_slice(seq: Seq, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output + drafts, without concatenating whole lists."""
    # Drafts and placeholders never meet: a sequence with a pending sample gets no drafts
    # the host knows (those come from whole steps, which run with nothing in flight), and a
    # step that verifies drafts does not read the placeholder of its own sample.
    placeholders = [placeholder_token_id(i) for i in seq.pending_sample_ids]
    parts = (seq.prompt_token_ids, seq.output_token_ids, seq.spec_token_ids, placeholders)
    out: list[int] = []
    offset = 0
    for part in parts:
        lo, hi = max(start - offset, 0), min(end - offset, len(part))
        if lo < hi:
            out += part[lo:hi]
        offset += len(part)
    if len(out) != end - start:
        raise ValueError(f"request {seq.request_id}: tokens [{start}, {end}) scheduled but it "
                         f"has only {offset}")
    return out
