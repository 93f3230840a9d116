"""Conversions between ``dspark.v1.Tensor`` messages and ``torch.Tensor``: the one place they live.

Wire format (see protos/dspark/v1/types.proto, message Tensor): ``data`` holds the elements as
little-endian bytes in C-contiguous (row-major) order, ``shape`` the sizes outermost first, ``dtype``
the element type. bfloat16 has no numpy dtype, so its 2-byte elements travel as their raw bits
(viewed as int16) and are reinterpreted on the way back: no rounding, bit-exact round trips.

Both directions copy the data exactly once. ``tensor_from_proto`` returns a writable CPU tensor
that does not alias the message (unless ``device`` says otherwise, it stays on the CPU).
"""

from __future__ import annotations

import math
import sys

import torch

from dspark_protos.dspark.v1 import types_pb2

__all__ = ["DTYPE_TO_TORCH", "TORCH_TO_DTYPE", "tensor_from_proto", "tensor_to_proto"]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("dspark_protos.tensors assumes a little-endian host (the wire format is little-endian)")

#: Wire dtype -> torch dtype.
DTYPE_TO_TORCH: dict[int, torch.dtype] = {
    types_pb2.DTYPE_FLOAT32: torch.float32,
    types_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    types_pb2.DTYPE_FLOAT16: torch.float16,
    types_pb2.DTYPE_INT64: torch.int64,
    types_pb2.DTYPE_INT32: torch.int32,
}
#: torch dtype -> wire dtype.
TORCH_TO_DTYPE: dict[torch.dtype, int] = {v: k for k, v in DTYPE_TO_TORCH.items()}

# 16-bit floats travel as their raw bits through a same-width integer view (numpy has no bfloat16).
_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def tensor_to_proto(tensor: torch.Tensor, out: types_pb2.Tensor | None = None) -> types_pb2.Tensor:
    """Serialise ``tensor`` (any device, any strides) into a ``Tensor`` message.

    Raises TypeError for dtypes the wire format does not carry (e.g. bool, float64: cast first).
    If ``out`` is given it is filled in place (e.g. ``tensor_to_proto(h, msg.hidden_states)``).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor_to_proto: expected a torch.Tensor, got {type(tensor).__name__}")
    wire = TORCH_TO_DTYPE.get(tensor.dtype)
    if wire is None:
        supported = ", ".join(str(d).removeprefix("torch.") for d in TORCH_TO_DTYPE)
        raise TypeError(f"tensor_to_proto: dtype {tensor.dtype} is not supported on the wire (supported: {supported})")
    t = tensor.detach().to("cpu").contiguous()
    view = _BITS_VIEW.get(t.dtype)
    if view is not None:
        t = t.view(view)
    msg = types_pb2.Tensor() if out is None else out
    msg.Clear()
    msg.dtype = wire
    msg.shape.extend(tensor.shape)
    msg.data = t.numpy().tobytes()
    return msg


def tensor_from_proto(msg: types_pb2.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Rebuild a ``torch.Tensor`` from a ``Tensor`` message (validated: dtype, shape, byte count).

    Raises ValueError naming the field and value when the message is malformed.
    """
    dtype = DTYPE_TO_TORCH.get(msg.dtype)
    if dtype is None:
        name = types_pb2.Dtype.Name(msg.dtype) if msg.dtype in types_pb2.Dtype.values() else str(msg.dtype)
        raise ValueError(f"Tensor.dtype: unsupported value {name}")
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"Tensor.shape: negative dimension in {list(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = math.prod(shape)
    if len(msg.data) != numel * itemsize:
        raise ValueError(
            f"Tensor.data: {len(msg.data)} bytes, expected {numel * itemsize} "
            f"for shape {list(shape)} and dtype {types_pb2.Dtype.Name(msg.dtype)}"
        )
    if numel == 0:
        result = torch.empty(shape, dtype=dtype)
    else:
        view = _BITS_VIEW.get(dtype, dtype)
        # bytearray: one copy into a writable buffer that the tensor then owns.
        result = torch.frombuffer(bytearray(msg.data), dtype=view).view(dtype).reshape(shape)
    return result if device is None else result.to(device)
