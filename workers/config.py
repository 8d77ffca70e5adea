"""The engine's configuration: one frozen object, built once, validated, passed down whole.

Option names match the daemon's CLI flags (`--max-num-seqs` is `max_num_seqs`). Values
found at run time (the number of KV blocks, say) live in `EngineResolved`, never here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specd.ipc.messages import SPEC_MODES
from specd.workers.named_models import (  # noqa: F401 - the fixtures' paths, for tools
    FIXTURE_DIR,
    FIXTURE_DRAFT_DIR,
    FIXTURE_MOE_DIR,
    FIXTURES,
    named_model,
)

DTYPES = ("bfloat16", "float16", "float32")
# The kernels a float32 linear can run on, on the CPU (workers/runner/cpu_linears.py).
CPU_LINEAR_KERNELS = ("mkl", "onednn", "transposed")
# The KV budget on the CPU when kv_cache_memory_bytes is not given (kv_cache.kv_budget).
CPU_KV_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to build itself.

    model: a Hugging Face model directory, or a model's name (named_models.py: "fixture",
        "fixture-moe", "smollm2"; a name wins over a directory of that name, which
        "./fixture-moe" reaches); None serves "fixture" (the daemon's own default is
        `named_models.default_model`).
    draft_model: an EAGLE-3 head directory; None takes a named model's own head (and
        none for other models).
    dtype: activation and unquantized weight dtype ("auto": see
        `runner.dtypes.resolve_dtype`; the checkpoint's half precision where the device
        computes it natively, float32 otherwise).
    kv_cache_memory_bytes: budget for the paged KV cache; the block count follows from it.
        None: on CUDA, gpu_memory_utilization of the device memory free after the weights,
        less the profiled activation peak; on the CPU, CPU_KV_CACHE_BYTES (kv_cache.py).
    gpu_memory_utilization: the fraction of that free CUDA memory the KV cache (with the
        draft head's K/V and captured graphs) may take; in (0, 1].
    num_kv_blocks: overrides the budget with an exact block count (tests force preemption).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # Speculative decoding (EAGLE-3).
    speculative_algorithm: str | None = "eagle3"
    draft_model: str | None = None
    spec_num_steps: int = 5
    spec_topk: int = 1
    spec_num_draft_tokens: int = 6
    spec_mode: str = "auto"
    # On the 2-core CPU the fixture's speculation stopped paying between batch 8 and 16
    # (`specctl tune-spec`, docs/benchmarks.md); a GPU wants a larger value: tune it there.
    spec_disable_batch_threshold: int = 8
    # In auto, measure both modes' throughput per batch-size bucket and use the faster
    # (the threshold decides only until both are measured): spec/controller.py.
    spec_auto_measure: bool = True
    # Schedule step N + 1 while step N runs (None: on for CUDA, off on the CPU, where the
    # device is the host and there is nothing to hide): engine.py, scheduler.py.
    overlap_schedule: bool | None = None
    # Replay captured forwards for plain decode and verification (None: on for CUDA, off
    # on the CPU, where True runs the synchronous stand-in): graphs.py.
    cuda_graphs: bool | None = None
    # Compile decode and verify steps on the CPU (torch.compile, inductor): cpu_decode.py.
    cpu_compile: bool = False
    # With cpu_compile: compile on a thread while the eager path serves, instead of in the
    # warm-up (cpu_compile_thread.py; tensor parallel size 1 only).
    cpu_compile_background: bool = False
    # The kernel of the float32 linears on the CPU: "auto" measures the candidates on the
    # model's own weights at load and takes the fastest; or "mkl", "onednn", "transposed"
    # (workers/runner/cpu_linears.py).
    cpu_linear: str = "auto"
    # Ranks the model is split over (workers/parallel/): 1 runs it in this process; N > 1
    # starts N - 1 worker processes, one per device (gloo on the CPU, NCCL on CUDA); with
    # nnodes > 1, N / nnodes of them on each node.
    tensor_parallel_size: int = 1
    # With tensor_parallel_size > 1: whole routed experts per rank instead of each expert's
    # width split (workers/parallel/expert_parallel.py).
    expert_parallel: bool = False
    # Several nodes (workers/parallel/nodes.py): the tensor_parallel_size ranks are spread
    # evenly over nnodes hosts. Node 0 runs specd (the front, the scheduler = rank 0);
    # node r > 0 runs `specd-worker --node-rank r`. dist_init_addr: HOST:PORT of node 0's
    # TCP store, which every node can reach (its HOST is where node 0's links listen).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # How long node 0's start-up waits for every other node to join (then names the missing).
    dist_init_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # An empty value is what a unit passes for an unset variable (`--model ${SPECD_MODEL}`
        # with the name misspelled in the environment file): never the default in disguise.
        for name in ("model", "draft_model"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(
                    f"{name} is empty (--{name.replace('_', '-')} {value!r}): give a "
                    "directory or an embedded model's name, or leave the option out for "
                    "the default")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens must be >= block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.speculative_algorithm not in (None, "eagle3"):
            raise ValueError(
                f"speculative_algorithm must be eagle3 or None, got {self.speculative_algorithm!r}")
        if self.spec_mode not in SPEC_MODES:
            raise ValueError(f"spec_mode must be one of {SPEC_MODES}, got {self.spec_mode!r}")
        if not 1 <= self.spec_num_steps <= 16:
            raise ValueError(f"spec_num_steps must be in [1, 16], got {self.spec_num_steps}")
        if not 1 <= self.spec_topk <= 8:
            raise ValueError(f"spec_topk must be in [1, 8], got {self.spec_topk}")
        if not 1 <= self.spec_num_draft_tokens <= 64:
            raise ValueError(
                f"spec_num_draft_tokens must be in [1, 64], got {self.spec_num_draft_tokens}")
        if self.cpu_compile and self.device != "cpu":
            raise ValueError(f"cpu_compile applies to device cpu only, got {self.device!r}")
        if self.cpu_linear not in ("auto", *CPU_LINEAR_KERNELS):
            raise ValueError(f"cpu_linear must be auto or one of {CPU_LINEAR_KERNELS}, "
                             f"not {self.cpu_linear!r}")
        if self.cpu_linear == "onednn" and self.cpu_compile:
            raise ValueError("cpu_linear onednn cannot be compiled (cpu_compile): compiled "
                             "steps cannot lower oneDNN's packed op")
        if self.cpu_compile_background and not self.cpu_compile:
            raise ValueError("cpu_compile_background needs cpu_compile")
        if self.cpu_compile_background and self.tensor_parallel_size > 1:
            raise ValueError("cpu_compile_background needs tensor_parallel_size 1: a compiled "
                             "step holds the ranks' all-reduces, which a call on the compile "
                             "thread would run out of step order")
        if self.cpu_compile and self.cuda_graphs:
            raise ValueError("cpu_compile and cuda_graphs (the CPU stand-in) are alternatives "
                             "on the CPU; turn one off")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError("tensor_parallel_size must be in [1, 64], "
                             f"got {self.tensor_parallel_size}")
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("expert_parallel needs tensor_parallel_size > 1")
        self._check_nodes()
        if self.spec_disable_batch_threshold < 1:
            raise ValueError("spec_disable_batch_threshold must be >= 1, "
                             f"got {self.spec_disable_batch_threshold}")

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes = {self.nnodes}), "
                             f"got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a "
                             f"multiple of nnodes {self.nnodes} (the same ranks on each node)")
        if self.dist_init_timeout_s <= 0:
            raise ValueError(f"dist_init_timeout_s must be > 0, got {self.dist_init_timeout_s}")
        if self.dist_init_addr is not None:
            parse_host_port(self.dist_init_addr)
        elif self.nnodes > 1:
            raise ValueError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0, "
                             "reachable from every node)")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def dist_init_host_port(self) -> tuple[str, int] | None:
        """(host, port) of `dist_init_addr`, or None."""
        return None if self.dist_init_addr is None else parse_host_port(self.dist_init_addr)

    @property
    def model_path(self) -> Path:
        named = named_model(self.model or "fixture")
        return named.model_dir if named is not None else Path(str(self.model))

    @property
    def draft_model_path(self) -> Path | None:
        if self.draft_model:
            return Path(self.draft_model)
        named = named_model(self.model or "fixture")
        return named.draft_dir if named is not None else None

    @property
    def overlap_enabled(self) -> bool:
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return self.device.startswith("cuda")

    @property
    def graphs_enabled(self) -> bool:
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return self.device.startswith("cuda")


def parse_host_port(address: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" (an IPv6 host in brackets, which are removed);
    ValueError naming the address otherwise."""
    host, _, port = address.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class EngineResolved:
    """What the engine found at start-up: reported in Ready, status and doctor."""

    model_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    dtype: str
    device: str
    eos_token_ids: tuple[int, ...]
    speculative: bool
    overlap_schedule: bool = False
    graphs: str = "off"  # what replays captured forwards, or why nothing does (graphs.py)
    graph_memory_bytes: int = 0  # taken from the KV-cache budget
    # How the target's dense linears run: packed for oneDNN, or nn.Linear and why (a CPU
    # without oneDNN's bf16 GEMM keeps bfloat16 linears unpacked).
    linears: str = "nn.Linear"
    # The target's paged cache per token over all layers (K/V, or MLA's latent rows); the
    # draft head's own K/V comes on top, from the same budget.
    kv_bytes_per_token: int = 0
    # The KV budget in bytes and where it comes from (kv_cache.kv_budget; with num_kv_blocks
    # set, the bytes those blocks take), and the tokens the cache holds (blocks x size).
    kv_budget_bytes: int = 0
    kv_budget_source: str = ""
    kv_cache_tokens: int = 0
    # Tensor parallelism: one entry per rank, "rank R pid P on DEVICE" (rank 0 is the
    # scheduler process; a rank of another node: "... of node N (HOST)"); empty in one
    # process. Shown by `specctl status` and `specctl doctor`.
    ranks: tuple[str, ...] = ()
    # Structured output (workers/structured/): the grammar library and the tokenizer file
    # its vocabulary was read from, or "off: " and why.
    structured_output: str = "off"
    expert_parallel: bool = False
    # Several nodes: one entry per node, "node N (HOST): ranks A-B" (node 0 first).
    nodes: tuple[str, ...] = ()
