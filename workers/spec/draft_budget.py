"""What a draft head takes from the KV budget beside its own K/V: its weights and its captured
draft loops, known before the target's runner sizes the cache.

On CUDA the budget is what the device has free after the target's weights load and a profiling
forward (workers/runner/memory_profile.py). The head is loaded after that, and its draft loops
(spec/draft_graphs.py) are captured once the cache exists; both take device memory, so the
runner reserves them before it counts blocks (`ModelRunner(draft_weight_bytes=...,
draft_loop_bytes=...)`):

* weights (`head_weight_bytes`): every parameter of the head in the serving dtype, its token
  embedding left out when the checkpoint has none (it shares the target's storage then). Paid
  only from the device rule's budget: a configured `kv_cache_memory_bytes` is for the cache.
* draft loops (`measure_draft_loop_bytes`, graphs on): a trial capture of the loop at its
  largest shape (the largest batch and prefix width: every graph shares one memory pool, and
  the largest is what the pool must hold) over a head of the real shapes and a scratch draft
  cache of two blocks, before the target loads; measured as graphs.capture_all measures the
  target's graphs (the pool) plus the static inputs. Paid from whichever budget, as the
  target's graphs are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specd.workers.runner.graphs import capture_sizes
from specd.workers.spec.draft_config import DraftConfig
from specd.workers.spec.draft_graphs import DraftGraphs, prefix_widths
from specd.workers.spec.draft_model import empty_draft_head
from specd.workers.spec.drafting import draft_loop
from specd.workers.spec.head_files import (
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    find_weights,
    read_head_tensors,
)
from specd.workers.spec.head_weights import canonical_name


def head_tensor_names(root: Path) -> set[str]:
    """The canonical names of the tensors a head checkpoint holds (safetensors: from the
    header alone; pickled layouts are read whole)."""
    weights = find_weights(root)
    if weights.name == SAFETENSORS_FILE:
        with safe_open(weights, framework="pt") as f:
            names = set(f.keys())
    elif weights.name == SAFETENSORS_INDEX:
        names = set(json.loads(weights.read_text())["weight_map"])
    else:
        names = set(read_head_tensors(root)[0])
    return {canonical_name(n) for n in names}


def head_weight_bytes(config: DraftConfig, root: Path, dtype: torch.dtype) -> int:
    """Bytes the head's parameters take in `dtype` on the device (module docstring)."""
    head = empty_draft_head(config, dtype, "meta")
    shares_embedding = "embed_tokens.weight" not in head_tensor_names(root)
    return sum(p.numel() * p.element_size() for name, p in head.named_parameters()
               if not (shares_embedding and name == "embed_tokens.weight"))


def measure_draft_loop_bytes(config: DraftConfig, topk: int, num_steps: int,
                             num_draft_tokens: int, max_num_seqs: int, longest_sequence: int,
                             block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """The memory the draft loops' graphs take (module docstring): one trial capture at the
    largest shape (a CUDA graph on CUDA, the synchronous stand-in elsewhere), dropped at once.
    0 when the trial fails (logged at INFO): the capture proper then fails the same way, is
    reported, and the loop runs eagerly, taking no graph memory. What the trial held is
    released when this returns (the target's profile empties the cache before measuring)."""
    head = empty_draft_head(config, dtype, device).eval()
    head.requires_grad_(False)
    with torch.no_grad():  # zeros: the draft ids it maps (d2t) must be in range
        for t in [*head.parameters(), head.d2t]:
            t.zero_()
    scratch = torch.zeros(config.kv_layer_shape(2, block_size), dtype=dtype, device=device)
    trial = DraftGraphs(
        lambda inputs: draft_loop(head, scratch, topk, num_steps, num_draft_tokens, inputs),
        (max(capture_sizes(max_num_seqs)),), (max(prefix_widths(longest_sequence)),),
        config.hidden_size, dtype, device)
    with torch.inference_mode():
        trial.capture(trial=True)
    return 0 if trial.error is not None else trial.memory_bytes
