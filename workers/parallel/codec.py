"""The calls rank 0 sends the other ranks, as bytes: a msgpack skeleton and raw tensors.

A call is (op, args): op a string, args made of None, bools, ints, floats, strings, tuples,
lists, tensors and the dataclasses the step inputs are made of (`MESSAGE_TYPES`). No
pickling: the skeleton is msgpack (tagged lists: ["u", items] a tuple, ["l", items] a
list, ["d", name, fields] a dataclass, ["t", i] tensor i, ["x"] a local object), and
each tensor is its raw bytes.

    frame = [u32 header length][header: msgpack [op, skeleton, tensor table]][pad to 64]
            [host tensors' bytes, each at a 64-byte aligned offset]

Host (CPU) tensors travel in the frame. Device tensors (CUDA) may hold values only rank
0's device has (placeholders resolved from sampled tokens, a lagged verify's positions):
they are packed into one device buffer that rank 0 broadcasts over the process group
right after the frame (`Encoded.device_buffer`), enqueued on its stream without waiting
for the device, and the receiver joins that broadcast when the frame's table names device
tensors. A `DecodeStage` (the CPU backend's kept K/V, referenced by a step's plan) is
local to each rank: it travels as ["x"] and arrives as None, for the receiving backend to
put its own in (`Backend.adopt`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import torch

from specd.workers.runner.attention import AttentionMetadata, QueryGroup
from specd.workers.runner.decode_stage import DecodeStage, StagePlan

MESSAGE_TYPES: dict[str, type[Any]] = {
    cls.__name__: cls for cls in (AttentionMetadata, QueryGroup, StagePlan)}
_FIELDS = {name: tuple(f.name for f in dataclasses.fields(cls))
           for name, cls in MESSAGE_TYPES.items()}
LOCAL_TYPES = (DecodeStage,)
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool)}
_DTYPE_NAMES = {d: name for name, d in _DTYPES.items()}
ALIGN = 64
DEVICE_ALIGN = 16
LENGTH_BYTES = 4

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()

# Joins rank 0's broadcast of a device buffer: fills the given tensor in place.
Broadcast = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Encoded:
    """A call as bytes (`frame`) and the device tensors to broadcast after it, packed
    (`device_buffer`: uint8 on the device, None when there are none)."""

    frame: bytearray
    device_buffer: torch.Tensor | None


def encode(op: str, *args: Any) -> Encoded:
    """The call (op, args) as an `Encoded` (module docstring); TypeError for a value the
    frame cannot carry."""
    tensors: list[torch.Tensor] = []
    skeleton = _pack(args, tensors)
    table, host, device, host_bytes, device_bytes = [], [], [], 0, 0
    for t in tensors:
        t = t.detach().reshape(-1)
        if t.numel() and t.stride(0) != 1:  # a one-element view counts as contiguous
            t = t.clone(memory_format=torch.contiguous_format)
        nbytes = t.numel() * t.element_size()
        on_host = t.device.type == "cpu"
        offset = host_bytes if on_host else device_bytes
        table.append((_DTYPE_NAMES[t.dtype], t.numel(), on_host, offset, nbytes))
        if on_host:
            host.append((offset, t))
            host_bytes = _align(offset + nbytes, ALIGN)
        else:
            device.append((offset, t))
            device_bytes = _align(offset + nbytes, DEVICE_ALIGN)
    header = _encoder.encode([op, skeleton, table])
    start = _align(LENGTH_BYTES + len(header), ALIGN)
    frame = bytearray(start + host_bytes)
    frame[:LENGTH_BYTES] = len(header).to_bytes(LENGTH_BYTES, "little")
    frame[LENGTH_BYTES: LENGTH_BYTES + len(header)] = header
    for offset, t in host:
        if t.numel():  # through numpy's buffer: one memcpy, no torch op per tensor
            raw = t.view(torch.uint8).numpy()
            frame[start + offset: start + offset + raw.nbytes] = raw.data
    buffer = None
    if device:
        buffer = torch.empty(device_bytes, dtype=torch.uint8, device=device[0][1].device)
        for offset, t in device:
            nbytes = t.numel() * t.element_size()
            buffer[offset: offset + nbytes].copy_(t.view(torch.uint8))
    return Encoded(frame, buffer)


def decode(frame: bytearray, device: torch.device, broadcast: Broadcast | None = None
           ) -> tuple[str, tuple[Any, ...]]:
    """The call `encode` made. Host tensors are views of `frame`; device tensors are
    received through `broadcast` into one buffer on `device` and are views of it."""
    length = int.from_bytes(frame[:LENGTH_BYTES], "little")
    op, skeleton, table = _decoder.decode(memoryview(frame)[LENGTH_BYTES: LENGTH_BYTES + length])
    start = _align(LENGTH_BYTES + length, ALIGN)
    device_bytes = max((_align(o + n, DEVICE_ALIGN) for _, _, on_host, o, n in table
                        if not on_host), default=0)
    buffer = None
    if device_bytes:
        if broadcast is None:
            raise ValueError(f"call {op!r} carries device tensors and no broadcast was given")
        buffer = torch.empty(device_bytes, dtype=torch.uint8, device=device)
        broadcast(buffer)
    tensors = []
    for dtype_name, numel, on_host, offset, nbytes in table:
        dtype = _DTYPES[dtype_name]
        if not numel:
            tensors.append(torch.empty(0, dtype=dtype, device="cpu" if on_host else device))
        elif on_host:
            tensors.append(torch.frombuffer(frame, dtype=dtype, count=numel,
                                            offset=start + offset))
        else:  # a device tensor with elements: device_bytes > 0, the buffer was received
            tensors.append(cast(torch.Tensor, buffer)[offset: offset + nbytes].view(dtype))
    return op, _unpack(skeleton, tensors)


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _pack(value: Any, tensors: list[torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ["t", len(tensors) - 1, list(value.shape)]
    if isinstance(value, tuple):
        return ["u", [_pack(v, tensors) for v in value]]
    if isinstance(value, list):
        return ["l", [_pack(v, tensors) for v in value]]
    if isinstance(value, LOCAL_TYPES):
        return ["x"]
    name = type(value).__name__
    if MESSAGE_TYPES.get(name) is type(value):
        return ["d", name, [_pack(getattr(value, f), tensors) for f in _FIELDS[name]]]
    raise TypeError(f"a call to the ranks cannot carry {type(value).__name__}")


def _unpack(value: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(value, list):
        return value
    tag = value[0]
    if tag == "t":
        return tensors[value[1]].view(value[2])
    if tag == "u":
        return tuple(_unpack(v, tensors) for v in value[1])
    if tag == "l":
        return [_unpack(v, tensors) for v in value[1]]
    if tag == "x":
        return None
    name = value[1]
    return MESSAGE_TYPES[name](**{n: _unpack(v, tensors)
                                  for n, v in zip(_FIELDS[name], value[2], strict=True)})
