"""Loading a draft head's published tensors into the head (`load_head_weights`), checked.

Names are canonicalised first (SGLang's `model.` prefix, Speculators' and vLLM's `layers.0.`
for `midlayer.`); then every parameter must be present (the embedding only when the head
carries one, `d2t` only when the draft vocabulary is smaller, `t2d` never), nothing
unexpected, every shape as config.json says. A degenerate head is refused by tensor name: a
non-finite value in any tensor, or an all-zero embedding, `fc` or `lm_head` (its drafts
would never be accepted; such a head has been seen to bring acceptance down to 1.12 tokens
per verify without a word). `d2t` / `t2d` are checked as `_load_vocab_maps` says.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from specd.workers.spec.draft_config import DraftConfig


class Eagle3Head(Protocol):
    """What loading needs of a head (workers/spec/draft_head.py's `Eagle3Head`)."""

    config: DraftConfig
    d2t: torch.Tensor
    t2d: torch.Tensor

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

# Tensors whose being all zero leaves a head that cannot draft (the embedding when the head
# carries its own).
NONZERO_TENSORS = ("embed_tokens.weight", "fc.weight", "lm_head.weight")


def canonical_name(name: str) -> str:
    """A published tensor name as the head names its parameter."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def load_head_weights(head: Eagle3Head, tensors: dict[str, torch.Tensor], source: str,
                      target_embed_weight: torch.Tensor | None = None) -> None:
    """Load published tensors (names as in the checkpoint) into `head` (module docstring);
    ValueError naming `source` and the tensor for anything missing, unexpected, misshapen
    or degenerate. The target's embedding is shared (the same storage, a copy only if the
    dtype differs) when the checkpoint has none."""
    tensors = {canonical_name(n): t for n, t in tensors.items()}
    cfg = head.config
    expected = {n: tuple(p.shape) for n, p in head.named_parameters()}
    expected.update({"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
    optional = {"embed_tokens.weight", "t2d"}
    if cfg.draft_vocab_size == cfg.vocab_size:
        optional.add("d2t")
    missing = sorted(set(expected) - set(tensors) - optional)
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: not an EAGLE-3 head in the published layout: "
                         f"missing tensors {missing}, unexpected tensors {unexpected}")
    own = dict(tensors)  # the head's own tensors, checked for degeneracy
    if "embed_tokens.weight" not in tensors:
        if target_embed_weight is None:
            raise ValueError(f"{source}: has no embed_tokens.weight and no target embedding "
                             "was given to share")
        tensors["embed_tokens.weight"] = target_embed_weight
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, "
                             f"expected {expected[name]} from config.json")
    check_not_degenerate(own, source)
    _load_vocab_maps(head, tensors, source)
    with torch.no_grad():
        for name, param in head.named_parameters():
            value = tensors[name]
            if value is target_embed_weight:
                param.data = value.to(device=param.device, dtype=param.dtype)
            else:
                param.copy_(value)


def check_not_degenerate(tensors: dict[str, torch.Tensor], source: str) -> None:
    """ValueError naming the first tensor of the head's own that holds a NaN or an infinity,
    or that is all zero among `NONZERO_TENSORS`."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{source}: tensor {name} holds non-finite values (NaN or "
                             "infinity): a degenerate head")
    for name in NONZERO_TENSORS:
        if name in tensors and not bool(tensors[name].any()):
            raise ValueError(f"{source}: tensor {name} is all zeros: a degenerate head, whose "
                             "drafts would never be accepted")


def _load_vocab_maps(head: Eagle3Head, tensors: dict[str, torch.Tensor], source: str) -> None:
    """d2t of any integer dtype (int32 in some exports) becomes int64; t2d must be the set d2t
    maps onto (vLLM ignores t2d; specd checks it, or derives it when absent)."""
    cfg = head.config
    if "d2t" not in tensors:
        if "t2d" in tensors:
            raise ValueError(f"{source}: has t2d but no d2t (d2t names the target tokens)")
        head.d2t.zero_()
        head.t2d.fill_(True)
        return
    d2t = tensors["d2t"]
    if d2t.dtype.is_floating_point or d2t.dtype.is_complex or d2t.dtype == torch.bool:
        raise ValueError(f"{source}: d2t must hold integers, got {d2t.dtype}")
    target_ids = d2t.long() + torch.arange(cfg.draft_vocab_size, device=d2t.device)
    if bool((target_ids < 0).any()) or bool((target_ids >= cfg.vocab_size).any()):
        raise ValueError(f"{source}: d2t maps draft ids outside the target vocabulary "
                         f"[0, {cfg.vocab_size})")
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[target_ids] = True
    if int(t2d.sum()) != cfg.draft_vocab_size:
        raise ValueError(f"{source}: d2t maps two draft ids to the same target token")
    if "t2d" in tensors:
        stored = tensors["t2d"]
        if stored.dtype != torch.bool:
            raise ValueError(f"{source}: t2d must be bool, got {stored.dtype}")
        if not torch.equal(stored.to(t2d.device), t2d):
            raise ValueError(f"{source}: t2d does not mark exactly the "
                             f"{cfg.draft_vocab_size} target tokens that d2t maps to")
    head.d2t.copy_(d2t)  # to int64
    head.t2d.copy_(t2d)
