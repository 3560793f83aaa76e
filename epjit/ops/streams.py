"""The stream and event policy every call follows, whatever its kernel family.

A Buffer owns one communication stream. A call is ordered after the work its caller has queued on the caller's
stream (torch's current stream for torch tensors, CuPy's current stream otherwise: JAX arrays reach the kernels
through DLPack, which orders JAX's work before CuPy's current stream), or after ``previous_event``; its kernels run
on the communication stream; then, unless ``async_finish``, the caller's stream waits for them, so the results are
ready for whatever the caller runs next there.

Everything here works on raw stream and event addresses: a call's host time is what a small batch waits for, and a
CuPy stream object or context costs microseconds where an address costs nothing.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ArgumentTypeError, with_rank


def _cupy() -> Any:
    import cupy

    return cupy


class Event:
    """A point on the communication stream after a call (DeepEP's EventOverlap).

    A call with ``async_finish=True`` records it on the communication stream. A call without has already made its
    caller's stream wait for its work, so its event is recorded on the caller's stream the first time it is used
    (a point there after the call, and after whatever the caller queued since): the call pays nothing for an event
    nobody uses."""

    __slots__ = ("_event", "_stream_ptr")

    def __init__(self, event: Any = None, stream_ptr: int = 0) -> None:
        self._event = event  # a cupy.cuda.Event, or None until first used
        self._stream_ptr = stream_ptr  # where to record it then

    @property
    def event(self) -> Any:
        """The ``cupy.cuda.Event``."""
        if self._event is None:
            cupy = _cupy()
            event = cupy.cuda.Event(disable_timing=True)
            cupy.cuda.runtime.eventRecord(event.ptr, self._stream_ptr)
            self._event = event
        return self._event

    def current_stream_wait(self) -> None:
        """Make the caller's current stream wait for the work before this event."""
        _cupy().cuda.get_current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()


_RAW_TORCH_STREAM: Any = None  # torch._C._cuda_getCurrentRawStream, found on first use


def caller_stream(framework: str, device: int) -> int:
    """The address of the stream the caller's arrays are used on: torch's current stream for torch tensors (so a
    call inside a torch side stream or CUDA-graph capture is ordered, and captured, where the caller's work is),
    CuPy's current stream otherwise."""
    global _RAW_TORCH_STREAM
    if framework == "torch":
        if _RAW_TORCH_STREAM is None:
            torch = sys.modules["torch"]
            _RAW_TORCH_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                lambda dev: torch.cuda.current_stream(dev).cuda_stream)
        return _RAW_TORCH_STREAM(device)
    return _cupy().cuda.get_current_stream().ptr


def is_capturing(stream_ptr: int) -> bool:
    """Whether the stream at ``stream_ptr`` is being captured into a CUDA graph."""
    return bool(_cupy().cuda.runtime.streamIsCapturing(stream_ptr))


class Streams:
    """A Buffer's communication stream, and the two reusable events that order each call with its caller."""

    def __init__(self, device: int) -> None:
        cupy = _cupy()
        self.device = device
        with cupy.cuda.Device(device):
            self.comm = cupy.cuda.Stream(non_blocking=True)
            # Re-recorded every call: a wait is on the record made before it, whatever comes later.
            self._order = cupy.cuda.Event(disable_timing=True)
            self._done = cupy.cuda.Event(disable_timing=True)
        self.comm_ptr = int(self.comm.ptr)
        self._order_ptr, self._done_ptr = int(self._order.ptr), int(self._done.ptr)
        rt = cupy.cuda.runtime
        self._record, self._wait = rt.eventRecord, rt.streamWaitEvent
        self._torch_comm: Any = None  # the communication stream as a torch stream (made on first use)

    def begin(self, caller_ptr: int, previous_event: Event | None = None) -> None:
        """Order the communication stream after the caller's work (or after ``previous_event``)."""
        if previous_event is not None:
            if not isinstance(previous_event, Event):
                raise ArgumentTypeError(with_rank(
                    f"previous_event must be an epjit Event, got {type(previous_event).__name__}"))
            self._wait(self.comm_ptr, previous_event.event.ptr, 0)
            return
        self._record(self._order_ptr, caller_ptr)
        self._wait(self.comm_ptr, self._order_ptr, 0)

    def finish(self, caller_ptr: int, async_finish: bool) -> Event:
        """The call's event; unless ``async_finish``, the caller's stream waits for the call's work first."""
        if async_finish:
            event = _cupy().cuda.Event(disable_timing=True)
            self._record(event.ptr, self.comm_ptr)
            return Event(event)
        self._record(self._done_ptr, self.comm_ptr)
        self._wait(caller_ptr, self._done_ptr, 0)
        return Event(None, caller_ptr)

    def mark(self) -> Any:
        """A new cupy.cuda.Event recorded on the communication stream now."""
        event = _cupy().cuda.Event(disable_timing=True)
        self._record(event.ptr, self.comm_ptr)
        return event

    def torch_comm(self) -> Any:
        """The communication stream as a torch stream."""
        if self._torch_comm is None:
            torch = sys.modules["torch"]
            self._torch_comm = torch.cuda.ExternalStream(self.comm_ptr, device=torch.device("cuda", self.device))
        return self._torch_comm

    def used_by_comm(self, tensors: tuple[Any, ...]) -> None:
        """async_finish with torch: the caller's stream does not wait for the communication stream, so tell torch's
        allocator that these tensors are in use there until its work so far is done (DeepEP does the same);
        otherwise one the caller drops early could be handed out again while a kernel still reads or writes it."""
        stream = None
        for t in tensors:
            if t is not None and type(t).__module__.startswith("torch"):
                if stream is None:
                    stream = self.torch_comm()
                t.record_stream(stream)

    def synchronize(self) -> None:
        self.comm.synchronize()


POISON_BYTE = 0x7F  # NaN in bf16 pairs (0x7F7F), NaN in e4m3, a huge int: never a plausible value


class Outputs:
    """Where a call's outputs come from, by allocation kind:

    - ``"torch"``: torch's caching allocator, on the caller's stream (torch's current stream), which the
      communication stream waits for (Streams.begin), so a block torch hands out again is free there; only for
      torch calls without previous_event (those use CuPy's pool and hand the arrays over, as JAX calls do);
    - ``"cupy"`` (also JAX): CuPy's pool, on the communication stream (FP8 as uint8 storage).

    With EPJIT_POISON_OUTPUTS=1 every output is filled with garbage on the communication stream first, so a row a
    kernel forgets shows up instead of reading as the zeros a fresh allocation happened to hold."""

    def __init__(self, streams: Streams, device: int, poison: bool) -> None:
        self.streams, self.device, self.poison = streams, device, poison
        # torch: an empty tensor of each dtype on the device; its new_empty allocates like torch.empty, with fewer
        # arguments for torch to parse (a call's outputs are a good part of its host time)
        self._protos: dict[Any, Any] = {}
        self._dtypes: dict[tuple[str, str], Any] = {}

    def dtype(self, kind: str, name: str) -> Any:
        """The dtype object :meth:`empty` takes for the dtype ``name`` (a name of epjit.arrays.DTYPES)."""
        key = (kind, name)
        found = self._dtypes.get(key)
        if found is None:
            if kind == "torch":
                found = getattr(sys.modules["torch"], name)
            else:
                from ..arrays import cupy_dtype

                found = cupy_dtype(name)
            self._dtypes[key] = found
        return found

    def allocator(self, kind: str, shape: tuple[int, ...], dtype: Any) -> Callable[[], Any]:
        """A callable that allocates one output of this shape: what a plan keeps, so a call allocates with one call
        (torch's prototype's new_empty itself, unless outputs are poisoned)."""
        if kind == "torch" and not self.poison:
            # the sizes as separate arguments: torch parses them faster than one tuple
            return functools.partial(self._proto(dtype).new_empty, *shape)
        return functools.partial(self.empty, kind, shape, dtype)

    def row_allocator(self, kind: str, cols: int, dtype: Any) -> Callable[[int], Any]:
        """A callable that allocates an output of ``rows`` x ``cols`` (rows known only at the call)."""
        if kind == "torch" and not self.poison:
            new_empty = self._proto(dtype).new_empty
            return lambda rows: new_empty(rows, cols)
        return lambda rows: self.empty(kind, (rows, cols), dtype)

    def _proto(self, dtype: Any) -> Any:
        proto = self._protos.get(dtype)
        if proto is None:
            torch = sys.modules["torch"]
            proto = self._protos[dtype] = torch.empty(0, dtype=dtype, device=torch.device("cuda", self.device))
        return proto

    def empty(self, kind: str, shape: tuple[int, ...], dtype: Any) -> Any:
        if kind == "torch":
            out = self._proto(dtype).new_empty(shape)
            if self.poison and out.numel():
                _cupy().cuda.runtime.memsetAsync(out.data_ptr(), POISON_BYTE, out.numel() * out.element_size(),
                                                 self.streams.comm_ptr)
            return out
        cupy = _cupy()
        with cupy.cuda.Device(self.device), self.streams.comm:
            out = cupy.empty(shape, dtype=dtype)
            if self.poison and out.size:
                out.view(cupy.uint8).fill(POISON_BYTE)
        return out
