"""Torch views over raw device memory, for get_local_buffer_tensor: DeepEP hands out its buffers as tensors."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ArgumentError, with_rank


def tensor_over(address: int, num_bytes: int, dtype: Any, size: Any, device: int, owner: Any) -> Any:
    """A torch tensor of ``dtype`` over ``num_bytes`` of device memory at ``address`` (1-D: every whole element;
    with ``size``, its first prod(size) elements in that shape), holding ``owner`` (the memory is its)."""
    import cupy
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    count = num_bytes // itemsize
    if size is not None:
        shape = tuple(size)
        if math.prod(shape) > count:
            raise ArgumentError(with_rank(f"size={shape} needs {math.prod(shape)} elements of {dtype}, the buffer "
                                          f"holds {count} from this offset"))
    memory = cupy.cuda.UnownedMemory(address, count * itemsize, owner, device_id=device)
    raw = cupy.ndarray((count * itemsize,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    tensor = torch.from_dlpack(raw).view(dtype)
    return tensor if size is None else tensor[:math.prod(shape)].view(shape)
