"""The per-GPU weight and KV arithmetic behind `specctl plan` (workers/plan/deployment.py states the
placement rules and what each tensor costs): pure functions of the parsed configs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specd.workers.models.config import ModelConfig
from specd.workers.models.deepseek_config import MlaConfig, MoeConfig
from specd.workers.models.quantization import QuantConfig, is_quantized
from specd.workers.spec.draft_config import DraftConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ROUTER_BYTES = 4  # float32 whatever the dtype (moe.TopkRouter)
PACK_FACTOR = 8  # int4 values per int32 word (kernels/int4_layout.py)
WEIGHT_SHAPE_BYTES = 16  # Int4Linear.weight_shape: int64 [2]
DEFAULT_RESERVE_BYTES = 8 * 2**30
GATE_UP_DOWN = ("gate", "up", "down")


@dataclass(frozen=True)
class PlanOptions:
    """How the model is to be served. gpu_memory_bytes: one GPU's memory; memory_fraction: the
    fraction of it specd may use; reserve_bytes: what the plan keeps for activations, graphs
    and buffers; block_size: KV tokens per block (the engine's --block-size)."""

    gpu_memory_bytes: int
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    dtype: str = "bfloat16"
    memory_fraction: float = 0.90
    reserve_bytes: int = DEFAULT_RESERVE_BYTES
    block_size: int = 16
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"gpu_memory_bytes must be > 0, got {self.gpu_memory_bytes}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("expert_parallel needs tensor_parallel_size > 1 (the ranks that "
                             "hold the experts)")


@dataclass(frozen=True)
class WeightPart:
    """One kind of weight on one GPU: its bytes and how it is placed across the ranks."""

    kind: str
    bytes: int
    placement: str


class _Tally:
    """Bytes per kind of weight on one GPU, in the order first seen (one plan's builder)."""

    def __init__(self, options: PlanOptions, qcfg: QuantConfig | None, name_prefix: str) -> None:
        self.n = options.tensor_parallel_size
        self.ep = options.expert_parallel
        self.dtype = options.dtype
        self.dt = DTYPE_BYTES[options.dtype]
        self.qcfg = qcfg
        self.name_prefix = name_prefix
        self.bytes: dict[str, int] = {}
        self.placement: dict[str, str] = {}
        self.precision: dict[str, set[str]] = {}

    def add(self, kind: str, nbytes: int, placement: str, precision: str) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.placement.setdefault(kind, placement)
        self.precision.setdefault(kind, set()).add(precision)

    def linear(self, kind: str, placement: str, names: tuple[str, ...], in_local: int,
               out_local: int, bias: int = 0) -> None:
        """One (possibly fused) linear on this rank: [out_local, in_local] and `bias` bias
        elements; INT4 when every fused name is quantized (as make_linear_factory)."""
        if self._is_int4(names):
            self.add(kind, self.int4_bytes(names[0], in_local, out_local) + bias * self.dt,
                     placement, "INT4")
        else:
            self.add(kind, (in_local * out_local + bias) * self.dt, placement, self.dtype)

    def plain(self, kind: str, elements: int, placement: str) -> None:
        """`elements` values of the serving dtype."""
        self.add(kind, elements * self.dt, placement, self.dtype)

    def _is_int4(self, names: tuple[str, ...]) -> bool:
        flags = [self.is_quantized(name) for name in names]
        if any(flags) and not all(flags):
            raise ValueError(f"fused linear {names} mixes INT4 and dense shards in the "
                             f"quantization_config; the engine cannot build it")
        return all(flags)

    def is_quantized(self, name: str) -> bool:
        """Whether the model's module `name` is INT4: matched as the checkpoint spells it,
        under the weight prefix (Int4LinearFactory.is_quantized)."""
        return is_quantized(self.name_prefix + name, self.qcfg)

    @property
    def whole(self) -> str:
        """The placement of a replicated weight."""
        return "whole on every rank" if self.n > 1 else "whole"

    def int4_bytes(self, name: str, in_features: int, out_features: int) -> int:
        """One INT4 linear (or expert projection) of [out, in] on this rank (Int4Linear,
        Int4RoutedExperts): weight_packed int32 [out, ceil(in/8)], weight_scale [out, groups]
        in the serving dtype (groups = in / group_size, 1 channel-wise), weight_zero_point
        int32 [ceil(out/8), groups] when asymmetric, weight_shape int64 [2]. ValueError naming
        the linear when a split leaves partial groups or words."""
        if self.qcfg is None:
            raise ValueError(f"{name}: INT4 without a quantization config")
        group = self.qcfg.group_size
        if group is not None and in_features % group:
            raise ValueError(f"{name}: {in_features} input columns (per rank) are not whole "
                             f"INT4 groups of {group}; choose a tensor-parallel size that "
                             f"keeps them whole")
        if not self.qcfg.symmetric and self.n > 1 and out_features % PACK_FACTOR:
            raise ValueError(f"{name}: {out_features} output rows per rank split the zero "
                             f"points' int32 words (8 rows each); choose a tensor-parallel "
                             f"size that keeps them whole")
        groups = in_features // group if group is not None else 1
        zero_points = 0 if self.qcfg.symmetric else -(-out_features // PACK_FACTOR) * groups * 4
        return (out_features * -(-in_features // PACK_FACTOR) * 4
                + out_features * groups * self.dt + zero_points + WEIGHT_SHAPE_BYTES)

    def parts(self) -> tuple[WeightPart, ...]:
        return tuple(WeightPart(f"{kind} ({' + '.join(sorted(self.precision[kind]))})", nbytes,
                                self.placement[kind])
                     for kind, nbytes in self.bytes.items())


def check_split(cfg: ModelConfig, options: PlanOptions) -> None:
    """ValueError naming the config value that N ranks cannot split."""
    n = options.tensor_parallel_size
    what = f"tensor-parallel size {n}"

    def need(value: int, field: str, why: str = "") -> None:
        if value % n:
            raise ValueError(f"{field} ({value}) is not divisible by the {what}{why}")

    need(cfg.num_heads, "num_attention_heads")
    if cfg.mla is None:
        local_kv_heads(cfg, n)
    need(cfg.vocab_size, "vocab_size", " (the embedding and lm_head are split by rows)")
    need(cfg.intermediate_size, "intermediate_size")
    moe = cfg.moe
    if moe is not None:
        need(moe.moe_intermediate_size * moe.num_shared_experts,
             "moe_intermediate_size * n_shared_experts", " (the shared experts' width)")
        if options.expert_parallel:
            need(moe.num_routed_experts, "n_routed_experts",
                 " (expert parallelism places whole experts on ranks)")
        else:
            need(moe.moe_intermediate_size, "moe_intermediate_size",
                 " (each routed expert's width is split)")
    if options.expert_parallel and moe is None:
        raise ValueError(f"expert parallelism needs routed experts; {cfg.architecture} has none")


def local_kv_heads(cfg: ModelConfig, n: int) -> int:
    """The K/V heads one of `n` ranks holds of a dense model: num_key_value_heads / n when
    n divides them, else 1 when n is a multiple of them (each K/V head then shared by the
    n / num_key_value_heads ranks whose query heads use it: parallel/sharding.py
    `replicates_kv_heads`, which the plan tests hold this to); ValueError otherwise."""
    kv = cfg.num_kv_heads
    if kv % n == 0:
        return kv // n
    if n % kv == 0:
        return 1
    raise ValueError(f"num_key_value_heads ({kv}) is neither divisible by the tensor-parallel "
                     f"size {n} nor a divisor of it (a rank holds whole K/V heads, or one "
                     f"that N / num_key_value_heads ranks share)")


def _kv_heads_placement(cfg: ModelConfig, n: int) -> str:
    """How a dense model's K/V heads lie on the ranks, in words."""
    if cfg.num_kv_heads % n == 0:
        return f"{local_kv_heads(cfg, n)} of {cfg.num_kv_heads} KV heads per layer on each rank"
    return (f"1 of {cfg.num_kv_heads} KV heads per layer on each rank, each on "
            f"{n // cfg.num_kv_heads} ranks")


def target_parts(cfg: ModelConfig, quantization_config: Mapping[str, Any] | None,
                 options: PlanOptions) -> tuple[tuple[WeightPart, ...], int, str, tuple[str, ...]]:
    """(weights by kind, KV bytes per token, the KV layout in words, assumptions) of the target
    model on one GPU."""
    check_split(cfg, options)
    qcfg = None if quantization_config is None else QuantConfig.from_dict(quantization_config)
    tally = _Tally(options, qcfg, cfg.weight_prefix)
    n, h = options.tensor_parallel_size, cfg.hidden_size
    for i in range(cfg.num_layers):
        tally.plain("norms", 2 * h, tally.whole)
        if cfg.mla is not None and cfg.moe is not None:
            _mla_attention(cfg, cfg.mla, i, tally)
            _mla_mlp(cfg, cfg.moe, i, tally)
        else:
            _dense_attention(cfg, i, tally)
            _gated_mlp(tally, "MLP", f"model.layers.{i}.mlp", h, cfg.intermediate_size,
                       cfg.mlp_bias)
    tally.plain("norms", h, tally.whole)
    vocab_rows = cfg.vocab_size // n
    split = f"vocabulary split {n} ways ({vocab_rows} rows each)" if n > 1 else "whole"
    tally.plain("embedding", vocab_rows * h, split)
    if not cfg.tie_word_embeddings:
        tally.linear("lm_head", split, ("lm_head",), h, vocab_rows)
    kv, layout = _kv_per_token(cfg, tally)
    assumptions: tuple[str, ...] = ()
    if cfg.moe is not None:
        assumptions = ("the router (gate.weight, e_score_correction_bias) stays float32",)
    return tally.parts(), kv, layout, assumptions


def _kv_per_token(cfg: ModelConfig, tally: _Tally) -> tuple[int, str]:
    if cfg.mla is not None:
        size = cfg.mla.latent_size
        return (cfg.num_layers * size * tally.dt,
                f"MLA latent [{cfg.mla.kv_lora_rank} + {cfg.mla.qk_rope_head_dim}] per layer, "
                + tally.whole)
    kv_local = local_kv_heads(cfg, tally.n)
    return (2 * cfg.num_layers * kv_local * cfg.head_dim * tally.dt,
            f"K and V of {_kv_heads_placement(cfg, tally.n)}")


def _dense_attention(cfg: ModelConfig, i: int, tally: _Tally) -> None:
    n, h, d = tally.n, cfg.hidden_size, cfg.head_dim
    heads, kv = cfg.num_heads // n, local_kv_heads(cfg, n)
    where = f"model.layers.{i}.self_attn"
    placement = "whole"
    if n > 1 and cfg.num_kv_heads % n:
        placement = f"q heads split {n} ways, each KV head on {n // cfg.num_kv_heads} ranks"
    elif n > 1:
        placement = f"q and KV heads split {n} ways"
    qkv_out = (heads + 2 * kv) * d
    tally.linear("attention", placement, tuple(f"{where}.{x}_proj" for x in "qkv"), h, qkv_out,
                 qkv_out if cfg.qkv_bias else 0)
    tally.linear("attention", placement, (f"{where}.o_proj",), heads * d, h,
                 h if cfg.o_bias else 0)
    if cfg.qk_norm:
        tally.plain("norms", 2 * d, tally.whole)


def _gated_mlp(tally: _Tally, kind: str, prefix: str, hidden: int, width: int,
               bias: bool = False) -> None:
    """A SwiGLU MLP split by its width (gate/up column-, down row-parallel)."""
    n = tally.n
    local = width // n
    placement = f"width split {n} ways" if n > 1 else "whole"
    tally.linear(kind, placement, (f"{prefix}.gate_proj", f"{prefix}.up_proj"), hidden,
                 2 * local, 2 * local if bias else 0)
    tally.linear(kind, placement, (f"{prefix}.down_proj",), local, hidden, hidden if bias else 0)


def _mla_attention(cfg: ModelConfig, mla: MlaConfig, i: int, tally: _Tally) -> None:
    n, h = tally.n, cfg.hidden_size
    heads = cfg.num_heads // n
    where = f"model.layers.{i}.self_attn"
    whole, split = tally.whole, (f"heads split {n} ways" if n > 1 else "whole")
    bias = mla.attention_bias
    if mla.q_lora_rank is None:
        tally.linear("attention, split", split, (f"{where}.q_proj",), h, heads * mla.qk_head_dim)
    else:
        tally.linear("attention, replicated", whole, (f"{where}.q_a_proj",), h,
                     mla.q_lora_rank, mla.q_lora_rank if bias else 0)
        tally.plain("norms", mla.q_lora_rank, whole)
        tally.linear("attention, split", split, (f"{where}.q_b_proj",), mla.q_lora_rank,
                     heads * mla.qk_head_dim)
    tally.linear("attention, replicated", whole, (f"{where}.kv_a_proj_with_mqa",), h,
                 mla.latent_size, mla.latent_size if bias else 0)
    tally.plain("norms", mla.kv_lora_rank, whole)
    tally.linear("attention, split", split, (f"{where}.kv_b_proj",), mla.kv_lora_rank,
                 heads * (mla.qk_nope_head_dim + mla.v_head_dim))
    tally.linear("attention, split", split, (f"{where}.o_proj",), heads * mla.v_head_dim, h,
                 h if bias else 0)
    # W_UK [heads, nope, R] and W_UV [heads, R, v]: kv_b_proj's local heads once more.
    tally.plain("absorbed W_UK/W_UV", heads * mla.kv_lora_rank
                * (mla.qk_nope_head_dim + mla.v_head_dim), f"the rank's heads ({split})")


def _mla_mlp(cfg: ModelConfig, moe: MoeConfig, i: int, tally: _Tally) -> None:
    h, prefix = cfg.hidden_size, f"model.layers.{i}.mlp"
    if not moe.is_moe_layer(i):
        _gated_mlp(tally, "dense MLP", prefix, h, cfg.intermediate_size)
        return
    num_experts = moe.num_routed_experts
    bias = num_experts if moe.topk_method == "noaux_tc" else 0
    tally.add("router", (num_experts * h + bias) * ROUTER_BYTES, tally.whole,
              "float32")
    _routed_experts(tally, f"{prefix}.experts", num_experts, h, moe.moe_intermediate_size)
    if moe.num_shared_experts:
        _gated_mlp(tally, "shared experts", f"{prefix}.shared_experts", h,
                   moe.moe_intermediate_size * moe.num_shared_experts)


def _routed_experts(tally: _Tally, prefix: str, num_experts: int, hidden: int,
                    width: int) -> None:
    """The stacked experts (w13 [E, 2I, H], w2 [E, H, I]; INT4: packed and scales only)."""
    n = tally.n
    if tally.ep:
        local_experts, local_width = num_experts // n, width
        placement = f"{local_experts} whole experts per rank"
    else:
        local_experts, local_width = num_experts, width // n
        placement = f"each expert's width split {n} ways" if n > 1 else "whole"
    names = tuple(f"{prefix}.{e}.{proj}_proj" for e in range(num_experts) for proj in GATE_UP_DOWN)
    flags = {tally.is_quantized(name) for name in names}
    if len(flags) > 1:
        raise ValueError(f"{prefix}: the quantization_config makes some routed experts INT4 and "
                         f"others dense; the experts are stacked and must be one or the other")
    if flags == {True}:
        # gate and up are two projections of [I, H], down one of [H, I]; each keeps its
        # weight_shape (Int4RoutedExperts' w13_shape, w2_shape).
        per_expert = (2 * tally.int4_bytes(f"{prefix}.gate_proj", hidden, local_width)
                      + tally.int4_bytes(f"{prefix}.down_proj", local_width, hidden))
        tally.add("routed experts", local_experts * per_expert, placement, "INT4")
    else:
        tally.plain("routed experts", local_experts * 3 * hidden * local_width, placement)


def draft_head_parts(draft: DraftConfig, has_embedding: bool, options: PlanOptions
                     ) -> tuple[WeightPart, int, str]:
    """(the EAGLE-3 head's bytes on rank 0's GPU, its K/V bytes per token, the assumption)."""
    dt, h, d = DTYPE_BYTES[options.dtype], draft.hidden_size, draft.head_dim
    q, kv = draft.num_attention_heads * d, draft.num_key_value_heads * d
    elements = (3 * draft.target_hidden_size * h  # fc
                + 2 * h * (q + 2 * kv) + q * h  # q, k, v from [embeds ‖ hidden]; o
                + 3 * h * draft.intermediate_size  # gate, up, down
                + 4 * h  # input_layernorm, hidden_norm, post_attention_layernorm, norm
                + h * draft.draft_vocab_size)  # lm_head
    own_embedding = has_embedding or options.tensor_parallel_size > 1
    if own_embedding:
        elements += draft.vocab_size * h
    nbytes = (elements * dt + draft.draft_vocab_size * 8 + draft.vocab_size  # d2t, t2d
              + d // 2 * 4)  # rope inv_freq, float32
    if has_embedding:
        note = "the draft head carries its own embedding"
    elif own_embedding:
        note = ("the draft head on rank 0 holds a copy of the whole token embedding (the "
                "target's there is a vocabulary range)")
    else:
        note = "the draft head shares the target's embedding"
    part = WeightPart(f"draft head ({options.dtype})", nbytes,
                      "whole, on rank 0 only" if options.tensor_parallel_size > 1 else "whole")
    return part, 2 * kv * dt, note
