"""The draft loop of a chain (top-k 1, every draft kept) is the tree loop's answer for top-k
1 without its bookkeeping: the same tree, tensor for tensor, and the same NaN flags, for
both heads (per-head K/V and MLA latents) over a paged prefix of real draft K/V."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.spec.draft_graphs import DraftInputs
from specd.workers.spec.drafting import draft_chain, draft_loop, draft_tree

NUM_STEPS = 5


@pytest.fixture(scope="module", params=["fixture", "fixture-moe"])
def core(request: pytest.FixtureRequest) -> Iterator[EngineCore]:
    built = EngineCore(EngineConfig(model=request.param, dtype="float32", spec_mode="on",
                                    spec_topk=1, spec_num_steps=NUM_STEPS,
                                    spec_num_draft_tokens=NUM_STEPS + 1, num_kv_blocks=24,
                                    max_num_seqs=4))
    yield built
    built.close()


def _inputs(core: EngineCore, seed: int) -> DraftInputs:
    """Three sequences over the draft cache's first blocks, filled with noise (so the
    prefix the levels attend matters), their roots at 40, 17 and 1."""
    spec = core.spec
    assert spec is not None
    generator = torch.Generator().manual_seed(seed)
    kv = spec.drafter.draft_kv
    kv.copy_(torch.randn(kv.shape, generator=generator, dtype=kv.dtype))
    width = 64
    roots = torch.tensor([40, 17, 1])
    return DraftInputs(
        last_out=torch.randn(3, spec.head.config.hidden_size, generator=generator),
        prefix_slots=torch.arange(3 * width).view(3, width),
        prefix_ok=torch.arange(width)[None, :] < roots[:, None],
        roots=roots, root_ids=torch.tensor([5, 9, 11]))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_chain_drafts_the_tree_loops_chain(core: EngineCore, seed: int) -> None:
    spec = core.spec
    assert spec is not None
    inputs = _inputs(core, seed)
    kv = spec.drafter.draft_kv
    with torch.inference_mode():
        chain, chain_nan = draft_chain(spec.head, kv, NUM_STEPS, inputs)
        tree, tree_nan = draft_tree(spec.head, kv, 1, NUM_STEPS, NUM_STEPS + 1, inputs)
    for name in ("token_ids", "parents", "depths", "tree_mask"):
        assert torch.equal(getattr(chain, name), getattr(tree, name)), name
    assert torch.equal(chain_nan, tree_nan) and not bool(chain_nan.any())
    assert chain.token_ids.shape == (3, NUM_STEPS + 1)


def test_a_nan_in_any_level_flags_its_row_in_both(core: EngineCore) -> None:
    spec = core.spec
    assert spec is not None
    inputs = _inputs(core, 2)
    inputs.last_out[1, 0] = float("nan")
    kv = spec.drafter.draft_kv
    with torch.inference_mode():
        _, chain_nan = draft_chain(spec.head, kv, NUM_STEPS, inputs)
        _, tree_nan = draft_tree(spec.head, kv, 1, NUM_STEPS, NUM_STEPS + 1, inputs)
    assert chain_nan.tolist() == tree_nan.tolist() == [False, True, False]


def test_the_loop_takes_the_chain_only_when_it_keeps_every_draft(
        core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer kept drafts than levels is a tree's choice (the best by score): the tree loop."""
    spec = core.spec
    assert spec is not None
    taken: list[str] = []
    from specd.workers.spec import drafting

    def chain(*args: Any) -> Any:
        taken.append("chain")
        return draft_chain(*args)

    def tree(*args: Any) -> Any:
        taken.append("tree")
        return draft_tree(*args)

    monkeypatch.setattr(drafting, "draft_chain", chain)
    monkeypatch.setattr(drafting, "draft_tree", tree)
    inputs = _inputs(core, 3)
    with torch.inference_mode():
        draft_loop(spec.head, spec.drafter.draft_kv, 1, NUM_STEPS, NUM_STEPS + 1, inputs)
        draft_loop(spec.head, spec.drafter.draft_kv, 1, NUM_STEPS, NUM_STEPS, inputs)
        draft_loop(spec.head, spec.drafter.draft_kv, 2, NUM_STEPS, NUM_STEPS + 1, inputs)
    assert taken == ["chain", "tree", "tree"]
