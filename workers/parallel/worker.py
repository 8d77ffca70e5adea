"""Ranks 1..N-1 after their start (rank_main.py): join, load, then follow rank 0.

A rank reports `joining`, joins the process group through the TCP store, loads its shard
(models/loader.py) while its beats go on, and reports `ready`. Then it follows rank 0:
it reads each call from its node's step ring (ring.py; decoded by codec.py, a call's
device tensors arriving by the broadcast that follows it). The first is `runner`, with
the arguments rank 0's runner was built with: this rank builds its own over its shard
(`ModelRunner(local_model=...)`: the same memory profile, graph captures, KV cache and
backend, so the collectives in them match rank 0's). Every later call runs on it: a
backend's (`forward`, `run`, `kv_changed`: `Backend.follow`) or the model's (`logits`,
`embed`, `copy_kv`, `model`), until `stop`. Outputs are dropped: rank 0 has its own.

A call that raises here raises on rank 0 too (a request the model cannot compute, the same
on every rank): it is logged and this rank stays in step; rank 0 isolates it. A rank whose
rank 0 dies is killed with it (PR_SET_PDEATHSIG, on rank 0 or on its node's agent, which
stops its ranks when rank 0 falls silent).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from specd.logs import inherited_log_format, setup_logging
from specd.workers.config import EngineConfig, parse_host_port
from specd.workers.models.config import ModelConfig
from specd.workers.models.loader import load_model
from specd.workers.models.registry import CausalLM
from specd.workers.parallel.codec import decode
from specd.workers.parallel.context import (
    COLLECTIVE_TIMEOUT,
    ParallelContext,
    init_group,
    rank_device,
)
from specd.workers.parallel.rank_spec import RankSpec, StatusPipe
from specd.workers.parallel.ring import RingReader
from specd.workers.process.host_memory import keep_freed_host_memory

log = logging.getLogger("specd.parallel")

def start_rank(spec: RankSpec, status: StatusPipe) -> RankServer:
    """Join the group (`joining` first) and load this rank's shard; the server of its
    calls. Raises what failed (rank_main.py reports it)."""
    setup_logging(inherited_log_format(), spec.log_level)  # rank 0's console format
    keep_freed_host_memory()  # as the scheduler does: a rank's steps allocate alike
    torch.set_num_threads(spec.num_threads)
    config = spec.config
    world = config.tensor_parallel_size
    device = rank_device(config.device, spec.local_rank)
    reader = RingReader(spec.ring_fd, spec.reader)
    status.report("joining")
    host, port = parse_host_port(spec.store_addr)
    store = dist.TCPStore(host, port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    init_group(store, spec.rank, world, device)
    par = ParallelContext(spec.rank, world, config.expert_parallel)
    model_config = ModelConfig.from_dir(config.model_path)
    # Imported here: the runner module imports this package's driver.
    from specd.workers.models.linear_factory import linear_factory
    from specd.workers.runner.dtypes import TORCH_DTYPES, resolve_dtype

    dtype = TORCH_DTYPES[resolve_dtype(config, model_config)]
    model = load_model(model_config, device, dtype, linear_factory(model_config), par)
    return RankServer(config, model_config, model, reader, device)


class RankServer:
    """Follows rank 0's calls on this rank's shard (module docstring)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model: CausalLM,
                 reader: RingReader, device: torch.device) -> None:
        self.config = config
        self.model_config = model_config
        self.model = model
        self.reader = reader
        self.device = device

    def serve(self) -> None:
        """Build the runner (the first call), follow until `stop`, leave the group."""
        from specd.workers.runner.model_runner import ModelRunner

        try:
            op, args = self.next_call()
            if op != "runner":
                raise ValueError(f"rank 0's first call is {op!r}, not runner")
            capture_layers, verify_shape, extra_kv = args
            runner = ModelRunner(self.config, self.model_config, capture_layers=capture_layers,
                                 verify_shape=verify_shape,
                                 extra_kv_elements_per_token=extra_kv, local_model=self.model)
            self.follow(runner)
        finally:
            dist.destroy_process_group()

    def next_call(self) -> tuple[str, tuple[Any, ...]]:
        return decode(self.reader.read(), self.device, _broadcast_from_rank0)

    @torch.inference_mode()
    def follow(self, runner: Any) -> None:
        """Every call until `stop` (runner: this rank's ModelRunner)."""
        while True:
            op, args = self.next_call()
            if op == "stop":
                return
            try:
                run_call(runner, op, args)
            except Exception:  # noqa: BLE001 - rank 0 raises the same and handles it
                # A model error (a request the model cannot compute) happens on every rank
                # at the same point; this rank stays in step with rank 0, which isolates it.
                log.exception("call %s raised on rank %d", op, dist.get_rank(), extra={
                    "event": "rank_call_failed", "op": op})


def run_call(runner: Any, op: str, args: tuple[Any, ...]) -> None:
    """Call (op, args) of rank 0 on `runner` (a ModelRunner over this rank's shard)."""
    model = runner.model
    if op in ("forward", "run", "kv_changed"):
        runner.backend.follow(op, args)
    elif op == "logits":
        model.compute_logits(*args)
    elif op == "embed":
        model.embed_tokens(*args)
    elif op == "copy_kv":
        model.copy_kv_slots(runner.kv_caches, *args)
    elif op == "model":
        input_ids, positions, meta, capture_layers = args
        model(input_ids, positions, runner.kv_caches, meta, capture_layers)
    else:
        raise ValueError(f"unknown call {op!r} from rank 0")


def _broadcast_from_rank0(buffer: torch.Tensor) -> None:
    dist.broadcast(buffer, src=0)
