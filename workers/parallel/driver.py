"""Rank 0 of tensor parallelism: the scheduler process's side.

`start_parallel_model` starts ranks 1..N-1 (worker.py, one fresh interpreter each:
launch.py), loads rank
0's own shard while they start and load theirs, joins the process group with them, and
waits until every rank reports ready (a rank that fails raises here with its traceback;
the others are stopped). It returns a `DriverModel`: the model interface the runner, its
backends and the speculative worker call (`forward`, `compute_logits`, `embed_tokens`,
`copy_kv_slots`), each call sent to every worker first and then run on rank 0's shard, so
all ranks reach the same collectives in the same order. Outputs are rank 0's.

The calls travel over one pipe per worker, serialized once (a broadcast without a
collective: a worker waiting for the next step has no timeout to run out while the engine
is idle, and sees EOF when rank 0 is gone). The collectives inside a forward carry
`COLLECTIVE_TIMEOUT`.

A rank that dies is a failure of the whole engine, never of a request: a call that finds
a worker gone, or that raises while one is gone (the collective it was in broke) or from
torch.distributed itself, raises `RankFailed`, which `EngineCore.step` does not isolate, so
the scheduler process exits 75 and the front fails every open request. Workers die with
rank 0 (PR_SET_PDEATHSIG) and exit on EOF of their pipe.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
from torch import nn

from specd.workers.config import EngineConfig
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory
from specd.workers.models.loader import load_model
from specd.workers.models.registry import CausalLM
from specd.workers.parallel.context import (
    COLLECTIVE_TIMEOUT,
    ParallelContext,
    init_group,
    rank_device,
)
from specd.workers.parallel.launch import RANK_MODULE, RankProcess, module_command
from specd.workers.parallel.rank_main import RankSpec
from specd.workers.parallel.sharding import shard_model_config
from specd.workers.parallel.worker import STORE_HOST, encode
from specd.workers.runner.attention import AttentionMetadata
from specd.workers.runner.kv_cache import allocate_kv_cache

log = logging.getLogger("specd.parallel")

STOP_TIMEOUT_S = 10.0
# After a call raised: how long a worker may take to be seen exited (the broken collective
# is often noticed before the dead process is reaped).
EXIT_GRACE_S = 0.5


class RankFailed(RuntimeError):
    """A worker rank died or the process group broke: the engine cannot go on."""


class WorkerGroup:
    """Ranks 1..N-1 as rank 0 sees them: their processes (launch.py), each with its pipe."""

    def __init__(self, config: EngineConfig) -> None:
        world = config.tensor_parallel_size
        # Port 0: the store listens on a free port, which the workers are told.
        self.store = dist.TCPStore(STORE_HOST, 0, world, is_master=True,
                                   wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.processes: list[RankProcess] = []
        try:
            for rank in range(1, world):
                spec = RankSpec(rank, self.store.port, config, torch.get_num_threads(), level,
                                os.getpid())
                self.processes.append(RankProcess(
                    rank, str(rank_device(config.device, rank)),
                    module_command(RANK_MODULE, spec.arguments())))
        except BaseException:
            self.abort()
            raise

    def wait_for(self, expected: str, timeout_s: float) -> None:
        """Until every worker reports `expected` ("joining": about to join the group,
        "ready": loaded), reading their `loading` beats meanwhile; RuntimeError with the
        traceback of one that failed, or naming one that exited (with the first error
        line of its stderr) or did not get there in `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            status = "loading"
            while status == "loading":
                # One blocking wait for a message, the exit or the deadline: between beats
                # this thread does not move, so the stage watch sees the beats and only them
                # (a stopped worker is silence).
                ready = wait([process.pipe, process.sentinel],
                             max(0.0, deadline - time.monotonic()))
                if not process.pipe.poll():  # what it sent before it exited is read first
                    if process.sentinel in ready:
                        raise self._exited(process, expected)
                    raise RuntimeError(f"{process.describe()} not {expected} after "
                                       f"{timeout_s:.0f} s")
                try:
                    status, detail = process.pipe.recv()
                except EOFError as e:  # it exited without a word (a signal, os._exit)
                    raise self._exited(process, expected) from e
            if status != expected:
                raise RuntimeError(f"{process.describe()} failed while starting:\n{detail}")

    @staticmethod
    def _exited(process: RankProcess, expected: str) -> RuntimeError:
        process.join(EXIT_GRACE_S)  # its exit code, once reaped
        error = process.error_line()
        return RuntimeError(f"{process.describe()} exited with code {process.exitcode} "
                            f"before it was {expected}" + (f": {error}" if error else ""))

    def describe(self, rank: int) -> str:
        """"rank R (pid P on DEVICE)" of worker `rank` (1..N-1): how failures name a rank,
        so that the failure's log record alone says which process and device it was."""
        return self.processes[rank - 1].describe()

    def send(self, op: str, *args: object) -> None:
        """Send one call to every worker (serialized once); RankFailed if one is gone."""
        self.check_alive(0.0)
        data = encode(op, *args)
        for process in self.processes:
            try:
                process.pipe.send_bytes(data)
            except OSError as e:
                raise RankFailed(f"{process.describe()} no longer reads its calls ({e})") from e

    def check_alive(self, grace_s: float) -> None:
        """RankFailed naming the first worker that has exited (waiting up to `grace_s` for
        each to be seen exited)."""
        for process in self.processes:
            if grace_s:
                process.join(grace_s)
            if not process.is_alive():
                raise RankFailed(f"{process.describe()} exited with code {process.exitcode}")

    def call_failed(self, error: Exception) -> None:
        """Rank 0's call raised `error`: RankFailed (chained to it) when a worker is gone
        or torch.distributed raised; otherwise the caller re-raises `error` (the same
        error on every rank: the model's, which the engine isolates)."""
        try:
            self.check_alive(EXIT_GRACE_S)
        except RankFailed as failed:
            raise failed from error
        if isinstance(error, dist.DistError):
            raise RankFailed(f"the process group failed: {error}") from error

    def abort(self) -> None:
        """After a failed start: SIGTERM the workers at once (one may be waiting to join the
        group, where it reads no `stop`) and leave the group if it was joined."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            process.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        """Stop the workers (`stop`, then SIGTERM after STOP_TIMEOUT_S) and leave the group."""
        for process in self.processes:
            try:
                process.pipe.send_bytes(encode("stop"))
            except OSError as e:  # that worker has exited already; it is joined below
                log.info("rank already gone at stop (%s)", e, extra={"event": "rank_gone"})
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
                process.join(STOP_TIMEOUT_S)
            process.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class DriverModel(nn.Module):
    """Rank 0's shard (`local`) behind the model interface; every call also runs on the
    workers (module docstring). `config` and `model` are the local shard's."""

    def __init__(self, local: CausalLM, workers: WorkerGroup, local_config: ModelConfig,
                 device: str) -> None:
        super().__init__()
        self.device = device  # `--device`: rank r runs on rank_device(device, r)
        self.local = local
        self.workers = workers
        self.local_config = local_config
        self.config = local.config
        self.model = local.model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], meta: AttentionMetadata,
                capture_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.workers.send("forward", input_ids, positions, meta, tuple(capture_layers))
        try:
            return self.local(input_ids, positions, kv_caches, meta, capture_layers)
        except Exception as e:
            self.workers.call_failed(e)
            raise

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.workers.send("logits", hidden)
        try:
            return self.local.compute_logits(hidden)
        except Exception as e:
            self.workers.call_failed(e)
            raise

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.workers.send("embed", input_ids)
        try:
            return self.local.embed_tokens(input_ids)
        except Exception as e:
            self.workers.call_failed(e)
            raise

    def copy_kv_slots(self, kv_caches: Sequence[torch.Tensor], src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
        # No collective: a worker that died during the copy is seen at the next call.
        self.workers.send("copy_kv", src_slots, dst_slots)
        self.local.copy_kv_slots(kv_caches, src_slots, dst_slots)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                          device: torch.device) -> list[torch.Tensor]:
        """Every rank allocates `num_blocks` blocks of its own layer shape (its K/V heads;
        MLA's whole latent rows); returns rank 0's."""
        self.workers.send("allocate_kv", num_blocks)
        return allocate_kv_cache(self.local_config, num_blocks, block_size, dtype, device)

    def ranks(self) -> tuple[str, ...]:
        """"rank R pid P on DEVICE" for every rank, rank 0 (this process) first."""
        pids = [os.getpid()] + [p.pid for p in self.workers.processes]
        return tuple(f"rank {r} pid {pid} on {rank_device(self.device, r)}"
                     for r, pid in enumerate(pids))

    def close(self) -> None:
        self.workers.close()


def start_parallel_model(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                         dtype: torch.dtype, make_linear: LinearFactory) -> DriverModel:
    """Start the workers and load every rank's shard (module docstring); whole or raises,
    with the workers stopped."""
    par = ParallelContext(0, config.tensor_parallel_size, config.expert_parallel)
    local_config = shard_model_config(model_config, par)  # a size that does not divide raises
    workers = WorkerGroup(config)
    try:
        # Rank 0 loads while the workers start (loading needs no process group); in the
        # waits below it reads the workers' beats, which the stage watch sees as progress.
        local = load_model(model_config, device, dtype, make_linear, par)
        # A worker that fails to start (an import) is seen here, not as a group that
        # never completes.
        workers.wait_for("joining", COLLECTIVE_TIMEOUT.total_seconds())
        init_group(workers.store, 0, config.tensor_parallel_size, device)
        workers.wait_for("ready", COLLECTIVE_TIMEOUT.total_seconds())
    except BaseException:
        workers.abort()
        raise
    log.info("tensor parallel group ready", extra={
        "event": "tensor_parallel_ready", "world_size": config.tensor_parallel_size,
        "expert_parallel": config.expert_parallel,
        "worker_pids": [p.pid for p in workers.processes]})
    return DriverModel(local, workers, local_config, config.device)
