"""DeepEP's ``EventHandle`` and ``EventOverlap`` (``from deep_ep.utils import EventOverlap``) over epjit's events.

An ``EventHandle`` is a point on a CUDA stream: made with no argument it is recorded on torch's current stream
(DeepEP's ``EventHandle()``), and a call with ``async_finish=True`` returns one at the end of its work on the
communication stream. ``EventOverlap`` wraps one for DeepEP's overlap idioms: ``current_stream_wait()`` and the
``with`` block whose end makes the current stream wait. A call with ``async_finish=False`` returns an
``EventOverlap`` holding no event, as DeepEP's do: its results are already ordered on the caller's stream.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..errors import ArgumentError, ArgumentTypeError, with_rank
from ..ops.streams import Event, caller_stream


def _torch_stream() -> tuple[int, int]:
    """torch's current stream (its address) and device: what DeepEP's events are recorded on and wait from."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise ArgumentError(with_rank("deep_ep's EventHandle works on torch's current stream: import torch first"))
    device = torch.cuda.current_device()
    return caller_stream("torch", device), device


class EventHandle:
    """A recorded CUDA event. ``EventHandle()`` records one on torch's current stream now."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        import cupy

        stream, device = _torch_stream()
        with cupy.cuda.Device(device):
            event = cupy.cuda.Event(disable_timing=True)
            cupy.cuda.runtime.eventRecord(event.ptr, stream)
        self.event = Event(event)  # epjit's Event: what an epjit call takes as previous_event

    @classmethod
    def of(cls, event: Event) -> EventHandle:
        """The handle of an epjit Event (a call's ``result.event``)."""
        if not isinstance(event, Event):
            raise ArgumentTypeError(with_rank(f"EventHandle.of needs an epjit Event, got {type(event).__name__}"))
        handle = cls.__new__(cls)
        handle.event = event
        return handle

    def current_stream_wait(self) -> None:
        """Make torch's current stream wait for the work before this event."""
        import cupy

        stream, _ = _torch_stream()
        cupy.cuda.runtime.streamWaitEvent(stream, self.event.event.ptr, 0)


class EventOverlap:
    """DeepEP's wrapper of an :class:`EventHandle` (or of none) for overlapping communication with compute.

    ``current_stream_wait()`` makes torch's current stream wait for the event (then runs the hook registered with
    ``register_hook_after_wait``); ``with overlap: ...`` runs the block, then waits the same way (nothing happens
    when there is no event). ``extra_tensors`` are kept referenced, as DeepEP keeps them."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple[Any, ...] | None = None) -> None:
        if event is not None and not isinstance(event, EventHandle):
            raise ArgumentTypeError(with_rank(f"EventOverlap(event=...) must be an EventHandle or None, got "
                                              f"{type(event).__name__}"))
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], Any] | None = None
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is None:
            raise ArgumentError(with_rank("this EventOverlap holds no event: the call that returned it ran with "
                                          "async_finish=False, so its results are already ordered on the stream"))
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        if self.hook_after_wait is not None:
            raise ArgumentError(with_rank("a hook is already registered on this EventOverlap"))
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """``with overlap(release_handle=True): ...`` drops the event once the block's wait is done."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: object, exc_val: object, exc_tb: object) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


def overlap_of(event: Event | None, async_finish: bool, extra_tensors: tuple[Any, ...] | None = None) -> EventOverlap:
    """What a DeepEP call returns for an epjit call's event: the event with async_finish, else none (DeepEP's calls
    return no event then: the caller's stream already waits for the work)."""
    if async_finish and event is not None:
        return EventOverlap(EventHandle.of(event), extra_tensors)
    return EventOverlap(None)


def previous_event_of(previous_event: object) -> Event | None:
    """The epjit Event a DeepEP ``previous_event`` (an EventOverlap, or None) stands for."""
    if previous_event is None:
        return None
    if isinstance(previous_event, EventOverlap):
        return None if previous_event.event is None else previous_event.event.event
    if isinstance(previous_event, EventHandle):
        return previous_event.event
    if isinstance(previous_event, Event):
        return previous_event
    raise ArgumentTypeError(with_rank(f"previous_event must be an EventOverlap (or None), got "
                                      f"{type(previous_event).__name__}"))


__all__ = ["EventHandle", "EventOverlap"]


def event_on(stream: Any) -> Event:
    """An epjit Event recorded now on ``stream`` (a CuPy stream)."""
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return Event(event)
