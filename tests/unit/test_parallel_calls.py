"""The calls rank 0 sends its workers (workers/parallel/worker.py `encode` / `decode`): a
step's forward call, attention metadata with CPU query groups and a tree mask included,
arrives whole, its tensors equal and on the receiving rank's device."""

from __future__ import annotations

import dataclasses

import torch

from specd.workers.parallel.worker import decode, encode
from specd.workers.runner.attention import AttentionMetadata, build_attention_metadata


def assert_same(a: object, b: object) -> None:
    """Equal values, tensors compared element by element, dataclasses field by field."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, type(a)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_a_forward_call_round_trips_with_its_attention_metadata() -> None:
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.int64)
    meta = build_attention_metadata(query_lens=[3, 1], seq_lens=[7, 20],
                                    block_tables=[[4, 1], [0, 2]], block_size=16,
                                    device=torch.device("cpu"))
    meta = dataclasses.replace(meta, tree_mask=tree)
    ids, positions = torch.tensor([5, 9, 2, 11]), torch.tensor([4, 5, 5, 19])
    op, args = decode(encode("forward", ids, positions, meta, (1, 6)), torch.device("cpu"))
    assert op == "forward"
    assert_same(args, (ids, positions, meta, (1, 6)))
    assert isinstance(args[2], AttentionMetadata) and args[2].groups


def test_calls_without_tensors_round_trip() -> None:
    assert decode(encode("allocate_kv", 37), torch.device("cpu")) == ("allocate_kv", (37,))
    assert decode(encode("stop"), torch.device("cpu")) == ("stop", ())
