"""`specctl plan`: whether and how a model fits N GPUs, from the model built on the meta
device (no tensor data, no GPU, no daemon), refusing what the engine refuses at start-up.
The planning is workers/plan/deployment.py; this module parses options and prints."""

from __future__ import annotations

import json
from typing import Any

import click

from specd.daemon.ctl.common import Settings

GIB = 2**30
LABEL_WIDTH = 42


@click.command()
@click.argument("model")
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1), default=1,
              show_default=True, help="GPUs (ranks) the model is split over")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="hosts the ranks are spread over, --tensor-parallel-size / --nnodes GPUs "
              "on each (node 0 runs specd, the others specd-worker)")
@click.option("--dist-init-addr", default=None, metavar="HOST:PORT",
              help="node 0's address for the other nodes (specd's --dist-init-addr); needed "
              "with --nnodes > 1, for the command lines")
@click.option("--expert-parallel", is_flag=True,
              help="place whole routed experts on ranks instead of splitting each expert")
@click.option("--gpu-memory-gib", type=click.FloatRange(min=0, min_open=True), required=True,
              help="memory of one GPU in GiB (an H200: 141; nvidia-smi's total / 1024)")
@click.option("--memory-fraction", type=click.FloatRange(0, 1, min_open=True),
              default=0.90, show_default=True,
              help="fraction of each GPU's memory for specd as a whole: weights, reserve and "
              "KV cache together")
@click.option("--reserve-gib", type=click.FloatRange(min=0), default=8.0, show_default=True,
              help="per GPU, kept for activations, the MoE workspace, captured graphs and "
              "communication buffers")
@click.option("--draft-model", default=None,
              help="EAGLE-3 head directory [default: an embedded model's own head, else none]")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]),
              default="bfloat16", show_default=True,
              help="serving dtype of unquantized weights and the KV cache")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="KV tokens per block (specd's --block-size)")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="longest sequence to hold [default: the model's]")
@click.option("--json", "as_json", is_flag=True, help="print JSON for scripts")
@click.pass_context
def plan(ctx: click.Context, model: str, tensor_parallel_size: int, nnodes: int,
         dist_init_addr: str | None, expert_parallel: bool,
         gpu_memory_gib: float, memory_fraction: float, reserve_gib: float,
         draft_model: str | None, dtype: str, block_size: int, max_model_len: int | None,
         as_json: bool) -> None:
    """Plan serving MODEL (a model directory, or an embedded model: fixture, fixture-moe)
    on --tensor-parallel-size GPUs of --gpu-memory-gib each (over --nnodes hosts).

    Builds rank 0's model (and the draft head) on the meta device from config.json and its
    quantization_config, and prints per GPU: weight bytes by kind (INT4 routed experts,
    attention, MLPs, embedding and lm_head, norms, router, draft head), KV-cache bytes per
    token, the memory left for the cache after the weights and the reserve, how many tokens
    it holds, and whether one sequence of the model's maximum length fits. Runs the engine's
    start-up checks first (config fields, tokenizer against embedding, what N ranks must
    divide, INT4 modules stored dense, from the safetensors headers) and exits 2 naming what
    it refuses. Reads no tensor data; runs without a daemon. With --nnodes > 1 the plan is
    the same per GPU (tensor parallel across the nodes as within one), and it prints node
    0's `specd` command line and every other node's `specd-worker` one.
    """
    from specd.workers.config import EngineConfig, parse_host_port
    from specd.workers.plan.deployment import PlanOptions, make_plan

    settings = ctx.find_object(Settings)  # the group's --json counts too
    as_json = as_json or (settings is not None and settings.as_json)
    try:
        if nnodes > 1 and dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr (HOST:PORT of node 0, "
                             "where the other nodes reach it)")
        if dist_init_addr is not None:
            parse_host_port(dist_init_addr)
        resolved = EngineConfig(model=model, draft_model=draft_model)
        options = PlanOptions(
            gpu_memory_bytes=int(gpu_memory_gib * GIB),
            tensor_parallel_size=tensor_parallel_size, nnodes=nnodes,
            expert_parallel=expert_parallel,
            dtype=dtype, memory_fraction=memory_fraction,
            reserve_bytes=int(reserve_gib * GIB), block_size=block_size,
            max_model_len=max_model_len)
        result = make_plan(resolved.model_path, resolved.draft_model_path, options)
    except (OSError, ValueError) as exc:  # what the engine would refuse at start-up
        raise click.UsageError(str(exc)) from exc
    figures = result.to_dict()
    figures["dist_init_addr"] = dist_init_addr
    figures["serve_command"] = serve_command(figures) if result.fits else None
    figures["worker_commands"] = worker_commands(figures) if result.fits else []
    if as_json:
        click.echo(json.dumps(figures))
    else:
        click.echo("\n".join(render(figures)))


def serve_command(figures: dict[str, Any]) -> str:
    """The `specd` command line that serves the plan on the GPUs (node 0's, over several
    nodes). The cache is given as the plan's block count: each rank then holds exactly what
    the plan counts (a budget in bytes would be divided by the whole model's bytes per
    block, not a rank's)."""
    words = ["specd", "--model", figures["model"], "--device", "cuda"]
    if figures["draft_model"]:
        words += ["--draft-model", figures["draft_model"]]
    if figures["tensor_parallel_size"] > 1:
        words += ["--tensor-parallel-size", str(figures["tensor_parallel_size"])]
    if figures["nnodes"] > 1:
        words += ["--nnodes", str(figures["nnodes"]), "--dist-init-addr",
                  figures["dist_init_addr"]]
    if figures["expert_parallel"]:
        words.append("--expert-parallel")
    words += ["--dtype", figures["dtype"], "--block-size", str(figures["block_size"]),
              "--num-kv-blocks", str(figures["num_kv_blocks"])]
    return " ".join(words)


def worker_commands(figures: dict[str, Any]) -> list[str]:
    """The `specd-worker` command line of each node after node 0 (node 1 first): the agent
    reads the rest of the configuration from node 0."""
    return [f"specd-worker --nnodes {figures['nnodes']} --node-rank {r} --dist-init-addr "
            f"{figures['dist_init_addr']}" for r in range(1, figures["nnodes"])]


def _row(label: str, nbytes: int, placement: str = "") -> str:
    return f"  {label:{LABEL_WIDTH}}{nbytes / GIB:9.2f}  {nbytes:14d}  {placement}".rstrip()


def render(f: dict[str, Any]) -> list[str]:
    """The human-readable plan: the weights per GPU, the KV cache, the memory, the verdict
    and the command that serves it."""
    n, nodes = f["tensor_parallel_size"], f["nnodes"]
    mode = ("expert + tensor parallel" if f["expert_parallel"]
            else "tensor parallel" if n > 1 else "one GPU")
    where = f" over {nodes} nodes ({n // nodes} each)" if nodes > 1 else ""
    header = f"{'':{LABEL_WIDTH - 5}}{'GiB':>9}  {'bytes':>14}"
    lines = [f"model        {f['model']}",
             f"draft model  {f['draft_model'] or 'none'}",
             f"layout       {n} x {f['gpu_memory_bytes'] / GIB:.1f} GiB{where}, {mode}, "
             f"{f['dtype']}",
             "",
             f"per GPU{header}  placement"]
    lines += [_row(kind, part["bytes"], part["placement"]) for kind, part in f["weights"].items()]
    lines.append(_row("weights", f["weight_bytes"]))
    per_token = f["kv_bytes_per_token"] + f["draft_kv_bytes_per_token"]
    lines += ["",
              f"KV cache     {f['kv_layout']}",
              f"  {f['kv_bytes_per_token']} bytes per token (target)"
              + (f" + {f['draft_kv_bytes_per_token']} (draft head) = {per_token}"
                 if f["draft_kv_bytes_per_token"] else ""),
              "",
              f"memory{header}",
              _row(f"usable ({f['memory_fraction']:.2f} of one GPU)", f["usable_bytes"]),
              _row("- weights", f["weight_bytes"]),
              _row("- reserve (activations, graphs, buffers)", f["reserve_bytes"]),
              _row("= KV cache", f["kv_budget_bytes"]),
              f"  {f['num_kv_blocks']} blocks of {f['block_size']} = {f['kv_tokens']} tokens",
              "",
              f"verdict      {f['verdict']}"]
    if f["serve_command"]:
        lines.append(f"serve with   {f['serve_command']}" + ("  (node 0)" if nodes > 1 else ""))
    lines += [f"node {r:<8}{command}" for r, command in enumerate(f["worker_commands"], 1)]
    lines += [f"assumes      {note}" for note in f["assumptions"]]
    return lines
