"""A rank's place in the tensor-parallel group and the collectives the sharded model calls.

The model code calls `all_reduce` after each row-parallel block (attention, MLP or MoE) and
`gather_last` on the vocab-parallel logits whatever the size: `SINGLE_RANK` (size 1, no
process group) returns its input unchanged, so the one-process path runs exactly the
operations it ran before parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective that waits longer than this raises on the ranks that reached it (a rank that
# died or hangs). Generous: it bounds a hang, not a step.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class ParallelContext:
    """rank in [0, world_size); expert_parallel: routed experts are placed whole on ranks
    (`--expert-parallel`) instead of each expert's intermediate dimension being split."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal part of `size` elements; ValueError naming
        `what` unless the size divides evenly."""
        if size % self.world_size:
            raise ValueError(f"tensor_parallel_size {self.world_size} does not divide {what} "
                             f"({size})")
        length = size // self.world_size
        return self.rank * length, length

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place); `x` itself at size 1."""
        if self.is_parallel:
            dist.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [..., n] side by side in rank order -> [..., world_size * n]."""
        if not self.is_parallel:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


SINGLE_RANK = ParallelContext()


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> None:
    """Join the default process group (every rank calls this once, with the same store).
    On CUDA the rank's device becomes the current one first: NCCL runs each rank's
    collectives on the current device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)


def rank_device(device: str, rank: int) -> torch.device:
    """The device of `rank`: the CPU for every rank, or CUDA device (base + rank) where
    `device` names the base (cuda = cuda:0)."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)
