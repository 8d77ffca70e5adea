"""tools/eagle3_data.py and tools/chat_prompts.py: the head's training data, flat and padded
per batch, trained on answers only; the offline chat questions and their split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tools.chat_prompts import is_heldout, questions
from tools.eagle3_data import (
    TrainData,
    answer_mask,
    from_dense,
    load_features,
    read_sequences,
    save_features,
)


def test_a_batch_pads_to_its_longest_sequence_and_masks_the_padding() -> None:
    lengths = [3, 5, 2]
    offsets = torch.tensor([0, 3, 8, 10])
    tokens = torch.arange(10) + 100
    aux = torch.arange(10, dtype=torch.float32)[:, None].expand(10, 4).to(torch.bfloat16)
    data = TrainData(tokens, offsets, torch.ones(10, dtype=torch.bool), aux,
                     torch.ones(10, 6, dtype=torch.bfloat16), torch.arange(10) + 7)
    batch = data.batch(torch.tensor([2, 0, 1]))
    assert batch["tokens"].tolist() == [[108, 109, 0, 0, 0], [100, 101, 102, 0, 0],
                                        [103, 104, 105, 106, 107]]
    real = [[True, True, False, False, False], [True, True, True, False, False], [True] * 5]
    assert batch["loss_mask"].tolist() == real
    assert batch["aux"][0, :, 0].tolist() == [8, 9, 0, 0, 0]
    assert batch["draft_logits"].shape == (3, 5, 6)
    assert batch["draft_logits"][1, 3:].abs().sum() == 0
    assert batch["target_top"][2].tolist() == [10, 11, 12, 13, 14]
    assert [int(m.sum()) for m in batch["loss_mask"]] == [lengths[2], lengths[0], lengths[1]]


def test_dense_data_restricts_the_logits_and_keeps_every_position() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 9, (2, 4))
    logits = torch.randn(2, 4, 9)
    draft_ids = torch.tensor([1, 4, 6])
    data = from_dense(tokens, torch.randn(2, 4, 3), logits, draft_ids)
    batch = data.batch(torch.tensor([1]))
    assert torch.equal(batch["tokens"], tokens[1:])
    assert torch.equal(batch["draft_logits"], logits[1:, :, draft_ids])
    assert torch.equal(batch["target_top"], logits[1:].argmax(-1))
    assert bool(batch["loss_mask"].all())
    assert not from_dense(tokens, None, None, draft_ids).has_target_outputs


def test_only_positions_that_predict_an_answer_token_are_trained() -> None:
    # prompt of 3 tokens (0..2), answer of 4 (3..6): positions 2..5 predict tokens 3..6.
    assert answer_mask(7, 3).nonzero()[:, 0].tolist() == [2, 3, 4, 5]


def test_sequences_are_cut_and_answerless_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "answers.jsonl"
    rows = [{"prompt_ids": [1, 2, 3], "answer_ids": [4, 5, 6, 7, 8]},
            {"prompt_ids": [1, 2, 3, 4, 5, 6], "answer_ids": [7]},  # prompt fills the cut
            {"prompt_ids": [9], "answer_ids": []}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seqs, prompt_lens = read_sequences(path, max_len=6)
    assert seqs == [[1, 2, 3, 4, 5, 6]]
    assert prompt_lens == [3]


def test_the_chat_splits_are_disjoint_deterministic_and_cover_every_family() -> None:
    train, heldout = questions("train"), questions("heldout")
    assert questions("train") == train
    train_text = {r["question"] for r in train}
    assert not train_text & {r["question"] for r in heldout}
    assert all(is_heldout(r["question"]) for r in heldout)
    families = {"stdlib", "arithmetic", "knowledge", "coding"}
    assert {r["family"] for r in train[:8]} == families  # interleaved: any prefix is mixed
    assert {r["family"] for r in heldout} == families


def test_saved_target_outputs_load_only_for_the_same_sequences_and_vocabulary(
        tmp_path: Path) -> None:
    seqs = [[1, 2, 3], [4, 5]]
    data = TrainData(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 3, 5]),
                     torch.tensor([False, True, False, True, False]),
                     torch.randn(5, 6).to(torch.bfloat16), torch.randn(5, 2).to(torch.bfloat16),
                     torch.tensor([2, 3, 0, 5, 0]))
    d2t = torch.tensor([1, 1])
    save_features(tmp_path / "f.pt", data, d2t)
    loaded = load_features(tmp_path / "f.pt", seqs, d2t)
    assert all(torch.equal(getattr(loaded, n), getattr(data, n))
               for n in ("tokens", "offsets", "loss_mask", "aux", "draft_logits", "target_top"))
    with pytest.raises(ValueError, match="other sequences"):
        load_features(tmp_path / "f.pt", [[1, 2, 3], [4, 6]], d2t)
    with pytest.raises(ValueError, match="draft vocabulary"):
        load_features(tmp_path / "f.pt", seqs, torch.tensor([1, 2]))
