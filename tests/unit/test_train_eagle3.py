"""tools/train_eagle3.py: the training-time-test attention, the draft vocabulary, the output."""

from __future__ import annotations

import pytest
import torch

from specd.workers.spec.draft_config import DraftConfig
from specd.workers.spec.draft_model import DraftHead, load_draft_head
from tools.train_eagle3 import config_json, draft_vocab, save_head, ttt_attention

CFG = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, vocab_size=50, draft_vocab_size=20,
                  target_hidden_size=32, aux_layer_ids=(1, 2, 3))


def test_unrolled_step_attends_to_prefix_and_its_own_ancestors():
    """Row i of step k equals a dense causal pass over [step-0 rows 0..i, row i of steps
    1..k], at positions 0..i, i+1..i+k: what a depth-k draft token sees when serving."""
    torch.manual_seed(0)
    head = DraftHead(CFG, torch.device("cpu"))
    batch, num_rows, num_steps = 2, 6, 3
    embeds = [torch.randn(batch, num_rows, 32) for _ in range(num_steps)]
    hidden = [torch.randn(batch, num_rows, 32) for _ in range(num_steps)]
    rows = torch.arange(num_rows)
    keys, values, outs = [], [], []
    with torch.no_grad():
        for k in range(num_steps):
            q, key, value = head.qkv(embeds[k], hidden[k], (rows + k).expand(batch, -1))
            keys.append(key)
            values.append(value)
            outs.append(head.finish(ttt_attention(q, keys, values, head.scale), hidden[k]))
        for i in range(num_rows):
            e = torch.cat([embeds[0][:, : i + 1]] + [embeds[k][:, i: i + 1] for k in (1, 2)], 1)
            h = torch.cat([hidden[0][:, : i + 1]] + [hidden[k][:, i: i + 1] for k in (1, 2)], 1)
            pos = torch.cat([torch.arange(i + 1), torch.tensor([i + 1, i + 2])])
            ref = head.forward_dense(e, h, pos.expand(batch, -1))
            for k in range(num_steps):
                torch.testing.assert_close(outs[k][:, i], ref[:, i + k], atol=1e-5, rtol=1e-5)


def test_draft_vocab_keeps_the_most_frequent_tokens():
    seqs = torch.tensor([[5, 5, 5, 9, 9, 2, 7, 7, 7, 7]])
    d2t, t2d, coverage = draft_vocab(seqs, 12, 3)
    target_ids = d2t + torch.arange(3)
    assert target_ids.tolist() == [5, 7, 9]  # ascending target ids
    assert t2d.nonzero()[:, 0].tolist() == [5, 7, 9]
    assert coverage == pytest.approx(0.9)


def test_saved_head_has_the_published_layout_and_loads(tmp_path):
    torch.manual_seed(1)
    head = DraftHead(CFG, torch.device("cpu"))
    d2t, t2d, _ = draft_vocab(torch.randint(0, 50, (4, 64)), 50, 20)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    save_head(head, CFG, tmp_path)
    raw = config_json(CFG)
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    # Hidden states 1, 2, 3 are the outputs of blocks 0, 1, 2: the format's ids.
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    assert DraftConfig.from_dict(raw) == CFG
    embed = torch.randn(50, 32)
    loaded = load_draft_head(tmp_path, embed)
    assert torch.equal(loaded.d2t, d2t)
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight.to(torch.bfloat16).float())
