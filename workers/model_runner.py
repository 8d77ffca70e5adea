"""The model runner: owns all torch state (model, KV cache, generators) and runs one step.

`execute(batch)` reads a `ScheduledBatch` (plain data from the scheduler), builds the step's
tensors with `prepare_inputs`, runs the model over the paged cache, computes logits only for
the rows that sample, samples, and returns a `ModelOutput` (plain data again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specd.workers import sampler
from specd.workers.attention import MAX_TREE_TOKENS, AttentionMetadata, build_attention_metadata
from specd.workers.batch import ModelOutput, ScheduledBatch, TokenLogprobs
from specd.workers.config import EngineConfig
from specd.workers.cpu_decode import CompiledDecode
from specd.workers.decode_stage import DecodeStage
from specd.workers.graphs import GraphRunner, GraphShape, capture_sizes
from specd.workers.host_copy import HostCopy, upload
from specd.workers.kv_cache import allocate_kv_cache, kv_block_bytes, num_kv_blocks
from specd.workers.layers import LinearFactory, dense_linear, pack_linears_for_cpu
from specd.workers.loader import load_model
from specd.workers.model_config import ModelConfig
from specd.workers.sequence import Sequence as Seq
from specd.workers.sequence import placeholder_token_id

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


@dataclass(frozen=True)
class PendingOutput:
    """A launched step's results, still on the device: `resolve()` is where the host waits
    for them (HostCopy) and turns them into a ModelOutput."""

    seqs: list[Seq]
    tokens: HostCopy | None
    logits: torch.Tensor | None  # [M, vocab], kept only when a sequence asked for logprobs
    logprobs: Callable[[torch.Tensor, torch.Tensor, list[Seq]], dict[str, list[TokenLogprobs]]]

    def resolve(self) -> ModelOutput:
        if self.tokens is None:
            return ModelOutput(sampled={})
        values = self.tokens.values()
        sampled = {s.request_id: [t] for s, t in zip(self.seqs, values, strict=True)}
        logprobs = ({} if self.logits is None else self.logprobs(
            self.logits, torch.tensor(values, device=self.logits.device), self.seqs))
        return ModelOutput(sampled=sampled, logprobs=logprobs)


def prepare_inputs(batch: ScheduledBatch, block_size: int, device: torch.device,
                   stage: DecodeStage | None = None) -> StepInputs:
    """Build token ids, rope positions and attention metadata for `batch`.

    Sequence b computes tokens [start, end) of `prompt + output + spec_token_ids` (drafts as a
    chain: position = index); its KV goes to the slots of `seq.block_ids`. `stage`: the
    runner's kept decode K/V (CPU), planned here for this step's decode group.
    """
    token_ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[Seq] = []
    sample_ids: list[int] = []
    num_placeholders = 0
    for s in batch.scheduled:
        token_ids += _token_slice(s.seq, s.start, s.end)
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


class ModelRunner:
    """Loads the model and allocates the KV cache (or raises); then runs steps.

    capture_layers: hidden-state indices (transformers' numbering: 0 = embeddings, k = after
    block k - 1), strictly ascending, whose concatenation each step leaves in
    `last_aux_hidden` [N, len(capture_layers) * hidden] for the speculative drafter, beside
    `last_hidden` [N, hidden] (after the final norm), rows in the step's batch layout.
    make_linear: how linear layers are built; None picks dense or INT4 from the checkpoint.
    verify_shape: (query_len, tree_mask) of the speculative worker's verification, captured
    beside plain decode when graphs are on (`config.graphs_enabled`; `graphs` is then the
    GraphRunner, else None). Graphs get one KV block past `num_kv_blocks` (padding rows)
    and their memory comes out of the KV-cache budget.
    extra_kv_elements_per_token: a cache the caller allocates with `num_kv_blocks` blocks
    (the draft head's K/V), paid from the same budget.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig | None = None,
                 capture_layers: Sequence[int] = (),
                 make_linear: LinearFactory | None = None,
                 verify_shape: tuple[int, bool] | None = None,
                 extra_kv_elements_per_token: int = 0) -> None:
        self.config = config
        self.model_config = (ModelConfig.from_dir(config.model_path) if model_config is None
                             else model_config)
        self.device = torch.device(config.device)
        self.dtype_name = resolve_dtype(config, self.model_config)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        self.capture_layers = _checked_capture_layers(capture_layers, self.model_config)
        if make_linear is None:
            make_linear = _linear_factory(self.model_config)
        self.model = load_model(self.model_config, self.device, self.dtype, make_linear)
        # bf16 on the CPU: oneDNN's weight layout once, not per call (layers.PackedLinear).
        # With cpu_compile each also keeps its plain weight for the compiled steps.
        self.num_packed_linears = (pack_linears_for_cpu(self.model, config.cpu_compile)
                                   if self.device.type == "cpu" else 0)
        self.compiled_decode = (
            CompiledDecode(self.model, self.capture_layers,
                           None if verify_shape is None else verify_shape[0])
            if config.cpu_compile else None)
        shapes = _graph_shapes(config, verify_shape) if config.graphs_enabled else ()
        self.graphs: GraphRunner | None = None
        reserved = 0
        if shapes and config.num_kv_blocks is None:
            # Measure the graphs' memory before sizing the cache: capture the largest shapes
            # over a scratch cache of two blocks (graph memory does not depend on its size).
            trial = self._capture_graphs(_largest(shapes), self._allocate_kv(2), pad_block=1)
            reserved = trial.memory_bytes + kv_block_bytes(self.model_config,
                                                           config.block_size, self.dtype)
            if trial.error is not None:
                shapes, self.graphs = (), trial  # logged; status says why all is eager
            del trial
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.num_kv_blocks = num_kv_blocks(config, self.model_config, self.dtype, reserved,
                                           extra_kv_elements_per_token)
        # With graphs, one block more than the scheduler owns: the padding rows' (graphs.py).
        self.kv_caches = self._allocate_kv(self.num_kv_blocks + (1 if shapes else 0))
        if shapes:
            self.graphs = self._capture_graphs(shapes, self.kv_caches,
                                               pad_block=self.num_kv_blocks)
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
        # Plain decode on the CPU keeps its group's K/V between steps (decode_stage.py).
        self.decode_stage = (DecodeStage(config.block_size)
                             if self.device.type == "cpu" and self.graphs is None else None)
        self.num_split_steps = 0  # plain steps run as compiled decode + the rest (figures)
        self.last_hidden: torch.Tensor | None = None
        self.last_aux_hidden: torch.Tensor | None = None

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one step; sample one token for each sequence whose step reaches its end."""
        return self.launch(batch).resolve()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> PendingOutput:
        """Launch one plain step (placeholders resolved on the device, samples written to
        `future_tokens`); the host reads the results through `resolve()` when it needs
        them, which overlap scheduling defers until the next step is launched."""
        drafted = [s.seq.request_id for s in batch.scheduled if s.num_drafts]
        if drafted:
            raise ValueError(f"execute runs plain steps; requests {drafted} carry draft tokens "
                             f"(verification belongs to the speculative worker)")
        if batch.is_empty:
            return PendingOutput([], None, None, self._logprobs)
        parts = self._compiled_parts(batch)
        if parts is None:
            inputs = prepare_inputs(batch, self.config.block_size, self.device,
                                    self.decode_stage)
            hidden = self.forward(inputs)
            sample_rows, seqs, sample_ids = (inputs.sample_rows, inputs.sample_seqs,
                                             inputs.sample_ids)
        else:
            hidden, sample_rows, seqs, sample_ids = self._forward_parts(batch, *parts)
        if not seqs:
            return PendingOutput([], None, None, self._logprobs)
        logits = self.model.compute_logits(hidden[sample_rows]).float()  # [M, vocab]
        params = [s.sampling for s in seqs]
        tokens = sampler.sample(logits, params, [self._generator(s) for s in seqs],
                                self.default_generator)
        self._write_futures(sample_ids, tokens)
        wants_logprobs = any(s.sampling.logprobs > 0 for s in seqs)
        return PendingOutput(seqs, HostCopy(tokens), logits if wants_logprobs else None,
                             self._logprobs)

    def _write_futures(self, sample_ids: list[int], tokens: torch.Tensor) -> None:
        if sample_ids and min(sample_ids) >= 0:
            # Staged through pinned memory: a pageable copy would wait for the step in flight.
            index = (upload(torch.tensor(sample_ids, dtype=torch.int64), self.device)
                     % self.future_tokens.shape[0])
            self.future_tokens[index] = tokens

    def _input_ids(self, inputs: StepInputs) -> torch.Tensor:
        """The step's input ids with placeholders of in-flight samples resolved."""
        if not inputs.num_placeholders:
            return inputs.input_ids
        self.num_placeholders_resolved += inputs.num_placeholders
        return self._resolve_placeholders(inputs.input_ids)

    def _resolve_placeholders(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Placeholder ids (negative) -> the tokens their samples produced, on the device."""
        index = (-1 - input_ids).clamp(min=0) % self.future_tokens.shape[0]
        return torch.where(input_ids < 0, self.future_tokens[index], input_ids)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over one step's tokens: hidden [N, hidden] after the final norm. Writes
        this step's KV into the cache and records `last_*` (see the class docstring)."""
        input_ids = self._input_ids(inputs)
        staged = any(g.stage_plan is not None for g in inputs.meta.groups)
        if not staged:
            self.invalidate_decode_stage()  # this forward writes K/V the copy would miss
        try:
            hidden, aux = self._run_model(input_ids, inputs)
        except BaseException:
            self.invalidate_decode_stage()  # some layers may have appended, others not
            raise
        self.last_hidden, self.last_aux_hidden = hidden, aux
        return hidden

    def _compiled_parts(self, batch: ScheduledBatch) -> tuple[list[int], list[int]] | None:
        """(decode, rest): indices into `batch.scheduled` of its one-token rows and of the
        others, when the step mixes both and the compiled CPU decode can take the first;
        else None (one forward for the whole batch).

        A new request's prefill joining the decoding batch (every step or two under a
        steady load) would otherwise run the whole batch eagerly: on the 2-core CPU at 32
        sequences such a step took ~2.8x an appending compiled decode step, split ~2.5x
        (most of it the eager prefill, ~21 ms for ~110 tokens)."""
        compiled = self.compiled_decode
        if compiled is None or compiled.error is not None or self.decode_stage is None:
            return None
        decode = [i for i, s in enumerate(batch.scheduled) if s.num_new_tokens == 1]
        if not decode or len(decode) == len(batch.scheduled):
            return None
        rest = [i for i, s in enumerate(batch.scheduled) if s.num_new_tokens != 1]
        return decode, rest

    def _forward_parts(self, batch: ScheduledBatch, decode: list[int], rest: list[int]
                       ) -> tuple[torch.Tensor, torch.Tensor, list[Seq], list[int]]:
        """The model over `batch` in two forwards, the decode rows first (kept K/V, the
        compiled step), then the rest (eager, without the stage: those rows write only
        their own sequences' K/V, which the kept copy does not hold). Returns hidden [N, H]
        in the batch's row layout (aux too, in `last_aux_hidden`), and the rows, sequences
        and sample ids that sample, as `StepInputs` holds them."""
        offsets = [0]
        for s in batch.scheduled:
            offsets.append(offsets[-1] + s.num_new_tokens)
        hidden_parts: list[torch.Tensor] = []
        aux_parts: list[torch.Tensor] = []
        rows_parts: list[torch.Tensor] = []
        sample_rows, sample_seqs, sample_ids = [], [], []
        try:
            for indices, stage in ((decode, self.decode_stage), (rest, None)):
                part = ScheduledBatch([batch.scheduled[i] for i in indices])
                inputs = prepare_inputs(part, self.config.block_size, self.device, stage)
                hidden, aux = self._run_model(self._input_ids(inputs), inputs)
                rows = torch.tensor([r for i in indices for r in range(offsets[i], offsets[i + 1])],
                                    dtype=torch.int64, device=self.device)
                hidden_parts.append(hidden)
                if aux is not None:  # every part captures the same layers, or none does
                    aux_parts.append(aux)
                rows_parts.append(rows)
                sample_rows.append(rows[inputs.sample_rows])
                sample_seqs += inputs.sample_seqs
                sample_ids += inputs.sample_ids
        except BaseException:
            self.invalidate_decode_stage()  # some layers may have appended, others not
            raise
        self.num_split_steps += 1
        self.last_hidden = _merge_rows(hidden_parts, rows_parts, offsets[-1])
        self.last_aux_hidden = (_merge_rows(aux_parts, rows_parts, offsets[-1]) if aux_parts
                                else None)
        return self.last_hidden, torch.cat(sample_rows), sample_seqs, sample_ids

    @property
    def longest_sequence(self) -> int:
        """The longest sequence the configuration allows (before any KV-cache cap)."""
        limit = self.model_config.max_model_len
        return min(self.config.max_model_len or limit, limit)

    def _run_model(self, input_ids: torch.Tensor, inputs: StepInputs
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A captured graph if one fits, else the compiled CPU decode if it applies, else
        the eager model: (hidden, aux)."""
        meta = inputs.meta
        if self.graphs is not None:
            shape = self.graphs.shape_for(meta)
            if shape is not None:
                return self.graphs.run(shape, input_ids, inputs.positions, meta)
            self.graphs.num_eager += 1
        elif self.compiled_decode is not None and self.compiled_decode.applies(meta):
            result = self.compiled_decode.run(input_ids, inputs.positions, meta, self.kv_caches)
            if result is not None:
                return result
        return self.model(input_ids, inputs.positions, self.kv_caches, meta,
                          self.capture_layers)

    def _allocate_kv(self, num_blocks: int) -> list[torch.Tensor]:
        return allocate_kv_cache(self.model_config, num_blocks, self.config.block_size,
                                 self.dtype, self.device)

    def _capture_graphs(self, shapes: Sequence[GraphShape], kv_caches: list[torch.Tensor],
                        pad_block: int) -> GraphRunner:
        """Graphs of the model over `kv_caches` (captured, or empty with `error` set)."""
        bs = self.config.block_size
        # Longest KV a step can see: the longest sequence plus a draft tree past its end.
        max_seq_len = self.longest_sequence + MAX_TREE_TOKENS

        def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
            return self.model(input_ids, positions, kv_caches, meta, self.capture_layers)

        graphs = GraphRunner(forward, shapes, self.device, bs, pad_block,
                             table_width=-(-max_seq_len // bs), max_seq_len=max_seq_len)
        with torch.inference_mode():
            graphs.capture()
        return graphs

    def invalidate_decode_stage(self) -> None:
        """Drop the kept decode K/V: call after writing the KV cache outside `forward`."""
        if self.decode_stage is not None:
            self.decode_stage.invalidate()

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's generator (unknown ids are fine)."""
        self.generators.pop(request_id, None)

    def _generator(self, seq: Seq) -> torch.Generator | None:
        seed = seq.sampling.seed
        if seed is None or seq.sampling.is_greedy:
            return None
        generator = self.generators.get(seq.request_id)
        if generator is None:
            generator = torch.Generator(self.device).manual_seed(seed)
            self.generators[seq.request_id] = generator
        return generator

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                  seqs: list[Seq]) -> dict[str, list[TokenLogprobs]]:
        rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs > 0]
        if not rows:
            return {}
        index = torch.tensor(rows, device=logits.device)
        counts = [seqs[i].sampling.logprobs for i in rows]
        found = sampler.top_logprobs(logits[index], tokens[index], counts)
        return {seqs[i].request_id: [lp] for i, lp in zip(rows, found, strict=True)}


def _merge_rows(parts: list[torch.Tensor], rows: list[torch.Tensor], num_rows: int
                ) -> torch.Tensor:
    """[num_rows, ...]: part k's rows placed at `rows[k]` (the parts cover every row)."""
    out = parts[0].new_empty((num_rows, *parts[0].shape[1:]))
    for part, index in zip(parts, rows, strict=True):
        out[index] = part
    return out


def resolve_dtype(config: EngineConfig, model_config: ModelConfig) -> str:
    """The dtype to run in: the configured one, or for "auto" the checkpoint's half
    precision where the device computes it natively (CUDA; bfloat16 on a CPU with
    AVX512-BF16 or AMX, where it halves the bytes per step and doubles the matmul rate),
    else float32 (half precision on other CPUs is emulated and slow)."""
    if config.dtype != "auto":
        return config.dtype
    stored = model_config.torch_dtype
    if config.device.startswith("cuda"):
        return stored if stored in ("bfloat16", "float16") else "bfloat16"
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if stored == "bfloat16" and native_bf16 else "float32"


def _token_slice(seq: Seq, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output + drafts, without concatenating whole lists."""
    # Drafts and placeholders never meet: a sequence with a pending sample gets no drafts
    # (speculative steps run with nothing in flight), and a step that verifies drafts does
    # not read the placeholder of its own sample.
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


def _graph_shapes(config: EngineConfig, verify_shape: tuple[int, bool] | None
                  ) -> tuple[GraphShape, ...]:
    """Plain decode, and verification if speculating, at every capture size."""
    kinds = [(1, False)] + ([verify_shape] if verify_shape is not None else [])
    return tuple(GraphShape(b, t, masked) for t, masked in kinds
                 for b in capture_sizes(config.max_num_seqs))


def _largest(shapes: Sequence[GraphShape]) -> tuple[GraphShape, ...]:
    """The largest batch of each kind: what the graphs' shared memory pool must hold."""
    kinds = {(s.query_len, s.tree_mask) for s in shapes}
    return tuple(max(s for s in shapes if (s.query_len, s.tree_mask) == k) for k in kinds)


def _linear_factory(cfg: ModelConfig) -> LinearFactory:
    """Dense linears, or INT4 ones where the checkpoint's quantization_config says so."""
    if cfg.quantization_config is None:
        return dense_linear
    # Imported only for quantized checkpoints: it pulls in the Triton INT4 kernel module.
    from specd.workers.quantization import linear_factory_for

    return linear_factory_for(cfg.quantization_config, dense_linear)


def _checked_capture_layers(layers: Sequence[int], cfg: ModelConfig) -> tuple[int, ...]:
    result = tuple(layers)
    if any(not 0 <= i <= cfg.num_layers for i in result) or list(result) != sorted(set(result)):
        raise ValueError(f"capture_layers must be strictly ascending indices in "
                         f"[0, {cfg.num_layers}], got {list(result)}")
    return result
