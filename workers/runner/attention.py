"""Paged attention over per-head K/V: the metadata one step shares across layers, and the
torch path (the CPU's).

KV cache layout, per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K = [0],
V = [1]); token t of a sequence lives in slot `block_ids[t // block_size] * block_size +
t % block_size` of the flattened `[num_blocks * block_size, ...]` view.

Semantics (shared/contracts): a sequence with T query rows and KV length S (this step's
tokens included, written before attention) lets every row see the prefix keys [0, S - T);
among the last T keys row i sees key j iff j <= i (causal: prefill chunks, decode), or iff
bit j of `tree_mask[row]` is set (draft trees, T <= 64).

The CPU path batches by query length: sequences with the same T form one group whose KV
blocks are gathered once per layer (whole blocks, `index_select` on the block axis) into a
padded `[G, max_blocks * block_size]` key tensor and attended by one masked
`scaled_dot_product_attention`. Plain decode (every T = 1) is therefore one call per layer
whatever the batch size; prefill chunks of different lengths are one call each. The gather
indices and masks are built once per step in `build_attention_metadata`.

Which path a layer runs (this torch path or kernels/tree_attention.py, and MLA's latent
paths) is chosen once per model in workers/runner/attention_backend.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from specd.workers.runner.decode_stage import DecodeStage, StagePlan
from specd.workers.runner.host_copy import upload

MAX_TREE_TOKENS = 64  # one int64 bit mask per draft row


@dataclass(frozen=True)
class QueryGroup:
    """Sequences with the same number of query rows T, attended in one padded batch (CPU).

    rows: int64 [G * T], the flat query rows of the group, sequence by sequence.
    key_blocks: int64 [G * max_blocks], each sequence's block table padded with block 0.
    mask: bool [G, 1, T, max_blocks * block_size], True where a query row may attend a key.
    """

    rows: torch.Tensor
    key_blocks: torch.Tensor
    mask: torch.Tensor
    num_seqs: int
    num_query_rows: int
    is_all_rows: bool  # the group covers every row in order (no gather/scatter needed)
    stage_plan: StagePlan | None = None  # decode group with a kept K/V copy (decode_stage)


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers (see module docstring).

    query_start_loc int32 [B + 1]; seq_lens int32 [B]; block_tables int32 [B, max_blocks];
    slot_mapping int64 [N]; tree_mask int64 [N] or None. `groups` drives the CPU path and is
    empty when the metadata is built for CUDA. num_seqs = B; uniform_query_len: host-side
    figures so that choosing a captured graph reads no device tensor.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    tree_mask: torch.Tensor | None
    max_query_len: int
    max_seq_len: int
    block_size: int
    groups: tuple[QueryGroup, ...]
    num_seqs: int
    uniform_query_len: int | None  # T when every sequence has T rows (graph replay), else None


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    tree_mask: torch.Tensor | None = None,
    stage: DecodeStage | None = None,
    shift: torch.Tensor | None = None,
    max_shift: list[int] | None = None,
) -> AttentionMetadata:
    """Metadata for sequences laid out one after another.

    query_lens[b]: rows of sequence b this step (T); seq_lens[b]: its KV length after this
    step (S >= T); block_tables[b]: its block ids, covering at least S tokens; tree_mask:
    int64 [sum(query_lens)] on `device`, or None for causal rows; stage: the runner's kept
    decode K/V (CPU plain steps only), used for the group of query length 1.

    shift: int64 [B] on `device`, or None: positions the host does not know yet (overlap
    scheduling of speculative steps: the accepted drafts of the step in flight). Sequence
    b's KV length is then seq_lens[b] + shift[b], computed on the device (no host read);
    0 <= shift[b] <= max_shift[b], and block_tables[b] must cover seq_lens[b] + max_shift[b].
    """
    bounds = (seq_lens if max_shift is None
              else [s + m for s, m in zip(seq_lens, max_shift, strict=True)])
    _check_lengths(query_lens, bounds, block_tables, block_size, tree_mask)
    num_seqs = len(query_lens)
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables],
                          dtype=torch.int64)  # [B, max_blocks]
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    s_lens = torch.tensor(seq_lens, dtype=torch.int64)
    start_loc = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=start_loc[1:])
    # KV position of each query row: S - T + i for row i of its sequence.
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), q_lens)  # [N]
    kv_pos = (torch.arange(int(start_loc[-1])) - start_loc[seq_of_row]
              + (s_lens - q_lens)[seq_of_row])
    if shift is not None:
        # From here on the lengths live on the device: upload what the host built, shift.
        tables, seq_of_row, kv_pos = (upload(t, device) for t in (tables, seq_of_row, kv_pos))
        s_lens = upload(s_lens, device) + shift
        kv_pos = kv_pos + shift[seq_of_row]
    slot_mapping = tables[seq_of_row, kv_pos // block_size] * block_size + kv_pos % block_size
    groups: tuple[QueryGroup, ...] = ()
    if not uses_kernels(device):
        groups = _build_groups(query_lens, seq_lens, tables, start_loc, block_size, tree_mask,
                               slot_mapping, block_tables, stage, s_lens, bounds)
    return AttentionMetadata(
        query_start_loc=upload(start_loc.to(torch.int32), device),
        seq_lens=upload(s_lens.to(torch.int32), device),
        block_tables=upload(tables.to(torch.int32), device),
        slot_mapping=upload(slot_mapping, device),
        tree_mask=tree_mask,
        max_query_len=max(query_lens),
        max_seq_len=max(bounds),
        block_size=block_size,
        groups=groups,
        num_seqs=num_seqs,
        uniform_query_len=query_lens[0] if len(set(query_lens)) == 1 else None,
    )


def uses_kernels(device: torch.device) -> bool:
    """Whether attention on `device` runs the Triton kernels (CUDA) rather than the torch
    paths, which read the metadata's CPU groups: the one device test of attention."""
    return device.type == "cuda"


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache_layer: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write this step's k, v [N, num_kv_heads, head_dim] into their slots."""
    num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
    # K and V in one indexed copy: each op's dispatch is paid on the CPU.
    kv_cache_layer.view(2, -1, num_kv_heads, head_dim).index_copy_(
        1, slot_mapping, torch.stack((k, v)))


def copy_kv_slots(kv_caches: Sequence[torch.Tensor], src_slots: torch.Tensor,
                  dst_slots: torch.Tensor) -> None:
    """Copy the K and V of cache slots `src_slots` to `dst_slots` (int64 [M] each, slot =
    block * block_size + offset) in every layer [2, blocks, block_size, kv_heads, d]."""
    for layer in kv_caches:
        flat = layer.view(2, -1, *layer.shape[-2:])  # [2, slots, kv_heads, d]
        flat[:, dst_slots] = flat[:, src_slots]


def paged_attention_cpu(q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
    """q [N, num_heads, head_dim] over the paged cache -> [N, num_heads, head_dim]: one
    masked SDPA per query-length group (see module docstring)."""
    if not meta.groups:
        raise ValueError("attention metadata has no CPU groups (it was built for CUDA)")
    if len(meta.groups) == 1 and meta.groups[0].is_all_rows:
        return _attend_group(q, kv_cache_layer, meta.groups[0], scale)
    out = torch.empty_like(q)
    for group in meta.groups:
        out[group.rows] = _attend_group(q[group.rows], kv_cache_layer, group, scale)
    return out


def _attend_group(q: torch.Tensor, kv_cache_layer: torch.Tensor, group: QueryGroup,
                  scale: float) -> torch.Tensor:
    """q [G * T, heads, head_dim] of one group -> its attention output, same shape."""
    g, t = group.num_seqs, group.num_query_rows
    num_kv_heads, head_dim = kv_cache_layer.shape[-2:]
    # [2, G * max_blocks, block_size, kv_heads, head_dim] -> K, V [G, kv_heads, S_pad, head_dim]
    plan = group.stage_plan
    if plan is not None:
        # Rows of the kept copy are in its own order: attend the queries in that order.
        k_g, v_g = plan.stage.keys_values(kv_cache_layer, group.key_blocks, plan)
        if not plan.is_identity:
            q_rows = q.view(g, -1, head_dim)[plan.order]  # [G, heads, head_dim], row order
            o_rows = _attend_decode(q_rows, k_g, v_g, group.mask[plan.order], scale)
            return o_rows[plan.row_of]
    else:
        kv = kv_cache_layer.index_select(1, group.key_blocks)
        k_g = kv[0].view(g, -1, num_kv_heads, head_dim).transpose(1, 2)
        v_g = kv[1].view(g, -1, num_kv_heads, head_dim).transpose(1, 2)
    if t == 1:
        return _attend_decode(q.view(g, -1, head_dim), k_g, v_g, group.mask, scale)
    q_g = q.view(g, t, -1, head_dim).transpose(1, 2)  # [G, heads, T, head_dim]
    o_g = F.scaled_dot_product_attention(q_g, k_g, v_g, attn_mask=group.mask, scale=scale,
                                         enable_gqa=True)  # [G, heads, T, head_dim]
    return o_g.transpose(1, 2).reshape(g * t, -1, head_dim)


def _attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Decode attention: q [G, heads, d] over k, v [G, kv_heads, S_pad, d] with mask [G, 1,
    1, S_pad] -> [G, heads, d]. The heads sharing a KV head become that KV head's query
    rows (head h uses KV head h // group, as transformers' repeat_kv), so K/V are never
    repeated and the mask broadcasts over them."""
    g, _, head_dim = q.shape
    q_g = q.view(g, k.shape[1], -1, head_dim)  # [G, kv_heads, group, head_dim]
    o_g = F.scaled_dot_product_attention(q_g, k, v, attn_mask=mask, scale=scale)
    return o_g.reshape(g, -1, head_dim)


def _build_groups(query_lens: list[int], seq_lens: list[int], tables: torch.Tensor,
                  start_loc: torch.Tensor, block_size: int, tree_mask: torch.Tensor | None,
                  slot_mapping: torch.Tensor, block_tables: list[list[int]],
                  stage: DecodeStage | None, s_lens: torch.Tensor, bounds: list[int]
                  ) -> tuple[QueryGroup, ...]:
    """s_lens int64 [B]: the KV lengths (shifted, if they are); `bounds` bound them on the
    host (the groups' key width; seq_lens when nothing is shifted)."""
    members: dict[int, list[int]] = {}
    for b, t in enumerate(query_lens):
        members.setdefault(t, []).append(b)
    num_rows = int(start_loc[-1])
    groups = []
    for t, seqs in members.items():
        width = max(bounds[b] for b in seqs)
        group = _build_group(seqs, t, s_lens, width, tables, start_loc, block_size, tree_mask,
                             num_rows)
        if stage is not None and t == 1 and tree_mask is None and bounds is seq_lens:
            width = int(group.mask.shape[-1])
            plan = stage.plan([block_tables[b] for b in seqs], [seq_lens[b] for b in seqs],
                              width, slot_mapping[group.rows])
            group = replace(group, stage_plan=plan)
        groups.append(group)
    if stage is not None and 1 not in members:
        stage.invalidate()
    return tuple(groups)


def _build_group(seqs: list[int], t: int, all_s_lens: torch.Tensor, width: int,
                 tables: torch.Tensor, start_loc: torch.Tensor, block_size: int,
                 tree_mask: torch.Tensor | None, num_rows: int) -> QueryGroup:
    """One group; width: a host bound on its KV lengths (no length is read here)."""
    index = torch.tensor(seqs, dtype=torch.int64)
    s_lens = all_s_lens[index]  # [G]
    rows = (start_loc[index][:, None] + torch.arange(t)).reshape(-1)  # [G * T]
    max_blocks = -(-width // block_size)
    key_blocks = tables[index][:, :max_blocks].reshape(-1)  # [G * max_blocks]
    key_pos = torch.arange(max_blocks * block_size)  # [S_pad]
    # Key j relative to the first query key of its sequence: < 0 is prefix, [0, T) is new.
    rel = key_pos[None, None, :] - (s_lens - t)[:, None, None]  # [G, 1, S_pad]
    # Both rules stop at rel < T, i.e. key_pos < S: padding keys are never visible.
    row = torch.arange(t)[None, :, None]  # [1, T, 1]
    if tree_mask is None:
        mask = rel <= row  # [G, T, S_pad]
    else:
        bits = tree_mask.cpu()[rows].view(len(seqs), t, 1)  # [G, T, 1]
        new_key_seen = ((bits >> rel.clamp(0, t - 1)) & 1).bool()
        mask = (rel < 0) | ((rel < t) & new_key_seen)
    is_all_rows = len(seqs) * t == num_rows and bool(
        (rows == torch.arange(num_rows)).all())
    return QueryGroup(rows=rows, key_blocks=key_blocks, mask=mask[:, None], num_seqs=len(seqs),
                      num_query_rows=t, is_all_rows=is_all_rows)


def _check_lengths(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, tree_mask: torch.Tensor | None) -> None:
    if not query_lens or not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(f"need one query_len, seq_len and block table per sequence, got "
                         f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}")
    for b, (t, s, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 1 <= t <= s:
            raise ValueError(f"sequence {b}: need 1 <= query_len ({t}) <= seq_len ({s})")
        if len(table) * block_size < s:
            raise ValueError(f"sequence {b}: {len(table)} blocks of {block_size} cannot hold "
                             f"seq_len {s}")
        if tree_mask is not None and t > MAX_TREE_TOKENS:
            raise ValueError(f"sequence {b}: a tree mask covers at most {MAX_TREE_TOKENS} "
                             f"query rows, got {t}")
    if tree_mask is not None and tree_mask.shape != (sum(query_lens),):
        raise ValueError(f"tree_mask must have shape ({sum(query_lens)},), "
                         f"got {tuple(tree_mask.shape)}")
