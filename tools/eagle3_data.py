"""The training data of tools/train_eagle3.py: sequences, which of their positions are
trained on, and what the target computed over them, restricted to the draft vocabulary.

Sequences are kept flat, one after another (`TrainData.offsets`), and padded only when a
batch is drawn (`TrainData.batch`), so that chat answers of a few to a few hundred tokens
cost what they hold. Per position the target's outputs are its hidden states at the head's
aux layers (bf16 [3H]), its logits over the draft vocabulary (bf16 [Vd]) and its argmax over
the whole vocabulary; the full logits are dropped batch by batch (`target_outputs`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TrainData:
    """Sequence n is rows offsets[n]:offsets[n + 1] of every per-position tensor.

    tokens int64 [T]; loss_mask bool [T]: the target's distribution at the position (its
    prediction of the next token) is trained on; aux bf16 [T, 3H], draft_logits bf16
    [T, Vd] and target_top int64 [T] are the target's outputs, or all None when the
    target runs in the training loop instead (`--data text`).
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor | None
    draft_logits: torch.Tensor | None
    target_top: torch.Tensor | None

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    @property
    def has_target_outputs(self) -> bool:
        return self.aux is not None

    def batch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sequences `idx`, right-padded to the longest: tokens [B, S] (pad 0), loss_mask
        [B, S] (False on padding) and, when kept, aux [B, S, 3H], draft_logits [B, S, Vd],
        target_top [B, S] (zeros on padding). Causal attention keeps padding out of every
        real row."""
        starts, ends = self.offsets[idx], self.offsets[idx + 1]
        length = int((ends - starts).max())
        rows = starts[:, None] + torch.arange(length)[None]  # [B, S]
        real = rows < ends[:, None]
        rows = torch.where(real, rows, starts[:, None])  # any real row; masked below
        out = {"tokens": torch.where(real, self.tokens[rows], 0),
               "loss_mask": self.loss_mask[rows] & real}
        for name in ("aux", "draft_logits", "target_top"):
            value = getattr(self, name)
            if value is not None:
                picked = value[rows]
                fill = real.view(*real.shape, *([1] * (picked.dim() - 2)))
                out[name] = picked * fill.to(picked.dtype)
        return out


def from_dense(tokens: torch.Tensor, aux: torch.Tensor | None, logits: torch.Tensor | None,
               draft_ids: torch.Tensor) -> TrainData:
    """Equal-length sequences tokens [N, S] with the target's outputs over them (aux
    [N, S, 3H], full logits [N, S, V], or both None), every position trained on."""
    num, length = tokens.shape
    offsets = torch.arange(num + 1) * length
    mask = torch.ones(num * length, dtype=torch.bool)
    if aux is None or logits is None:
        return TrainData(tokens.flatten(), offsets, mask, None, None, None)
    return TrainData(tokens.flatten(), offsets, mask, aux.flatten(0, 1),
                     logits[..., draft_ids].flatten(0, 1), logits.argmax(-1).flatten())


def read_sequences(path: Path, max_len: int) -> tuple[list[list[int]], list[int]]:
    """(sequences, prompt lengths) from JSON lines with prompt_ids and answer_ids (as
    tools/chat_answers.py writes), each prompt + answer cut to `max_len` tokens; lines whose
    answer would be cut away entirely are skipped."""
    seqs, prompt_lens = [], []
    for line in path.read_text().splitlines():
        if not line:
            continue
        row = json.loads(line)
        prompt, answer = list(row["prompt_ids"]), list(row["answer_ids"])
        if len(prompt) + 1 >= max_len or not answer:
            continue
        seqs.append((prompt + answer)[:max_len])
        prompt_lens.append(len(prompt))
    if not seqs:
        raise ValueError(f"{path}: no sequence with an answer")
    return seqs, prompt_lens


def answer_mask(length: int, prompt_len: int) -> torch.Tensor:
    """bool [length]: the positions whose next token is an answer token (prompt_len - 1
    through length - 2); the last position predicts nothing in the sequence."""
    mask = torch.zeros(length, dtype=torch.bool)
    mask[prompt_len - 1: length - 1] = True
    return mask


@torch.no_grad()
def target_outputs(target, seqs: list[list[int]], aux_ids: tuple[int, ...],
                   draft_ids: torch.Tensor, batch_tokens: int, device: str,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's outputs over every position of `seqs`, flat in their order: aux bf16
    [T, 3H], draft_logits bf16 [T, Vd], target_top int64 [T]. One uncached forward per
    batch of similar lengths (about `batch_tokens` tokens padded); right padding is causal
    and so changes no real position."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    per_seq: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    t0, done, i = time.time(), 0, 0
    while i < len(order):
        length = len(seqs[order[i]])
        j = i + 1
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= batch_tokens:
            j += 1
        group = order[i:j]
        length = len(seqs[group[-1]])
        ids = torch.zeros(len(group), length, dtype=torch.long)
        for row, n in enumerate(group):
            ids[row, : len(seqs[n])] = torch.tensor(seqs[n])
        out = target(input_ids=ids.to(device), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[k] for k in aux_ids], dim=-1).to(torch.bfloat16)
        draft_logits = out.logits[..., draft_ids.to(device)].to(torch.bfloat16)
        top = out.logits.argmax(-1)
        for row, n in enumerate(group):
            size = len(seqs[n])
            per_seq[n] = (aux[row, :size].cpu(), draft_logits[row, :size].cpu(),
                          top[row, :size].cpu())
        done += sum(len(seqs[n]) for n in group)
        i = j
        print(f"target outputs: {done} positions, {len(per_seq)}/{len(seqs)} sequences "
              f"({time.time() - t0:.0f}s)", flush=True)
    parts = [per_seq[n] for n in range(len(seqs))]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
            torch.cat([p[2] for p in parts]))


def file_data(target, seqs: list[list[int]], prompt_lens: list[int], aux_ids: tuple[int, ...],
              draft_ids: torch.Tensor, batch_tokens: int, device: str) -> TrainData:
    """Chat sequences with the target's outputs over them, trained on the answers only."""
    lengths = torch.tensor([len(s) for s in seqs])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    mask = torch.cat([answer_mask(len(s), p) for s, p in zip(seqs, prompt_lens, strict=True)])
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    aux, draft_logits, top = target_outputs(target, seqs, aux_ids, draft_ids, batch_tokens,
                                            device)
    return TrainData(tokens, offsets, mask, aux, draft_logits, top)


FEATURE_FIELDS = ("tokens", "offsets", "loss_mask", "aux", "draft_logits", "target_top")


def save_features(path: Path, data: TrainData, d2t: torch.Tensor) -> None:
    """Write `data` (with the target's outputs) and the draft vocabulary it was restricted
    to, for a rerun on the same sequences (`load_features`)."""
    torch.save({**{name: getattr(data, name) for name in FEATURE_FIELDS}, "d2t": d2t}, path)


def load_features(path: Path, seqs: list[list[int]], d2t: torch.Tensor) -> TrainData:
    """The data `save_features` wrote; ValueError unless it was made from these sequences
    and this draft vocabulary."""
    saved = torch.load(path, weights_only=True)
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    if not torch.equal(saved["tokens"], tokens) or not torch.equal(saved["d2t"], d2t):
        raise ValueError(f"{path}: made from other sequences or another draft vocabulary")
    return TrainData(*(saved[name] for name in FEATURE_FIELDS))
