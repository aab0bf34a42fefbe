"""cupy.cuda of the stand-in: devices, streams, events, pinned memory (all on the host).

Streams: the default stream (``ptr`` 0) runs everything at once. On another
stream (``Stream(non_blocking=True)``) a ``memcpyAsync`` is queued and runs when
an event recorded after it on that stream is synchronised, when the stream is
synchronised or waited for, or at the second ``Event.done`` query (the first one
reports False: the copy is "still in flight"). ``wait_event`` by a stream that is
not the current one is queued: what precedes the event on its stream runs just
before the waiting stream's next work (the current stream waits at once: its
kernels and array operations run at once).
Allocating pinned memory synchronises the device, as cudaHostAlloc does. Kernels
and array operations run at once whatever the stream.
"""

from __future__ import annotations

import itertools
import time

from .._core import MemoryPointer
from . import runtime

__all__ = [
    "Device",
    "Stream",
    "Event",
    "get_current_stream",
    "get_elapsed_time",
    "alloc_pinned_memory",
    "PinnedMemoryPointer",
    "MemoryPointer",
    "runtime",
]

_current_device = [0]
pinned_allocations = [0]  # how many pinned buffers were allocated (tests count them)


class Device:
    """A stand-in device id (``runtime.getDeviceCount()`` of them)."""

    def __init__(self, device=None):
        self.id = _current_device[0] if device is None else int(device)
        if not 0 <= self.id < runtime.getDeviceCount():
            raise runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: device {self.id}")

    def use(self) -> None:
        _current_device[0] = self.id

    def synchronize(self) -> None:
        for s in list(Stream._all.values()):
            s.synchronize()

    @property
    def compute_capability(self) -> str:
        p = runtime.getDeviceProperties(self.id)
        return f"{p['major']}{p['minor']}"

    def __enter__(self):
        self._prev = _current_device[0]
        self.use()
        return self

    def __exit__(self, *exc):
        _current_device[0] = self._prev


class Stream:
    """A CUDA stream of the stand-in; ``ptr`` 0 is the default stream."""

    _all: dict = {}
    _ids = itertools.count(1)
    _stack: list = []

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.ptr = 0 if null else next(Stream._ids) * 4096
        self.queue: list = []  # (sequence number, operation)
        self.enqueued = 0  # operations ever queued
        self.ran = 0  # operations run (in order)
        Stream._all[self.ptr] = self

    def enqueue(self, op) -> None:
        if self.ptr == 0:
            op()
            self.enqueued += 1
            self.ran += 1
            return
        self.enqueued += 1
        self.queue.append((self.enqueued, op))

    def run_until(self, seq: int) -> None:
        while self.queue and self.queue[0][0] <= seq:
            n, op = self.queue.pop(0)
            op()
            self.ran = n

    def synchronize(self) -> None:
        self.run_until(self.enqueued)

    def wait_event(self, event) -> None:
        # work queued here later follows the event. The current stream's kernels and
        # array operations run at once, so its wait runs what precedes the event now;
        # another stream queues the wait before its next (copy) work
        if event.stream is None:
            return
        src, seq = event.stream, event.seq
        if self is get_current_stream() or self.ptr == 0:
            src.run_until(seq)
        else:
            self.enqueue(lambda: src.run_until(seq))

    @property
    def done(self) -> bool:
        self.synchronize()
        return True

    def use(self):
        Stream._stack[:] = [self]
        return self

    def __enter__(self):
        Stream._stack.append(self)
        return self

    def __exit__(self, *exc):
        Stream._stack.pop()


Stream.null = Stream(null=True)


def get_current_stream(device_id=None) -> Stream:
    return Stream._stack[-1] if Stream._stack else Stream.null


class Event:
    """An event on a stand-in stream: complete once the work before it ran."""

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ):
        self.stream = None
        self.seq = 0
        self.queries = 0
        self.time = None
        self.disable_timing = disable_timing

    def record(self, stream=None) -> None:
        self.stream = get_current_stream() if stream is None else stream
        self.seq = self.stream.enqueued
        self.queries = 0
        self.time = time.perf_counter() if self.stream.ran >= self.seq else None

    def _complete(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.seq)
        if self.time is None:
            self.time = time.perf_counter()

    def synchronize(self) -> None:
        self._complete()

    @property
    def done(self) -> bool:
        if self.stream is None or self.stream.ran >= self.seq:
            self._complete()
            return True
        self.queries += 1
        if self.queries < 2:
            return False  # "still in flight" at the first query
        self._complete()
        return True


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two completed events (host clock of the stand-in)."""
    for e in (start, end):
        if e.disable_timing:
            raise runtime.CUDARuntimeError("cudaErrorInvalidResourceHandle: timing disabled")
        if e.time is None:
            raise runtime.CUDARuntimeError("cudaErrorNotReady: event not complete")
    return (end.time - start.time) * 1e3


class PinnedMemoryPointer(bytearray):
    """Page-locked host memory of the stand-in (a bytearray; the buffer protocol)."""

    @property
    def ptr(self) -> int:
        import ctypes

        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))


def alloc_pinned_memory(nbytes: int) -> PinnedMemoryPointer:
    """Page-locked memory; as cudaHostAlloc, the allocation synchronises the device."""
    Device().synchronize()
    pinned_allocations[0] += 1
    return PinnedMemoryPointer(int(nbytes))
