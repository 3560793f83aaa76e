"""Torch views over raw device memory, for get_local_buffer_tensor: DeepEP hands out its buffers as tensors."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ArgumentError, ArgumentTypeError, with_rank


def view_shape(num_bytes: int, dtype: Any, size: Any) -> tuple[int, tuple[int, ...] | None]:
    """(whole elements of ``dtype`` in ``num_bytes``, the view's shape: ``size`` as a tuple, or None for 1-D), with
    the arguments checked by name."""
    import torch

    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(with_rank(f"dtype must be a torch.dtype, got {dtype!r}"))
    count = num_bytes // dtype.itemsize
    if size is None:
        return count, None
    try:
        shape = tuple(int(n) for n in size)
    except TypeError:
        raise ArgumentTypeError(with_rank(f"size must be a torch.Size or a sequence of ints, got {size!r}")) from None
    if any(n < 0 for n in shape) or math.prod(shape) > count:
        raise ArgumentError(with_rank(f"size={shape} needs {math.prod(shape)} elements of {dtype}, the buffer holds "
                                      f"{count} from this offset"))
    return count, shape


def tensor_over(address: int, num_bytes: int, dtype: Any, size: Any, device: int, owner: Any) -> Any:
    """A torch tensor of ``dtype`` over ``num_bytes`` of device memory at ``address`` (1-D: every whole element;
    with ``size``, its first prod(size) elements in that shape), holding ``owner`` (the memory is its)."""
    import cupy
    import torch

    count, shape = view_shape(num_bytes, dtype, size)
    memory = cupy.cuda.UnownedMemory(address, count * dtype.itemsize, owner, device_id=device)
    raw = cupy.ndarray((count * dtype.itemsize,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    tensor = torch.from_dlpack(raw).view(dtype)
    return tensor if shape is None else tensor[:math.prod(shape)].view(shape)
