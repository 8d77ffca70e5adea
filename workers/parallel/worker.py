"""Ranks 1..N-1: one process each, started by rank 0 (driver.py) as a fresh interpreter
(launch.py; its entry is rank_main.py).

A rank reports `joining`, joins the process group and loads its shard (models/loader.py)
while a thread reports `loading` every second (rank 0 reads those beats, which the
scheduler's stage watch counts as progress, so a long load is not taken for a hang), then
reports `ready` (or `failed` with the traceback) on its pipe. It then serves the calls
rank 0 sends on that pipe until `stop` or until the pipe closes (rank 0 is gone): the same
model call as rank 0, over its own shard and its own part of the KV cache, whose outputs
it drops (rank 0 takes them). Every call is one message ((op, args): `encode`), serialized
by torch so its tensors arrive on this rank's device.
"""

from __future__ import annotations

import io
import logging
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from specd.logs import inherited_log_format, setup_logging
from specd.workers.models.config import ModelConfig
from specd.workers.models.loader import load_model
from specd.workers.models.registry import CausalLM
from specd.workers.parallel.context import (
    COLLECTIVE_TIMEOUT,
    ParallelContext,
    init_group,
    rank_device,
)
from specd.workers.parallel.rank_main import RankSpec, StatusPipe
from specd.workers.parallel.sharding import shard_model_config
from specd.workers.runner.kv_cache import allocate_kv_cache

log = logging.getLogger("specd.parallel")

STORE_HOST = "127.0.0.1"


def encode(op: str, *args: Any) -> bytes:
    """One call to the workers: (op, args) serialized by torch (tensors included)."""
    buffer = io.BytesIO()
    torch.save((op, args), buffer)
    return buffer.getvalue()


def decode(data: bytes, device: torch.device) -> tuple[str, tuple[Any, ...]]:
    """The call `encode` made, its tensors on `device`."""
    op, args = torch.load(io.BytesIO(data), map_location=device, weights_only=False)
    return op, args


def start_rank(spec: RankSpec, status: StatusPipe) -> RankServer:
    """Join the group (`joining` first) and load this rank's shard; the server of its
    calls. Raises what failed (rank_main.py reports it)."""
    setup_logging(inherited_log_format(), spec.log_level)  # rank 0's console format
    torch.set_num_threads(spec.num_threads)
    config = spec.config
    world = config.tensor_parallel_size
    device = rank_device(config.device, spec.rank)
    status.report("joining")
    store = dist.TCPStore(STORE_HOST, spec.store_port, world, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
    init_group(store, spec.rank, world, device)
    par = ParallelContext(spec.rank, world, config.expert_parallel)
    model_config = ModelConfig.from_dir(config.model_path)
    # Imported here: the runner module imports this package's driver.
    from specd.workers.models.linear_factory import linear_factory
    from specd.workers.runner.dtypes import TORCH_DTYPES, resolve_dtype

    dtype = TORCH_DTYPES[resolve_dtype(config, model_config)]
    model = load_model(model_config, device, dtype, linear_factory(model_config), par)
    return RankServer(model, shard_model_config(model_config, par), config.block_size, dtype,
                      device)


class RankServer:
    """Runs rank 0's calls on this rank's shard."""

    def __init__(self, model: CausalLM, local_config: ModelConfig, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.local_config = local_config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kv_caches: list[torch.Tensor] = []

    @torch.inference_mode()
    def serve(self, conn: Connection) -> None:
        """Until `stop`, or EOF on the pipe (rank 0 exited); then leave the group."""
        try:
            self._serve(conn)
        finally:
            dist.destroy_process_group()

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:
                log.info("rank 0 is gone; this rank exits", extra={"event": "rank_orphaned"})
                return
            op, args = decode(data, self.device)
            if op == "stop":
                return
            try:
                self.call(op, args)
            except Exception:  # noqa: BLE001 - rank 0 raises the same and handles it
                # A model error (a request the model cannot compute) happens on every rank
                # at the same point; this rank stays in step with rank 0, which isolates it.
                log.exception("call %s raised on rank %d", op, dist.get_rank(), extra={
                    "event": "rank_call_failed", "op": op})

    def call(self, op: str, args: tuple[Any, ...]) -> None:
        model = self.model
        if op == "forward":
            input_ids, positions, meta, capture_layers = args
            model(input_ids, positions, self.kv_caches, meta, capture_layers)
        elif op == "logits":
            model.compute_logits(*args)
        elif op == "embed":
            model.embed_tokens(*args)
        elif op == "copy_kv":
            model.copy_kv_slots(self.kv_caches, *args)
        elif op == "allocate_kv":
            self.kv_caches = allocate_kv_cache(self.local_config, args[0], self.block_size,
                                               self.dtype, self.device)
        else:
            raise ValueError(f"unknown call {op!r} from rank 0")
