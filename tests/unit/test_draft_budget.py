"""The draft head's share of the KV budget (workers/spec/draft_budget.py): its weights counted
from its checkpoint (the token embedding only when it has its own), its draft loops' graphs by
a trial capture, and the engine's blocks bought after both."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from specd.workers.config import FIXTURE_DIR, FIXTURE_DRAFT_DIR, EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.runner import model_runner
from specd.workers.runner.graphs import capture_sizes
from specd.workers.runner.kv_cache import DeviceMemory
from specd.workers.spec.draft_budget import head_weight_bytes, measure_draft_loop_bytes
from specd.workers.spec.draft_graphs import prefix_widths
from specd.workers.spec.draft_model import load_draft_head
from specd.workers.spec.head_files import read_draft_config


def _loaded_bytes(root: Path, dtype: torch.dtype, embedding: torch.Tensor) -> int:
    """Bytes of the loaded head's parameters that are not the target's embedding."""
    head = load_draft_head(root, embedding, dtype=dtype)
    return sum(p.nbytes for p in head.parameters() if p.data_ptr() != embedding.data_ptr())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_are_the_loaded_heads_own(dtype: torch.dtype, tmp_path: Path) -> None:
    cfg = read_draft_config(FIXTURE_DRAFT_DIR)
    embedding = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    # The fixture's head shares the target's embedding: its bytes are left out.
    assert head_weight_bytes(cfg, FIXTURE_DRAFT_DIR, dtype) == _loaded_bytes(
        FIXTURE_DRAFT_DIR, dtype, embedding)
    # A head with its own embedding pays for it.
    own = tmp_path / "own"
    shutil.copytree(FIXTURE_DRAFT_DIR, own)
    tensors = load_file(own / "model.safetensors")
    tensors["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    save_file(tensors, own / "model.safetensors")
    with_embedding = head_weight_bytes(cfg, own, dtype)
    assert with_embedding == _loaded_bytes(own, dtype, embedding)
    assert with_embedding - head_weight_bytes(cfg, FIXTURE_DRAFT_DIR, dtype) == (
        cfg.vocab_size * cfg.hidden_size * embedding.element_size())


def test_the_trial_measures_the_largest_draft_loop_shape() -> None:
    """On the CPU the stand-in takes no pool: the trial is the static inputs of the largest
    (batch, prefix width) shape, as the engine's own DraftGraphs reports them."""
    cfg = read_draft_config(FIXTURE_DRAFT_DIR)
    batch, width = max(capture_sizes(6)), max(prefix_widths(300))
    got = measure_draft_loop_bytes(cfg, 2, 3, 6, 6, 300, 16, torch.float32,
                                   torch.device("cpu"))
    static = batch * (cfg.hidden_size * 4 + width * (8 + 1) + 8 + 8)
    assert got == static


def test_the_engine_buys_its_blocks_after_the_heads_share(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """With graphs on (the CPU stand-in) the draft loops' graphs come out of the budget, and
    on a device-rule budget the head's weights too: the blocks bought, the target's and the
    head's K/V, and every graph fit the budget."""
    weights: list[int] = []

    def fake_memory(self: Any, rows: int) -> DeviceMemory:  # a device rule on the CPU
        return DeviceMemory(total_bytes=2**30, free_bytes=96 * 2**20, activation_peak_bytes=0)

    real_init = model_runner.ModelRunner.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        weights.append(kwargs.get("draft_weight_bytes", 0))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(model_runner.ModelRunner, "_device_memory", fake_memory)
    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy)
    cores = {graphs: EngineCore(EngineConfig(model=str(FIXTURE_DIR), draft_model=str(
        FIXTURE_DRAFT_DIR), cuda_graphs=graphs, max_num_seqs=4, spec_mode="on"))
        for graphs in (False, True)}
    for graphs, core in cores.items():
        runner, spec = core.runner, core.spec
        assert spec is not None
        budget = runner.kv_budget.num_bytes
        caches = sum(c.nbytes for c in runner.kv_caches) + spec.draft_kv.nbytes
        used = caches + spec.graph_memory_bytes + weights[0]
        assert used <= budget, (graphs, used, budget)
        # Less than one block of the budget is left over.
        block = (runner.kv_caches[0][:, :1].nbytes * len(runner.kv_caches)
                 + spec.draft_kv[:, :1].nbytes)
        assert budget - used < block + (block if graphs else 0)  # graphs: their pad block
    assert weights[0] == weights[1] > 0
    assert cores[True].runner.num_kv_blocks < cores[False].runner.num_kv_blocks


def test_an_mla_heads_share_is_counted_over_its_latent_cache(tmp_path: Path) -> None:
    """The MLA draft head (one DeepSeek layer, a latent draft cache): its trial runs over the
    latent layout and its weights count as the loaded head's own."""
    from tests.unit.test_draft_mla import mla_config, mla_tensors, save, target_embedding

    root = save(tmp_path / "mla", mla_tensors(), mla_config())
    cfg = read_draft_config(root)
    assert cfg.mla_layer is not None
    embedding = target_embedding()
    assert head_weight_bytes(cfg, root, torch.float32) == _loaded_bytes(
        root, torch.float32, embedding)
    got = measure_draft_loop_bytes(cfg, 2, 3, 6, 2, 100, 16, torch.float32,
                                   torch.device("cpu"))
    assert got == 2 * (cfg.hidden_size * 4 + 128 * (8 + 1) + 8 + 8)  # batch 2, width 128
