"""The model runner: owns all torch state (model, KV cache, generators) and runs one step.

`launch(batch)` reads a `ScheduledBatch` (plain data from the scheduler), runs the model over
the paged cache through its backend (backend.py: eager, the CPU paths, or captured graphs),
computes logits only for the rows that sample, samples, and returns a `PendingOutput` whose
`resolve()` gives a `ModelOutput` (plain data again). `execute(batch)` is the two at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from specd.workers.config import EngineConfig
from specd.workers.engine.batch import (
    ModelOutput,
    ScheduledBatch,
    ScheduledSequence,
    TokenLogprobs,
)
from specd.workers.engine.sequence import Sequence as Seq
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory
from specd.workers.models.linear_factory import linear_factory
from specd.workers.models.loader import load_model, read_full_tensor
from specd.workers.models.registry import CausalLM
from specd.workers.parallel.driver import DriverModel, start_parallel_model
from specd.workers.parallel.peers import NO_PEERS, Peers
from specd.workers.runner import sampler
from specd.workers.runner.backend import Backend, EagerBackend
from specd.workers.runner.cpu_backend import CpuBackend
from specd.workers.runner.dtypes import TORCH_DTYPES, resolve_dtype
from specd.workers.runner.graph_backend import (
    GraphBackend,
    capture_graphs,
    graph_shapes,
    largest_shapes,
)
from specd.workers.runner.graphs import GraphRunner, GraphShape
from specd.workers.runner.host_copy import HostCopy, upload
from specd.workers.runner.kv_cache import (
    DeviceMemory,
    allocate_kv_cache,
    kv_block_bytes,
    kv_budget,
    num_kv_blocks,
)
from specd.workers.runner.memory_profile import measure_device_memory
from specd.workers.runner.min_tokens import mask_stop_tokens
from specd.workers.runner.prompt_logprobs import (
    PendingPromptLogprobs,
    item_rows,
    launch_prompt_logprobs,
)
from specd.workers.runner.step_inputs import StepInputs, prepare_inputs
from specd.workers.structured.masks import NO_MASKS, StepMasks

# prepare_inputs and StepInputs live in step_inputs.py (the backends build steps too); they
# are part of the runner's interface.
__all__ = ["ModelRunner", "PendingOutput", "StepInputs", "prepare_inputs"]

Logprobs = Callable[[torch.Tensor, torch.Tensor, list[Seq]], dict[str, list[TokenLogprobs]]]


@dataclass(frozen=True)
class PendingOutput:
    """A launched step's samples, still on the device: `resolve()` is where the host waits
    for them (HostCopy) and turns them into a ModelOutput."""

    seqs: list[Seq]
    tokens: HostCopy | None
    logits: torch.Tensor | None  # [M, vocab], kept only when a sequence asked for logprobs
    logprobs: Logprobs
    prompt: PendingPromptLogprobs | None = None  # the prompt rows' log-probabilities

    def resolve(self) -> ModelOutput:
        prompt = {} if self.prompt is None else self.prompt.resolve()
        if self.tokens is None:
            return ModelOutput(sampled={}, prompt_logprobs=prompt)
        values = self.tokens.values()
        sampled = {s.request_id: [t] for s, t in zip(self.seqs, values, strict=True)}
        logprobs = ({} if self.logits is None else self.logprobs(
            self.logits, torch.tensor(values, device=self.logits.device), self.seqs))
        return ModelOutput(sampled=sampled, logprobs=logprobs, prompt_logprobs=prompt)


class ModelRunner:
    """Loads the model and allocates the KV cache (or raises); then runs steps.

    capture_layers: hidden-state indices (transformers' numbering: 0 = embeddings, k = after
    block k - 1), strictly ascending, whose concatenation each step leaves in
    `last_aux_hidden` [N, len(capture_layers) * hidden] for the speculative drafter, beside
    `last_hidden` [N, hidden] (after the final norm), rows in the step's batch layout.
    make_linear: how linear layers are built; None picks dense or INT4 from the checkpoint.
    verify_shape: (query_len, tree_mask) of the speculative worker's verification, captured
    beside plain decode when graphs are on (`config.graphs_enabled`), compiled beside it
    with `cpu_compile`. Graphs get one KV block past `num_kv_blocks` (padding rows) and
    their memory comes out of the KV-cache budget, `kv_budget` (kv_cache.kv_budget: on CUDA
    profiled here, after the weights load; memory_profile.py).
    extra_kv_elements_per_token: a cache the caller allocates with `num_kv_blocks` blocks
    (the draft head's K/V), paid from the same budget. draft_weight_bytes: device memory the
    caller takes after this runner is built (the draft head's weights), paid from a budget
    profiled on CUDA only (a configured kv_cache_memory_bytes is the cache's alone);
    draft_loop_bytes: graphs the caller captures over this runner (the draft loops), paid
    from whichever budget, as the target's graphs are (spec/draft_budget.py measures both).

    With `config.tensor_parallel_size` > 1 every rank has a runner over its own shard
    (`local_model`), and they build themselves alike (the memory profile, graph captures,
    the KV cache, the backend: the same collectives in the same order). Rank 0's starts
    the others (workers/parallel/driver.py) and tells them its construction's arguments;
    its backend announces every model execution to them (`peers`) and `model` is a
    `DriverModel` that does the same for the logits and KV copies. The others' runners
    (`local_model` given: worker.py) only follow. Each rank allocates `num_kv_blocks` blocks
    of its own layer shape (`kv_model_config`), the least count any rank's budget holds: a
    dense model's rank holds 1/N of the K/V heads, so the same budget holds N times the
    blocks (MLA's latent rows are whole on every rank). `close()` stops the workers.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig | None = None,
                 capture_layers: Sequence[int] = (),
                 make_linear: LinearFactory | None = None,
                 verify_shape: tuple[int, bool] | None = None,
                 extra_kv_elements_per_token: int = 0, draft_weight_bytes: int = 0,
                 draft_loop_bytes: int = 0, local_model: CausalLM | None = None) -> None:
        self.config = config
        self.model_config = (ModelConfig.from_dir(config.model_path) if model_config is None
                             else model_config)
        # A rank other than 0 runs on its own device (where its shard was loaded).
        self.device = (torch.device(config.device) if local_model is None
                       else _model_device(local_model))
        self.dtype_name = resolve_dtype(config, self.model_config)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        self.capture_layers = _checked_capture_layers(capture_layers, self.model_config)
        if make_linear is None:
            make_linear = linear_factory(self.model_config)
        self.driver: DriverModel | None = None  # rank 0 of a tensor-parallel group
        self.peers: Peers = NO_PEERS
        if local_model is not None:  # a rank other than 0: its shard, loaded (worker.py)
            self.local_model = local_model
            self.model = local_model
        elif config.tensor_parallel_size > 1:
            self.driver = start_parallel_model(config, self.model_config, self.device,
                                               self.dtype, make_linear)
            self.local_model = self.driver.local
            self.peers = self.driver.workers
            # The driver has the models' interface (forward, compute_logits, embed_tokens,
            # copy_kv_slots, config, model) without being one of their classes.
            self.model = cast(CausalLM, self.driver)
        else:
            self.local_model = load_model(self.model_config, self.device, self.dtype,
                                          make_linear)
            self.model = self.local_model
        # Every rank builds the same: the other ranks follow from here (worker.py). A failure
        # stops them (they may wait in a collective this rank never reaches).
        try:
            with self.peers.call("runner", self.capture_layers, verify_shape,
                                 extra_kv_elements_per_token):
                # The KV budget, profiled on CUDA unless given (kv_cache.kv_budget); before the
                # trial capture below, whose graphs' memory is then taken from it. Verification
                # computes logits for every row of every sequence's draft.
                rows_per_seq = 1 if verify_shape is None else verify_shape[0]
                self.kv_budget = kv_budget(config, self._device_memory(config.max_num_seqs
                                                                       * rows_per_seq))
                # What the draft head takes beside its K/V (spec/draft_budget.py): its weights
                # when the budget is what the device had free before they were loaded, its
                # graphs always. Only rank 0 holds the head; the least count below is its.
                draft_reserved = (draft_loop_bytes if config.graphs_enabled else 0) + (
                    draft_weight_bytes if self.kv_budget.memory is not None else 0)
                shapes, failed, graph_reserved = self._trial_capture(
                    graph_shapes(config.max_num_seqs, verify_shape)
                    if config.graphs_enabled else ())
                # Each rank's budget holds its count; every rank takes the least.
                self.num_kv_blocks = self.local_model.par.agree_min(num_kv_blocks(
                    config, self.kv_model_config, self.dtype, draft_reserved + graph_reserved,
                    extra_kv_elements_per_token, self.kv_budget), self.device)
                # With graphs, one block more than the scheduler owns: the padding rows'
                # (graphs.py).
                self.kv_caches = self._allocate_kv(self.num_kv_blocks + (1 if shapes else 0))
                self.backend = self._make_backend(
                    shapes, failed, None if verify_shape is None else verify_shape[0])
        except BaseException:
            if self.driver is not None:
                self.driver.workers.abort()
            raise
        # Unseeded sampling rows share this generator, so a run is reproducible given
        # config.seed; a request with its own seed gets its own generator on first use.
        self.default_generator = torch.Generator(self.device).manual_seed(config.seed)
        self.generators: dict[str, torch.Generator] = {}
        # Sampled tokens by sample id (modulo the size), on the device: a step scheduled
        # before the previous one's results reached the host reads its placeholders here.
        # Unresolved samples never exceed 2 per running sequence.
        self.future_tokens = torch.zeros(4 * config.max_num_seqs + 8, dtype=torch.int64,
                                         device=self.device)
        self.num_placeholders_resolved = 0  # figures for tests
        self.last_hidden: torch.Tensor | None = None
        self.last_aux_hidden: torch.Tensor | None = None

    def _trial_capture(self, shapes: tuple[GraphShape, ...]
                       ) -> tuple[tuple[GraphShape, ...], GraphRunner | None, int]:
        """(the shapes to capture, a trial capture that failed or None, the bytes the
        graphs take from the KV budget). Measures the graphs' memory before the cache is
        sized: the largest shapes captured over a scratch cache of two blocks (graph
        memory does not depend on its size); after a failed capture nothing is captured
        (status says why all is eager)."""
        if not shapes or self.config.num_kv_blocks is not None:
            return shapes, None, 0
        trial = capture_graphs(self.local_model, self.capture_layers, largest_shapes(shapes),
                               self._allocate_kv(2), self.config.block_size, 1,
                               self.longest_sequence)
        reserved = trial.memory_bytes + kv_block_bytes(self.kv_model_config,
                                                       self.config.block_size, self.dtype)
        failed = trial if trial.error is not None else None
        del trial
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return ((), failed, reserved) if failed is not None else (shapes, None, reserved)

    def _make_backend(self, shapes: Sequence[GraphShape], failed: GraphRunner | None,
                      verify_len: int | None) -> Backend:
        """Graphs when they are on (captured now over the cache; after a failed trial an
        empty runner: all eager), else the CPU paths on the CPU, else eager."""
        config = self.config
        args = (self.local_model, self.capture_layers, self.kv_caches, config.block_size)
        if failed is not None:
            return GraphBackend(*args, failed, peers=self.peers)
        if shapes:
            return GraphBackend(*args, capture_graphs(
                self.local_model, self.capture_layers, shapes, self.kv_caches,
                config.block_size, self.num_kv_blocks, self.longest_sequence),
                peers=self.peers)
        if self.device.type == "cpu":
            return CpuBackend(*args, compile=config.cpu_compile, verify_len=verify_len,
                              peers=self.peers,
                              compile_in_background=config.cpu_compile_background,
                              linear_kernel=config.cpu_linear,
                              tensor_parallel=config.tensor_parallel_size > 1)
        return EagerBackend(*args, peers=self.peers)

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one step; sample one token for each sequence whose step reaches its end."""
        return self.launch(batch).resolve()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, masks: StepMasks = NO_MASKS) -> PendingOutput:
        """Launch one plain step (placeholders resolved on the device, samples written to
        `future_tokens`); the host reads the results through `resolve()` when it needs
        them, which overlap scheduling defers until the next step is launched. `masks`:
        the structured-output masks of the batch's constrained rows (their fill, started
        before, runs beside the forward)."""
        drafted = [s.seq.request_id for s in batch.scheduled if s.num_drafts]
        if drafted:
            raise ValueError(f"execute runs plain steps; requests {drafted} carry draft tokens "
                             f"(verification belongs to the speculative worker)")
        if batch.is_empty:
            return PendingOutput([], None, None, self.logprobs)
        step = self.backend.forward_step(batch, self._input_ids)
        self.last_hidden, self.last_aux_hidden = step.hidden, step.aux
        prompt = self.prompt_logprobs(batch.scheduled, item_rows(batch.scheduled, step.hidden))
        if not step.sample_seqs:
            return PendingOutput([], None, None, self.logprobs, prompt)
        logits = self.model.compute_logits(step.hidden[step.sample_rows]).float()  # [M, V]
        return dataclasses.replace(self.sample(logits, step.sample_seqs, step.sample_ids,
                                               masks), prompt=prompt)

    def prompt_logprobs(self, items: list[ScheduledSequence], hidden: list[torch.Tensor]
                        ) -> PendingPromptLogprobs | None:
        """The log-probabilities of the prompt tokens items' rows predict (hidden[i]: item
        i's rows), for the requests that asked (prompt_logprobs.py); None when none did."""
        if not any(s.seq.wants_prompt_logprobs for s in items):
            return None
        return launch_prompt_logprobs(self.model.compute_logits, items, hidden)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over one step's tokens: hidden [N, hidden] after the final norm. Writes
        this step's KV into the cache and records `last_*` (see the class docstring)."""
        hidden, aux = self.backend.forward(self._input_ids(inputs), inputs)
        self.last_hidden, self.last_aux_hidden = hidden, aux
        return hidden

    def sample(self, logits: torch.Tensor, seqs: list[Seq], sample_ids: list[int],
               masks: StepMasks = NO_MASKS) -> PendingOutput:
        """Sample one token per row of logits [M, vocab] (row i for seqs[i]), write them to
        `future_tokens` under `sample_ids` (all >= 0, or the step resolves nothing there)
        and start their copy to the host. Constrained rows take their `masks` first."""
        params = [s.sampling for s in seqs]
        # Grammar masks, penalties and logit biases, then min_tokens' mask (each skipped
        # when no row has any); logprobs stay raw.
        constrained = masks.apply(logits, seqs)
        changed = mask_stop_tokens(sampler.penalize(constrained, params, seqs), params, seqs,
                                   self.model_config.eos_token_ids)
        tokens = sampler.sample(changed, params, self.generators_of(seqs),
                                self.default_generator)
        self.write_futures(sample_ids, tokens)
        wants_logprobs = any(s.sampling.logprobs > 0 for s in seqs)
        return PendingOutput(seqs, HostCopy(tokens), logits if wants_logprobs else None,
                             self.logprobs)

    def write_futures(self, sample_ids: list[int], tokens: torch.Tensor) -> None:
        """Record tokens [M] as the results of samples `sample_ids` (read by later steps'
        placeholders); nothing when any id is unknown (< 0: a step built without them)."""
        if sample_ids and min(sample_ids) >= 0:
            self.future_tokens[self.future_index(sample_ids)] = tokens

    def future_index(self, sample_ids: list[int]) -> torch.Tensor:
        """The `future_tokens` entries of samples `sample_ids`, int64 on the device."""
        # Staged through pinned memory: a pageable copy would wait for the step in flight.
        return (upload(torch.tensor(sample_ids, dtype=torch.int64), self.device)
                % self.future_tokens.shape[0])

    def resolve_placeholders(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Placeholder ids (negative) -> the tokens their samples produced, on the device."""
        index = (-1 - input_ids).clamp(min=0) % self.future_tokens.shape[0]
        return torch.where(input_ids < 0, self.future_tokens[index], input_ids)

    def _input_ids(self, inputs: StepInputs) -> torch.Tensor:
        """The step's input ids with placeholders of in-flight samples resolved."""
        if not inputs.num_placeholders:
            return inputs.input_ids
        self.num_placeholders_resolved += inputs.num_placeholders
        return self.resolve_placeholders(inputs.input_ids)

    def move_kv(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the cache entries (K/V, or MLA's latent rows) of slots `src_slots` to
        `dst_slots` (int64 [M] each, on the device) in every layer: speculative KV
        compaction. The model knows its cache's layout (`copy_kv_slots`)."""
        self.backend.kv_changed()
        self.model.copy_kv_slots(self.kv_caches, src_slots, dst_slots)

    def invalidate_decode_stage(self) -> None:
        """Drop whatever the backend keeps derived from the KV cache (the CPU's kept decode
        K/V): call after the cache was written outside a step (a step that failed)."""
        self.backend.kv_changed()

    @property
    def longest_sequence(self) -> int:
        """The longest sequence the configuration allows (before any KV-cache cap)."""
        limit = self.model_config.max_model_len
        return min(self.config.max_model_len or limit, limit)

    def _device_memory(self, num_logit_rows: int) -> DeviceMemory | None:
        """The device's memory after the weights and a profiling forward at the largest
        step, with logits for num_logit_rows rows (memory_profile.py): on CUDA when the
        budget is not given, else None."""
        config = self.config
        if (self.device.type != "cuda" or config.kv_cache_memory_bytes is not None
                or config.num_kv_blocks is not None):
            return None
        return measure_device_memory(self.local_model, self.capture_layers, self._allocate_kv,
                                     config.block_size, self.model_config.vocab_size,
                                     config.max_num_batched_tokens, num_logit_rows,
                                     self.device)

    def _allocate_kv(self, num_blocks: int) -> list[torch.Tensor]:
        return allocate_kv_cache(self.kv_model_config, num_blocks, self.config.block_size,
                                 self.dtype, self.device)

    @property
    def kv_model_config(self) -> ModelConfig:
        """The config this rank's KV cache is laid out by: the model's, or under tensor
        parallelism this rank's shard's (its K/V heads)."""
        return self.local_model.config

    def draft_embedding_weight(self) -> torch.Tensor:
        """The target's whole token embedding [vocab, hidden], which a draft head without its
        own shares: the model's (the same storage) in one process; under tensor parallelism,
        where the model holds a vocabulary range, a copy read for rank 0's head."""
        if not self.local_model.par.is_parallel:
            weight: torch.Tensor = self.local_model.model.embed_tokens.weight
            return weight
        return read_full_tensor(self.model_config, "model.embed_tokens.weight", self.device,
                                self.dtype)

    def ranks(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(every rank, every node) in words, for status; both empty in one process."""
        return ((), ()) if self.driver is None else self.driver.workers.describe_all()

    def on_rank_failure(self, callback: Callable[[Exception], None]) -> None:
        """Call `callback` (from a watch thread) when a rank or node is found failed outside
        a step (a node gone silent while this process waits); nothing in one process."""
        if self.driver is not None:
            self.driver.workers.watch(callback)

    def close(self) -> None:
        """Stop the worker ranks, if any (the runner is unusable after)."""
        if self.driver is not None:
            self.driver.close()

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's generator (unknown ids are fine)."""
        self.generators.pop(request_id, None)

    def generators_of(self, seqs: list[Seq]) -> list[torch.Generator | None]:
        """Each sequence's own generator (seeded requests), or None: the default one."""
        return [self._generator(s) for s in seqs]

    def _generator(self, seq: Seq) -> torch.Generator | None:
        seed = seq.sampling.seed
        if seed is None or seq.sampling.is_greedy:
            return None
        generator = self.generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(self.device).manual_seed(seed)
            self.generators[seq.request_id] = generator
        return generator

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                 seqs: list[Seq]) -> dict[str, list[TokenLogprobs]]:
        """Log-probabilities of `tokens` [M] under logits [M, vocab] and their top
        alternatives, for the sequences (seqs[i] for row i) that asked for them."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs > 0]
        if not rows:
            return {}
        index = torch.tensor(rows, device=logits.device)
        counts = [seqs[i].sampling.logprobs for i in rows]
        found = sampler.top_logprobs(logits[index], tokens[index], counts)
        return {seqs[i].request_id: [lp] for i, lp in zip(rows, found, strict=True)}


def _model_device(model: CausalLM) -> torch.device:
    """Where a loaded model's weights are."""
    return next(model.parameters()).device


def _checked_capture_layers(layers: Sequence[int], cfg: ModelConfig) -> tuple[int, ...]:
    result = tuple(layers)
    if any(not 0 <= i <= cfg.num_layers for i in result) or list(result) != sorted(set(result)):
        raise ValueError(f"capture_layers must be strictly ascending indices in "
                         f"[0, {cfg.num_layers}], got {list(result)}")
    return result
