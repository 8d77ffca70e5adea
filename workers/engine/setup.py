"""How an `EngineCore` is put together: its step worker (speculative with a draft model,
plain without) and runner, the longest sequence served, and what it resolved (status).
Warm-up is workers/engine/warmup.py."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from specd.workers.config import EngineConfig, EngineResolved
from specd.workers.engine.plain_worker import PlainWorker, StepWorker
from specd.workers.models.checkpoint_check import check_int4_storage
from specd.workers.models.config import ModelConfig
from specd.workers.runner.dtypes import TORCH_DTYPES, resolve_dtype
from specd.workers.runner.kv_cache import KvBudget, kv_block_bytes, kv_bytes_per_token
from specd.workers.runner.model_runner import ModelRunner
from specd.workers.spec.controller import SpecController, SpecEvent
from specd.workers.spec.draft_budget import head_weight_bytes, measure_draft_loop_bytes
from specd.workers.spec.draft_config import resolve_aux_layer_ids
from specd.workers.spec.draft_model import load_draft_head
from specd.workers.spec.head_files import read_draft_config
from specd.workers.spec.worker import SpeculativeWorker, verify_query_len
from specd.workers.structured.outputs import StructuredOutput

log = logging.getLogger("specd.engine")


def check_device(config: EngineConfig) -> None:
    """ValueError (a configuration error: exit 78) naming `--device` when this host has no
    device of that kind, or fewer than the tensor-parallel ranks need from its index on:
    torch built without CUDA, no GPU visible (CUDA_VISIBLE_DEVICES), an index past the
    last one. Checked before anything touches the device, whose own error (an
    AssertionError from torch) would read as a bug in specd (exit 70)."""
    if not config.device.startswith("cuda"):
        return
    if torch.version.cuda is None:
        raise ValueError(f"--device {config.device}: this torch ({torch.__version__}) is "
                         "built without CUDA; install a CUDA build or use --device cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(f"--device {config.device}: no CUDA device is visible (torch "
                         f"{torch.__version__}, CUDA {torch.version.cuda}"
                         + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None
                            else "") + "); use --device cpu")
    first = torch.device(config.device).index or 0
    count = torch.cuda.device_count()
    if first + config.tensor_parallel_size > count:
        raise ValueError(f"--device {config.device} with --tensor-parallel-size "
                         f"{config.tensor_parallel_size} needs devices cuda:{first}.."
                         f"cuda:{first + config.tensor_parallel_size - 1}; this host has "
                         f"{count}")


def build_worker(config: EngineConfig, model_config: ModelConfig,
                 structured: StructuredOutput) -> StepWorker[Any]:
    """The speculative worker (with its runner) when a draft model is configured, else the
    plain worker; both mask constrained rows with `structured`. Every step raises out of
    here: no device of the kind asked for, an unreadable head, one that does not fit the
    target, a bad controller configuration."""
    check_device(config)
    # Refuse a length the model cannot serve (its limit, its sliding window) before any
    # weight is read; `max_model_len` checks the same after the KV cache is sized.
    requested_model_len(config, model_config)
    # A module the quantization_config makes INT4 but the checkpoint stores dense: named
    # from the headers here, not by the loader as a tensor that matches no parameter.
    check_int4_storage(model_config)
    path = config.draft_model_path
    if config.speculative_algorithm is None or path is None:
        return PlainWorker(ModelRunner(config, model_config), structured)
    draft_config = read_draft_config(path)
    aux_layers = resolve_aux_layer_ids(draft_config, model_config.num_layers)
    # The head's K/V cache has the target's blocks, and its weights and captured loops take
    # device memory too: all come from the same budget (spec/draft_budget.py).
    dtype = TORCH_DTYPES[resolve_dtype(config, model_config)]
    limit = model_config.max_model_len
    loop_bytes = measure_draft_loop_bytes(
        draft_config, config.spec_topk, config.spec_num_steps, verify_query_len(config),
        config.max_num_seqs, min(config.max_model_len or limit, limit), config.block_size,
        dtype, torch.device(config.device)) if config.graphs_enabled else 0
    runner = ModelRunner(config, model_config, capture_layers=aux_layers,
                         verify_shape=(verify_query_len(config), config.spec_topk > 1),
                         extra_kv_elements_per_token=draft_config.kv_elements_per_token,
                         draft_weight_bytes=head_weight_bytes(draft_config, path, dtype),
                         draft_loop_bytes=loop_bytes)
    # The head shares the target's token embedding unless its checkpoint has its own.
    head = load_draft_head(path, runner.draft_embedding_weight(), dtype=runner.dtype,
                           device=runner.device)
    runner.backend.prepare_draft_head(head)
    controller = SpecController(config.spec_mode, config.spec_disable_batch_threshold,
                                measure=config.spec_auto_measure)
    return SpeculativeWorker(config, runner, head, controller, structured)


def engine_resolved(config: EngineConfig, worker: StepWorker[Any], model_config: ModelConfig,
                    max_model_len: int, structured: StructuredOutput) -> EngineResolved:
    """What an engine of `config` found at start-up (`EngineCore.resolved`): its worker's
    runner, graphs and KV budget, the model's EOS ids, the longest sequence served, and
    whether it serves structured output."""
    runner = worker.runner
    ranks, nodes = runner.ranks()
    budget = runner.kv_budget
    if config.num_kv_blocks is not None:  # the budget did not decide: report the blocks'
        budget = KvBudget(runner.num_kv_blocks * kv_block_bytes(
            runner.kv_model_config, config.block_size, runner.dtype), "num_kv_blocks")
    return EngineResolved(
        model_name=config.model_path.name,
        num_kv_blocks=runner.num_kv_blocks,
        block_size=config.block_size,
        max_model_len=max_model_len,
        dtype=runner.dtype_name,
        device=config.device,
        eos_token_ids=model_config.eos_token_ids,
        speculative=worker.speculative,
        overlap_schedule=config.overlap_enabled,
        graphs=worker.graphs_status(),
        graph_memory_bytes=worker.graph_memory_bytes,
        linears=runner.backend.linears_status(),
        # Per rank under tensor parallelism (the cache each rank holds).
        kv_bytes_per_token=kv_bytes_per_token(runner.kv_model_config, runner.dtype),
        kv_budget_bytes=budget.num_bytes,
        kv_budget_source=budget.source,
        kv_cache_tokens=runner.num_kv_blocks * config.block_size,
        ranks=ranks,
        expert_parallel=config.expert_parallel,
        structured_output=structured.status,
        nodes=nodes,
    )


def log_switch(event: SpecEvent | None) -> None:
    """One record per speculation switch (with its cause and figures)."""
    if event is not None:
        log.info("speculation %s", "on" if event.enabled else "off", extra=event.as_dict())


def requested_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence asked for: `config.max_model_len`, else the model's limit
    (max_position_embeddings). Raises a ValueError when it exceeds that limit or the
    model's sliding window (`ModelConfig.served_len`)."""
    return model_config.served_len(config.max_model_len)


def max_model_len(config: EngineConfig, model_config: ModelConfig, num_kv_blocks: int) -> int:
    """The longest sequence served: the configured value, else the model's limit capped by
    what the KV cache can hold (a sequence that cannot fit the cache could never finish)."""
    requested = requested_model_len(config, model_config)
    capacity = num_kv_blocks * config.block_size
    if config.max_model_len is None:
        if capacity < requested:
            log.info("max_model_len capped by the KV cache", extra={
                "event": "max_model_len_capped", "max_position_embeddings": requested,
                "kv_capacity_tokens": capacity})
        return min(requested, capacity)
    if requested > capacity:
        raise ValueError(
            f"max_model_len {requested} exceeds the KV cache's capacity of "
            f"{capacity} tokens ({num_kv_blocks} blocks of {config.block_size}); raise "
            "kv_cache_memory_bytes or lower max_model_len")
    return requested
