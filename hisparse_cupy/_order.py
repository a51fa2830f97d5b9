"""The library's own order between streams (``docs/design.md`` section 9, "The cache's calls on
any stream"): what lets an engine queue a :class:`~hisparse_cupy.HotBufferCache`'s calls on
any streams with no synchronization and no event of its own between them.

Three rules, each kept here once:

1. **Calls in the order the host makes them** (:meth:`StreamOrder.enter`): a call queued on a
   stream other than the previous call's first waits for an event recorded, at that moment,
   on the previous call's stream. Every call's device work therefore follows the work of every
   earlier call (of the tables, flags and rows it reads), on whatever stream either was queued.
   One stream throughout costs nothing (no event); a change of stream costs one event. A
   stream that is capturing a CUDA graph neither waits nor is recorded, nor counts as the last
   call (a capture may not depend on work outside it): the engine begins a capture after an
   eager call on the same stream (a warm-up step), and a replay runs after a cache call on its
   stream (``grow``, ``residency.switch_promoted``, or
   :meth:`~hisparse_cupy.HotBufferCache.order`), which waits for the last eager call's work.
   The per-thread default stream (handle 2) is a different stream in each thread: a call from
   another thread than the last one's, when that one ran there, waits for the device on the
   host (nothing can be recorded on another thread's per-thread stream).
2. **A page carries the fence of the last work that touches it**
   (:class:`~hisparse_cupy.host.HostPages`'s ``fence=`` and ``wait=``): a path that gives
   pages back (a release, a demotion, a cancelled promotion, a switch) attaches an event
   recorded after its own work (:meth:`StreamOrder.fence`), or the event of side work still
   writing them (a promotion's fill); a path that takes pages waits for theirs on the stream
   that will write them (:meth:`StreamOrder.waiter`) before it queues anything there, or on
   the host before the CPU or another process writes them (the allocator's default).
3. **An array a call reads later is held until that read has run** (:meth:`StreamOrder.keep`):
   the prefill or draft KV given on the GPU to ``admit`` or ``write_host`` may be dropped by
   the caller as soon as the call returns, and its memory reused at once by the next array
   allocated on the stream it was made on; the cache keeps it alive until an event after its
   copy is done (checked at each later call).
"""

from __future__ import annotations

import contextlib
import threading

import cupy

_PER_THREAD = 2  # cudaStreamPerThread: another stream in each thread

__all__ = ["StreamOrder"]


class StreamOrder:
    """One cache's order between streams (the module docstring)."""

    def __init__(self):
        self._last = None  # the stream of the last call (a CuPy stream object, kept alive)
        self._thread = None  # the thread that made it (the per-thread stream is per thread)
        self._held: list[tuple[cupy.cuda.Event, tuple]] = []

    def enter(self, stream) -> None:
        """Rule 1: ``stream`` (a CuPy stream object) follows every earlier call's work. Also
        drops the arrays held (rule 3) whose reads have run."""
        last, me = self._last, threading.get_ident()
        if last is not None and last.ptr == stream.ptr and self._thread == me:
            pass  # the last call's stream, this thread: nothing to order (no capture query)
        elif not stream.is_capturing():  # a capture neither waits nor counts as the last call:
            # the next eager call (a replay's order()) follows the last eager call's work
            if last is not None and last.ptr == _PER_THREAD and self._thread != me:
                # another thread's per-thread default stream: no event can be recorded on it
                # from here, so the device is waited for instead (a host sync, on this path
                # only; give calls from several threads explicit streams to avoid it)
                cupy.cuda.runtime.deviceSynchronize()
                last = None
            self._last, self._thread = stream, me
            if last is not None and last.ptr != stream.ptr and not last.is_capturing():
                ev = cupy.cuda.Event(disable_timing=True)
                ev.record(last)
                stream.wait_event(ev)
        if self._held:
            self._held = [(e, objs) for e, objs in self._held if not e.done]

    def keep(self, stream, *objs) -> None:
        """Rule 3: hold ``objs`` until the work queued on ``stream`` so far has run."""
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        self._held.append((ev, objs))

    @staticmethod
    @contextlib.contextmanager
    def fence(stream):
        """Rule 2, giving pages back: an event to attach to them (``fence=``), recorded on
        ``stream`` when the block ends, after everything it queued there (an event not yet
        recorded reads as done: attach it only to pages nothing takes before the block
        ends, i.e. within one call)."""
        ev = cupy.cuda.Event(disable_timing=True)
        try:
            yield ev
        finally:
            ev.record(stream)

    @staticmethod
    def waiter(stream):
        """Rule 2, taking pages: the ``wait=`` callable that makes ``stream`` wait for the
        fences of the pages taken, before anything it queues writes them."""
        def wait(fences) -> None:
            for f in fences:
                stream.wait_event(f)
        return wait
