"""The graph backend: captured forwards (graphs.py) for plain decode and verify, and captured
draft loops (spec/draft_graphs.py), behind the `Backend` interface.

A forward whose shape was captured replays its graph; any other (prefill chunks, mixed
steps, larger batches) runs eagerly. Under tensor parallelism every rank captures the same
shapes, the all-reduces inside the captured forwards (NCCL under capture on CUDA). On CUDA
these are CUDA graphs; on the CPU the same code runs with the synchronous stand-in
(`graphs.EagerGraph`), so that CI exercises it. A capture that failed leaves a backend
that runs everything eagerly and says why in status.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.workers.models.registry import CausalLM
from specd.workers.parallel.peers import NO_PEERS, Peers
from specd.workers.runner.attention import MAX_TREE_TOKENS, AttentionMetadata
from specd.workers.runner.backend import (
    Backend,
    DraftLoop,
    DraftLoopRunner,
    DraftLoopShape,
    Fallback,
    Outputs,
)
from specd.workers.runner.graphs import GraphRunner, GraphShape, capture_sizes
from specd.workers.runner.step_inputs import StepInputs
from specd.workers.spec.draft_graphs import DraftGraphs, DraftInputs, DraftOutputs, prefix_widths


class GraphBackend(Backend):
    """Replays `graphs` (captured over `kv_caches`, or empty after a failed capture)."""

    def __init__(self, model: CausalLM, capture_layers: Sequence[int],
                 kv_caches: list[torch.Tensor], block_size: int, graphs: GraphRunner,
                 peers: Peers = NO_PEERS) -> None:
        super().__init__(model, capture_layers, kv_caches, block_size, peers)
        self.graphs = graphs

    def run(self, input_ids: torch.Tensor, inputs: StepInputs) -> Outputs:
        """The captured graph of the step's shape (every rank captured the same shapes and
        picks the same one: the shape is host data of the metadata), else eagerly.
        Nothing is kept between forwards (graphs read the cache where it is)."""
        shape = self.graphs.shape_for(inputs.meta)
        if shape is not None:
            return self.graphs.run(shape, input_ids, inputs.positions, inputs.meta)
        self.graphs.num_eager += 1
        return self.eager(input_ids, inputs)

    def make_draft_loop(self, loop: DraftLoop, shape: DraftLoopShape) -> DraftLoopRunner:
        graphs = DraftGraphs(loop, capture_sizes(shape.max_num_seqs),
                             prefix_widths(shape.longest_sequence), shape.hidden_size,
                             shape.dtype, self.device)
        with torch.inference_mode():
            graphs.capture()
        return GraphDraftLoop(loop, graphs)

    def status(self) -> str:
        return self.graphs.status()

    def target_fallbacks(self) -> list[Fallback]:
        """A capture of the target's forwards that failed: every forward runs eagerly."""
        error = self.graphs.error
        return [] if error is None else [
            Fallback("cuda_graphs", f"the target's forwards run eagerly: {error}")]

    @property
    def memory_bytes(self) -> int:
        return self.graphs.memory_bytes


class GraphDraftLoop(DraftLoopRunner):
    """Replays a captured draft loop when one fits the batch and prefix, else runs `loop`."""

    def __init__(self, loop: DraftLoop, graphs: DraftGraphs) -> None:
        self.loop = loop
        self.graphs = graphs

    @property
    def memory_bytes(self) -> int:
        return self.graphs.memory_bytes

    def prefix_width(self, batch: int, width: int) -> int:
        shape = self.graphs.shape_for(batch, width)
        return width if shape is None else shape[1]

    def run(self, inputs: DraftInputs) -> DraftOutputs:
        batch, width = inputs.prefix_slots.shape
        shape = self.graphs.shape_for(batch, width)
        if shape is not None and shape[1] == width:
            return self.graphs.run(shape, inputs)
        self.graphs.num_eager += 1
        return self.loop(inputs)

    def status(self) -> str:
        return self.graphs.status()

    def fallback(self) -> Fallback | None:
        error = self.graphs.error
        return None if error is None else Fallback(
            "cuda_graphs_draft_loop", f"the draft loop runs eagerly: {error}")


def graph_shapes(max_num_seqs: int, verify_shape: tuple[int, bool] | None
                 ) -> tuple[GraphShape, ...]:
    """Plain decode, and verification (query length, tree mask) if speculating, at every
    capture size."""
    kinds = [(1, False)] + ([verify_shape] if verify_shape is not None else [])
    return tuple(GraphShape(b, t, masked) for t, masked in kinds
                 for b in capture_sizes(max_num_seqs))


def largest_shapes(shapes: Sequence[GraphShape]) -> tuple[GraphShape, ...]:
    """The largest batch of each kind: what the graphs' shared memory pool must hold."""
    kinds = {(s.query_len, s.tree_mask) for s in shapes}
    return tuple(max(s for s in shapes if (s.query_len, s.tree_mask) == k) for k in kinds)


def capture_graphs(model: CausalLM, capture_layers: Sequence[int],
                   shapes: Sequence[GraphShape], kv_caches: list[torch.Tensor],
                   block_size: int, pad_block: int, longest_sequence: int) -> GraphRunner:
    """Graphs of the model over `kv_caches` (captured, or empty with `error` set; see
    graphs.GraphRunner). `pad_block`: a block of `kv_caches` no sequence owns."""
    # Longest KV a step can see: the longest sequence plus a draft tree past its end.
    max_seq_len = longest_sequence + MAX_TREE_TOKENS
    layers = tuple(capture_layers)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> Outputs:
        return model(input_ids, positions, kv_caches, meta, layers)

    graphs = GraphRunner(forward, shapes, kv_caches[0].device, block_size, pad_block,
                         table_width=-(-max_seq_len // block_size), max_seq_len=max_seq_len)
    with torch.inference_mode():
        graphs.capture()
    return graphs
