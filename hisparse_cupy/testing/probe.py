"""Measuring instruments for the planned copy (tests, benchmarks, sanitizer runs; not for engines).

:func:`copy_probe` is a context manager: while it is active, every host -> device planned copy
that :func:`hisparse_cupy._kernels.plan.launch_copy` queues on one of its streams (the stateless
:func:`~hisparse_cupy.swap_in`'s copy, replays, the Prefetcher's replays and staging copies,
admission loads) runs the copy's measuring instance, ``planned_copy_probe``
(``cu/plan_probe.cu``, a module of its own compiled on a probe's first use), with its settings:

- ``dry_run``: all the work (plan reads, prefix, indexing, staging lookups), no bytes moved;
- ``spin_cycles``: each row delayed by that many SM clock cycles (an artificially slow copy:
  ordering tests see a copy still running long after it was queued);
- ``bad``: an int32 device scalar incremented once per entry whose source or destination row is
  outside its array (the copy skips those rows, probed or not).

The production instances take a struct without these fields and have no such code, and the
production path consults nothing: while the first probe is active this module puts its own
function in :data:`hisparse_cupy._kernels.plan.copy_queue` (what ``launch_copy`` calls), and
puts the production one back when the last ends. Device -> host copies (backups) are never
probed, nor copies launched through a :func:`hisparse_cupy._kernels.plan.copy_launcher` directly
(the Step's swap path). A copy queued while a CUDA graph is captured is captured with the
instance and settings in force then.

The active probes are one list of this process (:data:`active_copy_probes`, innermost last),
shared by every thread: enter and leave probes from one thread at a time.

    with copy_probe(dry_run=True, streams=[s]):
        replay_plan(plan, B, device_rows=dev, pool=pool, layer=0, stream=s)
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import cupy
import numpy as np

from .. import _abi, _checks
from .._kernels import build, plan
from .._kernels.launch import Launcher, Params, as_stream, ptr

__all__ = ["CopyProbe", "active_copy_probes", "copy_probe"]

# The probes now in force, innermost last (only CopyProbe changes it).
active_copy_probes: list[CopyProbe] = []
_launchers: dict[tuple, Launcher] = {}


def _queue(params: Params, B: int, to_host: bool, grid: int, stream_ptr: int, pdl: bool,
           rows_per_warp: int) -> None:
    """:data:`hisparse_cupy._kernels.plan.copy_queue` while a probe is active: a host -> device
    copy on a probed stream runs the measuring instance with the innermost such probe's
    settings (the driver copies the struct at the launch, so a temporary one does); any other
    copy the production queueing."""
    probe = None if to_host else next(
        (p for p in reversed(active_copy_probes) if p.covers(stream_ptr)), None)
    if probe is None:
        plan.queue_copy(params, B, to_host, grid, stream_ptr, pdl, rows_per_warp)
        return
    st = np.zeros(1, _abi.PLANNED_COPY_PROBE)
    ctypes.memmove(st.ctypes.data, params.addr, _abi.PLANNED_COPY.itemsize)
    st["bad"] = probe.bad_ptr
    st["spin_cycles"] = probe.spin_cycles
    st["dry_run"] = int(probe.dry_run)
    key = (B, rows_per_warp, pdl, cupy.cuda.runtime.getDevice())
    la = _launchers.get(key)
    if la is None:
        name = plan.instance(False, rows_per_warp, build.COPY_H2D_PROBE)
        la = _launchers[key] = plan.copy_kernel_launcher(name, B, pdl)
    la((grid, 1, 1), stream_ptr, st.ctypes.data)


class CopyProbe:
    """The settings of one :func:`copy_probe` (a context manager; see the module docstring).

    Attributes: ``dry_run`` (bool), ``spin_cycles`` (int), ``bad`` (the int32 device scalar or
    None), ``bad_ptr`` (its address, 0 for None), ``streams`` (a frozenset of stream handles, or
    None: every stream).
    """

    __slots__ = ("dry_run", "spin_cycles", "bad", "bad_ptr", "streams")

    def __init__(self, dry_run: bool, spin_cycles: int, bad, streams: frozenset[int] | None):
        self.dry_run = dry_run
        self.spin_cycles = spin_cycles
        self.bad = bad  # kept alive while the probe is
        self.bad_ptr = ptr(bad)
        self.streams = streams

    def covers(self, stream_ptr: int) -> bool:
        """Whether a copy queued on the stream of handle ``stream_ptr`` is probed."""
        return self.streams is None or stream_ptr in self.streams

    def __enter__(self) -> CopyProbe:
        active_copy_probes.append(self)
        plan.copy_queue = _queue
        return self

    def __exit__(self, *exc) -> None:
        for i in range(len(active_copy_probes) - 1, -1, -1):  # the innermost entry of this one
            if active_copy_probes[i] is self:
                del active_copy_probes[i]
                break
        if not active_copy_probes:
            plan.copy_queue = plan.queue_copy

    def __repr__(self) -> str:
        on = "every stream" if self.streams is None else f"{len(self.streams)} stream(s)"
        return (f"CopyProbe(dry_run={self.dry_run}, spin_cycles={self.spin_cycles}, "
                f"bad={'set' if self.bad is not None else None}, on {on})")


def copy_probe(*, dry_run: bool = False, spin_cycles: int = 0, bad=None,
               streams: Iterable | None = None) -> CopyProbe:
    """A context manager that probes the host -> device planned copies queued on ``streams``.

    Parameters
    ----------
    dry_run : bool
        Do all the work, move no bytes.
    spin_cycles : int
        Delay each row by this many SM clock cycles (>= 0; a warp waits for all of its rows'
        delays before it copies them).
    bad : int32 device scalar, optional
        Incremented once per entry whose source or destination row is outside its array.
    streams : iterable of streams, optional
        The streams whose copies are probed, each of any kind
        :func:`hisparse_cupy._kernels.launch.as_stream` takes (CuPy, PyTorch,
        ``__cuda_stream__``, int
        handle); None: every stream.

    The arguments are checked here, before the ``with`` block; see the module docstring for
    what is probed.
    """
    if not isinstance(dry_run, bool):
        raise TypeError(f"dry_run must be a bool, got {type(dry_run).__name__}")
    spin_cycles = _checks.integer("spin_cycles", spin_cycles, 0, 2**62)
    if bad is not None:
        bad = _checks.device_scalar("bad", bad)
    handles = None
    if streams is not None:
        if not isinstance(streams, Iterable) or isinstance(streams, (str, bytes)):
            raise TypeError(f"streams must be an iterable of streams (or None: every stream), "
                            f"got {type(streams).__name__}")
        handles = frozenset(as_stream(s).ptr for s in streams)
    return CopyProbe(dry_run, spin_cycles, bad, handles)
