"""No host sync in what a GPU captures: the target's decode and verify forwards (dense and
MoE fixtures, expert parallelism off and on) and the draft loop, run on the GPU's code path
(the Triton kernels under the interpreter, tests/integration/host_sync.py) under a dispatch
mode that fails on any op that makes the host wait for the device. The detector itself is
checked op by op, so a pass means the forwards have none of them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.models.linear_factory import linear_factory
from specd.workers.models.loader import load_model
from specd.workers.parallel.context import ParallelContext
from specd.workers.parallel.sharding import shard_model_config
from specd.workers.runner.attention import build_attention_metadata
from specd.workers.runner.kv_cache import allocate_kv_cache
from specd.workers.spec.draft_graphs import DraftInputs
from tests.integration.host_sync import HostSyncError, gpu_code_path, no_host_sync

DTYPE = torch.bfloat16  # what the GPU runs: the kernels' half-precision paths
BLOCK_SIZE = 16


# ----------------------------------------------------------------------------- the detector


def _syncing_ops() -> dict[str, Any]:
    x = torch.tensor([0.0, 1.5, -2.0, 3.0])
    counts = torch.tensor([1, 0, 2, 1])
    return {
        "nonzero": lambda: x.nonzero(),
        "item": lambda: x[1].item(),
        "int()": lambda: int(counts[0]),
        "bool()": lambda: bool(x[1] > 0),
        "tolist": lambda: counts.tolist(),
        "cpu": lambda: x.cpu(),
        "numpy": lambda: x.numpy(),
        "bincount": lambda: torch.bincount(counts),
        "unique": lambda: torch.unique(counts),
        "unique_consecutive": lambda: torch.unique_consecutive(counts),
        "repeat_interleave": lambda: torch.repeat_interleave(counts),
        "repeat_interleave self": lambda: x.repeat_interleave(counts),
        "mask index": lambda: x[x > 0],
        "mask index_put": lambda: x.clone().index_put_((x > 0,), torch.tensor(0.0)),
        "mask setitem": lambda: x.clone().__setitem__(x > 0, 0.0),
        "masked_select": lambda: x.masked_select(x > 0),
        "equal": lambda: torch.equal(x, x),
        "argwhere": lambda: torch.argwhere(x),
    }


@pytest.mark.parametrize("name", list(_syncing_ops()))
def test_the_detector_fails_each_syncing_op(name: str) -> None:
    op = _syncing_ops()[name]
    with pytest.raises(HostSyncError, match="host sync"), no_host_sync():
        op()
    op()  # outside the block it runs


def test_the_detector_passes_fixed_shape_ops() -> None:
    x = torch.randn(6, 4)
    ids = torch.tensor([3, 0, 3, 1, 2, 0])
    with no_host_sync():
        torch.topk(x, 2, dim=-1)
        torch.argsort(ids, stable=True)
        x.index_select(0, ids)
        x[ids]
        torch.zeros(4, 4).index_add_(0, ids[:4], x[:4])
        x.masked_fill(x > 0, 0.0)
        torch.where(x > 0, x, 0.0)
        ids.repeat_interleave(2)
        torch.repeat_interleave(ids, ids.clamp(max=1), output_size=4)
        torch.zeros(4, dtype=torch.int64).scatter_add_(0, ids[:4], torch.ones_like(ids[:4]))
        torch.searchsorted(torch.tensor([1, 3, 5]), ids)
        ids.cumsum(0)
        torch.gt(x.sum(dim=0), 0)


# ----------------------------------------------------------------------------- the forwards


@pytest.fixture(scope="module")
def cores() -> Iterator[dict[str, EngineCore]]:
    built = {name: EngineCore(EngineConfig(model=name, dtype="bfloat16", spec_mode="on",
                                           spec_topk=2, spec_num_steps=3,
                                           spec_num_draft_tokens=5, num_kv_blocks=24,
                                           max_num_seqs=4))
             for name in ("fixture", "fixture-moe")}
    yield built
    for core in built.values():
        core.close()


def _step(num_tokens: list[int], seq_lens: list[int], tree: bool
          ) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(input ids, positions, CUDA-style metadata: no CPU groups) of a step whose sequence b
    has num_tokens[b] new rows ending at KV length seq_lens[b], each in its own blocks."""
    tables, start = [], 0
    for s in seq_lens:
        n = -(-s // BLOCK_SIZE)
        tables.append(list(range(start, start + n)))
        start += n
    mask = None
    if tree:  # row i of each sequence sees the root (bit 0), its parent (i - 1) // 2, itself
        bits = []
        for t in num_tokens:
            for i in range(t):
                row, node = 0, i
                while True:
                    row |= 1 << node
                    if node == 0:
                        break
                    node = (node - 1) // 2
                bits.append(row)
        mask = torch.tensor(bits, dtype=torch.int64)
    meta = build_attention_metadata(num_tokens, seq_lens, tables, BLOCK_SIZE,
                                    torch.device("cpu"), tree_mask=mask)
    positions = torch.cat([torch.arange(s - t, s) for t, s in zip(num_tokens, seq_lens,
                                                                  strict=True)])
    ids = torch.randint(1, 4000, (sum(num_tokens),))
    return ids, positions, replace(meta, groups=())


STEPS = {"decode": ([1, 1, 1], [37, 70, 5], False),
         "verify": ([5, 5], [40, 66], True)}


def _run_forward(model: Any, kv: list[torch.Tensor], layers: tuple[int, ...], step: str,
                 monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The forward of `step` on the GPU's code path under the detector; the kernels run."""
    ids, positions, meta = _step(*STEPS[step])
    with torch.inference_mode(), gpu_code_path(monkeypatch, model) as launched, \
            no_host_sync():
        hidden, aux = model(ids, positions, kv, meta, layers)
        logits = model.compute_logits(hidden)
    assert logits.shape[0] == ids.shape[0] and torch.isfinite(logits.float()).all()
    assert aux is not None and aux.shape[0] == ids.shape[0]
    return set(launched)


# The kernels each fixture's forward must have run: its attention, and the MoE's.
KERNELS = {"fixture": {"_tree_attention_kernel"},
           "fixture-moe": {"_mla_attention_kernel", "_fused_moe_kernel", "_moe_align_kernel"}}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("name", ["fixture", "fixture-moe"])
def test_target_forward_has_no_host_sync(cores: dict[str, EngineCore], name: str, step: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    runner = cores[name].runner
    launched = _run_forward(runner.model, runner.kv_caches, tuple(runner.capture_layers),
                            step, monkeypatch)
    assert KERNELS[name] <= launched, launched


@pytest.mark.parametrize("step", list(STEPS))
def test_expert_parallel_forward_has_no_host_sync(cores: dict[str, EngineCore], step: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2 with whole experts per rank, its collectives stood in for in-process (the
    all-reduce of one rank is the identity): the dispatch to its local experts is what runs."""
    runner = cores["fixture-moe"].runner
    cfg = runner.model_config
    par = ParallelContext(0, 2, expert_parallel=True)
    model = load_model(cfg, torch.device("cpu"), DTYPE, linear_factory(cfg), par)
    kv = allocate_kv_cache(shard_model_config(cfg, par), 24, BLOCK_SIZE, DTYPE,
                           torch.device("cpu"))

    def all_gather(parts: list[torch.Tensor], x: torch.Tensor) -> None:
        for part in parts:
            part.copy_(x)

    monkeypatch.setattr(dist, "all_reduce", lambda x: None)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    launched = _run_forward(model, kv, tuple(runner.capture_layers), step, monkeypatch)
    assert KERNELS["fixture-moe"] <= launched, launched


@pytest.mark.parametrize("name", ["fixture", "fixture-moe"])
def test_draft_loop_has_no_host_sync(cores: dict[str, EngineCore], name: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    spec = cores[name].spec
    assert spec is not None
    drafter = spec.drafter
    width = 64
    roots = torch.tensor([40, 17])
    slots = torch.arange(2 * width).view(2, width)  # the draft cache's first blocks
    inputs = DraftInputs(
        last_out=torch.randn(2, spec.head.config.hidden_size, dtype=DTYPE),
        prefix_slots=slots, prefix_ok=torch.arange(width)[None, :] < roots[:, None],
        roots=roots, root_ids=torch.tensor([5, 9]))
    with torch.inference_mode(), gpu_code_path(monkeypatch, spec.head), no_host_sync():
        tree, nan_rows = drafter.draft_loop(inputs)  # torch alone: no kernel of its own
    assert tree.token_ids.shape[0] == 2 and not bool(nan_rows.any())


def test_the_host_read_loop_of_the_cpu_moe_is_caught(cores: dict[str, EngineCore]) -> None:
    """What the CUDA path ran before it was fixed-shape (the loop over the experts that
    received pairs, its bounds read on the host, still the CPU's path) fails under the
    detector: the forwards above pass because their path has no such read."""
    from specd.workers.models.moe import experts_forward

    moe = cores["fixture-moe"].runner.model.model.layers[1].mlp
    x = torch.randn(3, moe.gate.weight.shape[1], dtype=DTYPE)
    ids, weights = moe.gate(x)
    with torch.inference_mode(), pytest.raises(HostSyncError, match="bincount|nonzero"), \
            no_host_sync():
        experts_forward(x, ids, weights, moe.experts.weights())
