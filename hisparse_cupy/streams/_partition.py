"""SM partitions for the overlap: the side streams' copies on SMs the compute never uses.

A copy block resident on an SM holds back a persistent GEMM's CTA there until it exits (Hopper's
cuBLAS GEMMs take every register of an SM: ``benchmarks/NOTES.md``, "Copies beside compute"),
so replays launched beside the model's matmuls delay them, and by how much depends on where
the block scheduler put the copy blocks. A CUDA green context (driver API, CUDA 12.4+) binds
streams to a fixed set of SMs: :class:`SMPartition` splits the device into a small *side* group
for the prefetcher's replays and staging copies and a *main* group for everything else, with
streams bound to each. Work on the two groups never shares an SM; events, waits and CUDA-graph
capture work across them as between any two streams of the device, and kernels of this package
(and PyTorch's) run on either group unchanged.

The model's compute has to stay off the side group to gain anything: run the decode step on
:meth:`SMPartition.stream` ``("main")``, and size persistent kernels to ``main_sms`` (a cuBLAS
GEMM planned for every SM of the device runs a second wave on fewer: set its SM-count target,
e.g. ``cublasSetSmCountTarget(handle, partition.main_sms)``).

Hopper splits SMs in groups of 8 (a request is rounded up to a multiple of the device's
granularity; ``side_sms`` says what was granted).
"""

from __future__ import annotations

import cupy

from .. import _checks
from .._kernels.launch import StreamHandle

__all__ = ["SMPartition"]


class SMPartition:
    """Two disjoint SM groups of one device (green contexts), and streams bound to each.

    Parameters
    ----------
    side_sms : int
        SMs for the side group (rounded up to the device's granularity: 8 on Hopper); the main
        group gets the rest.
    device : int, optional
        Device ordinal (default: CuPy's current device).

    Attributes
    ----------
    side_sms, main_sms : int
        SMs granted to each group.
    device : int

    Raises
    ------
    ValueError
        ``side_sms`` not in ``1 .. SM count - 1``, or no SMs left for the main group after
        rounding.
    RuntimeError
        The driver has no green contexts (CUDA 12.4+ is needed) or refused the split.

    Notes
    -----
    Streams are non-blocking. Destroy them (and the contexts) with :meth:`close`, after every
    stream is idle and no captured graph that uses them will be launched again.
    """

    def __init__(self, side_sms: int, *, device: int | None = None):
        side_sms = _checks.integer("side_sms", side_sms, 1, 2**31 - 1)
        from cuda.bindings import driver as cu

        self._cu = cu
        self.device = cupy.cuda.Device().id if device is None else _checks.integer(
            "device", device, 0, cupy.cuda.runtime.getDeviceCount() - 1)
        self._streams: list[int] = []
        self._ctx: dict[str, object] = {}
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # primary context up
            dev = self._call("cuDeviceGet", self.device)
            try:
                sm = self._call("cuDeviceGetDevResource", dev,
                                cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
            except AttributeError as e:
                raise RuntimeError("SM partitions need green contexts (CUDA driver 12.4+ and "
                                   "cuda-bindings with cuDeviceGetDevResource)") from e
            total = int(sm.sm.smCount)
            if side_sms >= total:
                raise ValueError(f"side_sms must be < the device's {total} SMs, got {side_sms}")
            groups, n, rest = self._call("cuDevSmResourceSplitByCount", 1, sm, 0, side_sms)
            if n < 1 or int(rest.sm.smCount) < 1:
                raise ValueError(f"side_sms={side_sms} leaves no SMs for the main group "
                                 f"(device has {total}, granted {int(groups[0].sm.smCount)})")
            self.side_sms = int(groups[0].sm.smCount)
            self.main_sms = int(rest.sm.smCount)
            try:
                for name, res in (("side", groups[0]), ("main", rest)):
                    desc = self._call("cuDevResourceGenerateDesc", [res], 1)
                    self._ctx[name] = self._call(
                        "cuGreenCtxCreate", desc, dev,
                        cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
            except BaseException:
                self.close()  # the first context, if the second failed
                raise

    def _call(self, fn: str, *args):
        out = getattr(self._cu, fn)(*args)
        err, rest = out[0], out[1:]
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{fn}: {err}")
        return rest[0] if len(rest) == 1 else rest

    def stream(self, group: str, *, priority: int = 0) -> cupy.cuda.Stream:
        """A new non-blocking stream whose kernels run on that group's SMs only.

        ``group``: ``"side"`` or ``"main"``. ``priority``: as for ``cupy.cuda.Stream`` (lower
        is higher; clamped by the driver to the device's range).
        """
        if self._ctx is None:
            raise RuntimeError("the SMPartition is closed")
        if not isinstance(group, str) or group not in self._ctx:
            raise ValueError(f"group must be 'side' or 'main', got {group!r}")
        priority = _checks.integer("priority", priority, -(2**31), 2**31 - 1)
        h = self._call("cuGreenCtxStreamCreate", self._ctx[group],
                       self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING, priority)
        ptr = int(h)
        self._streams.append(ptr)
        with cupy.cuda.Device(self.device):
            return cupy.cuda.Stream.from_external(StreamHandle(ptr))

    def close(self) -> None:
        """Wait for every stream made by :meth:`stream`, then destroy them and both green
        contexts. The streams' CuPy objects (and a Prefetcher built on this partition) must not
        be used after it."""
        if self._ctx is None:
            return
        ctx, self._ctx = self._ctx, None
        streams, self._streams = self._streams, []
        for ptr in streams:
            self._call("cuStreamSynchronize", self._cu.CUstream(ptr))
            self._call("cuStreamDestroy", self._cu.CUstream(ptr))
        for g in ctx.values():
            self._call("cuGreenCtxDestroy", g)

    def __enter__(self) -> SMPartition:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._ctx is None else f"side {self.side_sms}, main {self.main_sms}"
        return f"SMPartition(device {self.device}: {state} SMs)"
