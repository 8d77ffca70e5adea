"""Alignment of (token, expert) pairs for the fused MoE kernels (kernels/moe_w4a16.py):
vLLM's `moe_align_block_size`.

The M * k (token, slot) pairs, "pair" p = token * k + slot, sorted by expert (stable) and each
expert's run padded to a multiple of BLOCK_M with the sentinel M * k, so that every BLOCK_M
block of rows belongs to one expert; one expert id per block; the padded length. An id of -1
(the slot's expert is not held here: expert parallelism's expert map applied) sorts into one
extra run after the experts' whose blocks carry expert id -1, so that the kernels skip them
(vLLM's `expert_map` convention). Up to
ALIGN_MAX_PAIRS pairs (decode and verification) one Triton program does it all (histogram,
sort of expert * BLOCK_P + p, scatter, a search per block): one launch where the torch version
(`moe_align_block_size_ref`, used above that) takes about thirty. Neither synchronises with
the host; sizes are fixed by M, k, E and BLOCK_M.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ALIGN_MAX_PAIRS = 1024  # pairs up to which one Triton program aligns (its sort's width)
ALIGN_MAX_EXPERTS = 1024  # histogram bins of that program


# ----------------------------------------------------------------------------- reference


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Capacity of `sorted_ids`: every nonempty run (at most min(E + 1, pairs): the experts'
    and the one of ids -1) pads fewer than block_m rows, rounded up to whole blocks."""
    bound = num_pairs + min(num_experts + 1, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_m: int, num_experts: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] (ids in [-1, E)) -> (sorted_ids int32 [P], expert_ids int32
    [P / block_m], num_tokens_post_padded int32 [1]), P = max_padded_pairs(M * k, E, block_m).

    sorted_ids lists the pairs p = token * k + slot expert by expert (ascending expert, and
    ascending p within one; the pairs of id -1 last, as if of expert E), each run padded to a
    multiple of block_m with the sentinel M * k; entries from num_tokens_post_padded on are
    sentinels too. expert_ids[b] is the expert of block b, -1 for the blocks of id -1 and for
    blocks from num_tokens_post_padded on. Example (vLLM's):
    topk_ids [[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], block_m 4 -> sorted_ids
    [3, 6, 9, 12 | 0, 4, 10, 12 | 1, 7, 11, 12 | 2, 5, 8, 12 | 12 ...], expert_ids
    [1, 2, 3, 4, -1 ...], num_tokens_post_padded [16].
    """
    raw = topk_ids.reshape(-1).long()
    flat = torch.where(raw < 0, num_experts, raw)  # id -1: the extra run E
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount without a host sync
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # [M * k] pairs grouped by expert
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    capacity = max_padded_pairs(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(padded_ends - padded)[expert_of] + rank] = order.to(torch.int32)
    num_post = padded_ends[-1:]
    block_starts = torch.arange(0, capacity, block_m, device=device)
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where((block_starts < num_post) & (expert_ids < num_experts),
                             expert_ids, -1)
    return sorted_ids, expert_ids.to(torch.int32), num_post.to(torch.int32)


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, delta_ptr,
                      num_pairs, num_experts, capacity, BLOCK_M: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (1,): `moe_align_block_size_ref`'s outputs for num_pairs <= BLOCK_P pairs of
    experts < num_experts < BLOCK_E (ids -1 binned as num_experts). delta_ptr: int32
    [BLOCK_E] scratch."""
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < num_pairs
    ids = tl.load(ids_ptr + offs_p, mask=mask_p, other=0).to(tl.int32)
    ids = tl.where(ids < 0, num_experts, ids)
    counts = tl.histogram(ids, BLOCK_E, mask=mask_p)  # [BLOCK_E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    num_post = tl.sum(padded, 0)
    # The i-th pair in sorted order goes to slot i + delta[its expert]: the expert's padded
    # start minus its unpadded start. The vector goes through memory to be gathered.
    delta = (padded_end - padded) - (tl.cumsum(counts, 0) - counts)
    tl.store(delta_ptr + tl.arange(0, BLOCK_E), delta)
    for start in range(0, capacity, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.full([CHUNK], 0, tl.int32) + num_pairs,
                 mask=offs < capacity)
    keys = tl.sort(tl.where(mask_p, ids * BLOCK_P + offs_p, BLOCK_E * BLOCK_P))  # pads last
    tl.debug_barrier()  # the sentinels and delta are written before they are overwritten/read
    delta_of = tl.load(delta_ptr + keys // BLOCK_P, mask=mask_p, other=0)
    tl.store(sorted_ids_ptr + offs_p + delta_of, keys % BLOCK_P, mask=mask_p)
    tl.store(num_post_ptr, num_post)
    num_blocks = capacity // BLOCK_M
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        block_start = blocks * BLOCK_M
        # searchsorted(padded_end, block_start, right=True); bins past E end at num_post
        expert = tl.sum((padded_end[None, :] <= block_start[:, None]).to(tl.int32), axis=1)
        held = (block_start < num_post) & (expert < num_experts)  # not the run of ids -1
        tl.store(expert_ids_ptr + blocks, tl.where(held, expert, -1), mask=blocks < num_blocks)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align_block_size_ref`'s outputs, equal element for element: one `_moe_align_kernel`
    program on CUDA (or under the interpreter) for up to ALIGN_MAX_PAIRS pairs and
    ALIGN_MAX_EXPERTS - 1 experts (their bins and the one of ids -1), the torch version
    otherwise."""
    num_pairs = topk_ids.numel()
    runs_triton = topk_ids.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if (not runs_triton or not 0 < num_pairs <= ALIGN_MAX_PAIRS
            or num_experts >= ALIGN_MAX_EXPERTS):
        return moe_align_block_size_ref(topk_ids, block_m, num_experts)
    capacity = max_padded_pairs(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
    expert_ids = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts + 1)
    delta = torch.empty(block_e, dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](topk_ids.reshape(-1).contiguous(), sorted_ids, expert_ids,
                            num_post, delta, num_pairs, num_experts, capacity, BLOCK_M=block_m,
                            BLOCK_P=max(16, triton.next_power_of_2(num_pairs)),
                            BLOCK_E=block_e, CHUNK=32, num_warps=4)
    return sorted_ids, expert_ids, num_post
