"""The calls rank 0 sends the other ranks (workers/parallel/codec.py): a step's forward call,
attention metadata with CPU query groups, a tree mask and a kept-K/V plan included, arrives
whole, its tensors equal (dtype, shape, values); the plan's stage is the receiver's to
give; a value a call cannot carry is refused; device tensors travel by the broadcast."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from specd.workers.parallel.codec import decode, encode
from specd.workers.runner.attention import AttentionMetadata, build_attention_metadata
from specd.workers.runner.decode_stage import DecodeStage

CPU = torch.device("cpu")


def assert_same(a: object, b: object) -> None:
    """Equal values, tensors compared element by element, dataclasses field by field."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
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


def round_trip(op: str, *args: object) -> tuple[str, tuple[Any, ...]]:
    encoded = encode(op, *args)
    assert encoded.device_buffer is None  # every tensor here is on the host
    return decode(encoded.frame, CPU)


def test_a_forward_call_round_trips_with_its_attention_metadata() -> None:
    tree = torch.tensor([1, 3, 5, 1], dtype=torch.int64)
    meta = build_attention_metadata(query_lens=[3, 1], seq_lens=[7, 20],
                                    block_tables=[[4, 1], [0, 2]], block_size=16,
                                    device=CPU, tree_mask=tree)
    ids, positions = torch.tensor([5, 9, 2, 11]), torch.tensor([4, 5, 5, 19])
    op, args = round_trip("forward", ids, positions, meta, (1, 6))
    assert op == "forward"
    assert_same(args, (ids, positions, meta, (1, 6)))
    assert isinstance(args[2], AttentionMetadata) and args[2].groups
    assert args[2].groups[0].mask.dtype == torch.bool


def test_a_decode_plan_arrives_without_the_senders_stage() -> None:
    stage = DecodeStage(16)
    meta = build_attention_metadata([1, 1], [20, 33], [[0, 1], [2, 3, 4]], 16, CPU,
                                    stage=stage)
    plan = meta.groups[0].stage_plan
    assert plan is not None and plan.stage is stage
    _, (got,) = round_trip("run", meta)
    received = got.groups[0].stage_plan
    assert received is not None and received.stage is None
    assert_same(dataclasses.replace(received, stage=stage), plan)


def test_tensors_of_every_kind_keep_dtype_shape_and_values() -> None:
    values = (torch.randn(3, 5).bfloat16(), torch.tensor(True), torch.zeros(0, 7),
              torch.arange(12, dtype=torch.int32).view(3, 4).t(),  # not contiguous
              torch.arange(10)[3:4:2],  # one element with stride 2
              torch.randn(2, 2, dtype=torch.float64))
    _, got = round_trip("logits", *values, [1, 2.5, "x", None], ())
    assert_same(got, (*values, [1, 2.5, "x", None], ()))


def test_calls_without_tensors_round_trip() -> None:
    assert round_trip("allocate_kv", 37) == ("allocate_kv", (37,))
    assert round_trip("stop") == ("stop", ())


def test_a_value_a_call_cannot_carry_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot carry dict"):
        encode("forward", {"a": 1})
    with pytest.raises(TypeError, match="cannot carry object"):
        encode("forward", object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_tensors_travel_by_the_broadcast() -> None:
    """Packed into one device buffer; the receiver's buffer is filled by the broadcast
    (here: a copy of the sender's), the host tensors from the frame."""
    cuda = torch.device("cuda")
    ids, host = torch.arange(5, device=cuda), torch.tensor([1.5, 2.5])
    mask = torch.tensor([True, False, True], device=cuda)
    encoded = encode("forward", ids, host, mask)
    assert encoded.device_buffer is not None

    def broadcast(buffer: torch.Tensor) -> None:
        assert encoded.device_buffer is not None
        buffer.copy_(encoded.device_buffer)

    _, (got_ids, got_host, got_mask) = decode(encoded.frame, cuda, broadcast)
    assert got_ids.is_cuda and got_mask.is_cuda and not got_host.is_cuda
    assert_same((got_ids.cpu(), got_host, got_mask.cpu()), (ids.cpu(), host, mask.cpu()))
