"""Rank 0 of tensor parallelism: the scheduler process's side.

`start_parallel_model` hosts the group's TCP store (on loopback, or at `--dist-init-addr`
with several nodes), starts ranks 1..L-1 of this node (local_ranks.py: fresh interpreters
reading the step ring) and links the other nodes (nodes.py: their agents start theirs),
loads rank 0's own shard while they start and load theirs, joins the process group with
them and waits until every rank reports ready (a rank that fails raises here with its
traceback; the others are stopped). It returns a `DriverModel`: rank 0's shard (`local`)
and the group (`workers`).

From then on rank 0 announces every model execution (`RankGroup.call`, the `Peers` of
peers.py): the call is encoded once (codec.py: no pickling, a tensor is its bytes; on a
GPU its tensors follow as one broadcast), written once into the step ring for the local
ranks (ring.py) and sent once to each other node, then run on rank 0's shard. Every rank
runs it on its own backend in the same order, so all reach the same collectives. Outputs
are rank 0's; nothing comes back. The collectives inside carry COLLECTIVE_TIMEOUT; a rank
waiting for the next call has none (an idle engine is not a failure).

A rank or node that dies is a failure of the whole engine, never of a request: a call
that finds one gone, or that raises while one is gone (the collective it was in broke)
or from torch.distributed itself, raises `RankFailed`, which `EngineCore.step` does not
isolate, so the scheduler process exits 75 and the front fails every open request. A node
that goes silent is noticed by a thread (nodes.py), which calls back (`watch`). Local ranks
die with rank 0 (PR_SET_PDEATHSIG); other nodes' agents stop theirs when rank 0 is silent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from specd.workers.config import EngineConfig
from specd.workers.models.config import ModelConfig
from specd.workers.models.layers import LinearFactory
from specd.workers.models.loader import load_model
from specd.workers.models.registry import CausalLM
from specd.workers.parallel.codec import encode
from specd.workers.parallel.context import (
    COLLECTIVE_TIMEOUT,
    ParallelContext,
    init_group,
    rank_device,
)
from specd.workers.parallel.launch import EXIT_GRACE_S, RankProcess
from specd.workers.parallel.local_ranks import STOP_TIMEOUT_S, WorkerGroup, wait_for
from specd.workers.parallel.nodes import NodeLinks
from specd.workers.parallel.peers import Peers, RankFailed
from specd.workers.parallel.sharding import shard_model_config
from specd.workers.runner.attention import AttentionMetadata

log = logging.getLogger("specd.parallel")

STORE_HOST = "127.0.0.1"

__all__ = ["DriverModel", "RankFailed", "RankGroup", "start_parallel_model"]


class RankGroup(Peers):
    """Ranks 1..N-1 as rank 0 sees them (module docstring): `local` (this node's, their
    processes and step ring) and `nodes` (the others)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        host, port = config.dist_init_host_port or (STORE_HOST, 0)
        # Port 0: the store listens on a free port, which the ranks are told.
        self.store = dist.TCPStore(host, port, config.tensor_parallel_size, is_master=True,
                                   wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        self.store_addr = f"{host}:{self.store.port}"
        self.device = rank_device(config.device, 0)
        # The links first: the other nodes' agents read the config they publish.
        self.nodes = NodeLinks(config, self.store, host)
        try:
            self.local = WorkerGroup(config, range(1, config.ranks_per_node), self.store_addr)
        except BaseException:
            self.nodes.close()
            raise

    @property
    def is_leader(self) -> bool:
        return True

    @property
    def processes(self) -> list[RankProcess]:
        """This node's rank processes, rank 1 first."""
        return self.local.processes

    def wait_for(self, expected: str, nodes_timeout_s: float) -> None:
        """local_ranks.wait_for over this node's ranks (COLLECTIVE_TIMEOUT), then over each
        other node (`nodes_timeout_s`: they may start later than this one)."""
        with self.nodes.waiting():
            wait_for(self.local.processes, expected, COLLECTIVE_TIMEOUT.total_seconds())
            wait_for(self.nodes.members, expected, nodes_timeout_s)

    @contextmanager
    def call(self, op: str, *args: Any) -> Iterator[None]:
        self.send(op, *args)
        try:
            yield
        except Exception as e:
            self.call_failed(e)
            raise

    def send(self, op: str, *args: Any) -> None:
        """One call to every other rank (module docstring); RankFailed if one is gone."""
        self.check_alive()
        encoded = encode(op, *args)
        self.local.write(encoded.frame)
        self.nodes.send(encoded.frame)
        if encoded.device_buffer is not None:
            dist.broadcast(encoded.device_buffer, src=0)

    def check_alive(self, grace_s: float = 0.0) -> None:
        """RankFailed naming the first rank of this node that has exited (waiting up to
        `grace_s` for each to be seen exited), or the node that failed."""
        self.local.check_alive(grace_s)
        self.nodes.check()

    def call_failed(self, error: Exception) -> None:
        """Rank 0's part of a call raised `error`: RankFailed (chained to it) when a rank
        or node is gone or torch.distributed raised; otherwise the caller re-raises
        `error` (the same error on every rank: the model's, which the engine isolates)."""
        try:
            self.check_alive(EXIT_GRACE_S)
        except RankFailed as failed:
            raise failed from error
        if isinstance(error, dist.DistError):
            raise RankFailed(f"the process group failed: {error}") from error

    def watch(self, callback: Callable[[Exception], None]) -> None:
        """`callback(failure)` from a thread when another node fails (nodes.py)."""
        self.nodes.watch(callback)

    def describe_all(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """("rank R pid P on DEVICE[ of node N (HOST)]" for every rank, rank 0 first;
        "node N (HOST): ranks A-B" for every node when there are several)."""
        local = [(0, os.getpid(), str(self.device))] + [
            (p.rank, p.pid, p.device) for p in self.local.processes]
        ranks = [f"rank {r} pid {pid} on {device}" for r, pid, device in local]
        ranks += self.nodes.rank_entries()
        if not self.nodes.members:
            return tuple(ranks), ()
        per_node = self.config.ranks_per_node
        nodes = [f"node 0 ({os.uname().nodename}: ranks 0-{per_node - 1})"]
        nodes += self.nodes.node_entries()
        return tuple(ranks), tuple(nodes)

    def abort(self) -> None:
        """After a failed start: SIGTERM the local ranks at once (one may be waiting to join
        the group, where it reads no call), drop the nodes' links, leave the group."""
        self.local.abort()
        self.nodes.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        """Stop every rank (`stop`; a local one left after STOP_TIMEOUT_S is terminated),
        tell the other nodes, leave the group."""
        try:
            self.send("stop")
        except RankFailed as e:  # one is gone already; the others are stopped below
            log.info("a rank was gone at stop (%s)", e, extra={"event": "rank_gone"})
        self.local.join(STOP_TIMEOUT_S)
        self.nodes.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class DriverModel(nn.Module):
    """Rank 0's shard (`local`) behind the models' interface, for the runner's own calls
    (the logits, KV copies): each is announced to the other ranks first (`workers.call`).
    The backends run `local` and announce their executions themselves. `config` and
    `model` are the local shard's."""

    def __init__(self, local: CausalLM, workers: RankGroup) -> None:
        super().__init__()
        self.local = local
        self.workers = workers
        self.config = local.config
        self.model = local.model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], meta: AttentionMetadata,
                capture_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.workers.call("model", input_ids, positions, meta, tuple(capture_layers)):
            return self.local(input_ids, positions, kv_caches, meta, capture_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.workers.call("logits", hidden):
            return self.local.compute_logits(hidden)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        with self.workers.call("embed", input_ids):
            return self.local.embed_tokens(input_ids)

    def copy_kv_slots(self, kv_caches: Sequence[torch.Tensor], src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
        # No collective: a rank that died during the copy is seen at the next call.
        with self.workers.call("copy_kv", src_slots, dst_slots):
            self.local.copy_kv_slots(kv_caches, src_slots, dst_slots)

    def close(self) -> None:
        self.workers.close()


def start_parallel_model(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                         dtype: torch.dtype, make_linear: LinearFactory) -> DriverModel:
    """Start the other ranks and load every rank's shard (module docstring); whole or
    raises, with the ranks stopped."""
    par = ParallelContext(0, config.tensor_parallel_size, config.expert_parallel)
    shard_model_config(model_config, par)  # a size that does not divide raises, before starts
    workers = RankGroup(config)
    try:
        # Rank 0 loads while the others start (loading needs no process group); in the
        # waits below it reads their beats, which the stage watch sees as progress.
        local = load_model(model_config, device, dtype, make_linear, par)
        # A rank that fails to start (an import) is seen here, not as a group that never
        # completes; a node not started yet is named once the wait runs out.
        workers.wait_for("joining", config.dist_init_timeout_s)
        init_group(workers.store, 0, config.tensor_parallel_size, device)
        workers.wait_for("ready", COLLECTIVE_TIMEOUT.total_seconds())
    except BaseException:
        workers.abort()
        raise
    ranks, nodes = workers.describe_all()
    log.info("tensor parallel group ready", extra={
        "event": "tensor_parallel_ready", "world_size": config.tensor_parallel_size,
        "expert_parallel": config.expert_parallel,
        "worker_pids": [p.pid for p in workers.processes], "ranks": list(ranks),
        "nodes": list(nodes)})
    return DriverModel(local, workers)
