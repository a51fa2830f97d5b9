"""Zero-copy interop with PyTorch and JAX: DLPack views both ways, ordered on the right stream.

Every op of the package already takes PyTorch tensors, JAX arrays and any other DLPack exporter
as arguments, and any stream kind as ``stream=`` (a ``torch.cuda.Stream`` or
``torch.cuda.current_stream()`` is passed as it is). This module adds the way back and makes
the order across libraries explicit:

- :func:`as_cupy`: a CuPy view of a GPU tensor (torch, JAX, CuPy), made ready for ``stream``;
- :func:`to_torch`, :func:`to_jax`: a torch tensor / JAX array over a CuPy array (a swap's
  output rows, ``cache.device_rows(layer)``), readable once the work queued on ``stream`` is;
- :func:`cupy_stream`, :func:`torch_stream`: one stream, as each library names it.

No copy is made: each result shares the producer's memory and keeps the producer's buffer
allocated while it lives. It does not hold back a reuse of that memory after both are gone:
torch's caching allocator and JAX reuse a freed buffer in order with their own streams only, so
keep the original alive until the work queued on ``stream`` that reads it is done (with torch,
``t.record_stream(torch_stream(stream))`` does that too).

Order (the DLPack stream protocol). The importer passes the stream it will use to the
exporter's ``__dlpack__(stream=...)``, and the exporter makes that stream wait, on the device,
for the array's pending work. Who passes what:

- CuPy imports (``cupy.from_dlpack``, so every argument this package takes) pass CuPy's
  *current* stream. :func:`as_cupy` makes ``stream`` current for the import, so the order lands
  on the stream the kernels run on. PyTorch then makes it wait for torch's current stream;
  JAX for the array's definition event (the computation, jitted or eager, that produced it):
  no host synchronization either way.
- ``torch.from_dlpack`` passes torch's current stream; JAX passes the stream it waits on for
  external buffers (``device.get_stream_for_external_ready_events()``). CuPy, the exporter,
  records an event on its current stream (:func:`to_torch` / :func:`to_jax` make that
  ``stream``) and makes the importer's stream wait for it; nothing waits when the two are the
  same stream.
- Nothing orders the other way round: the importer's later *reads* are not visible to us. A
  buffer that torch or JAX reads and that a later swap rewrites (the default output of
  ``Step.swap``, the device rows) must not be rewritten before they have read it. With torch,
  run both on one stream (pass torch's stream to ``begin_step``). With JAX, make ``stream`` wait
  for a result computed from the buffer, ``as_cupy(result, stream=stream)`` (on the device), or
  call ``result.block_until_ready()`` (on the host), before the next swap or backup.

CUDA graphs. ``torch.cuda.graph(g, stream=s)`` captures the package's kernels when the step runs
on ``s`` (``begin_step(..., stream=s)``), after one eager step (kernels compile and load on
first use) and with inputs in fixed buffers. A DLPack import or export inside the capture is
safe only on the capture stream. The ops import their own arguments on the stream they run on
(the step's, or ``stream=``), so torch tensors can be passed to them straight; conversions of
your own need ``stream=s`` here (or ``with cupy_stream(s):``). Otherwise the exchange waits on
CuPy's default (legacy) stream, which a capture forbids, and the capture is invalidated.

``jax.jit``. The kernels are launched from Python on concrete device pointers; they are not XLA
custom calls, so they cannot run inside ``jax.jit`` (nor ``vmap``, ``grad``, ``shard_map``):
:func:`as_cupy` rejects a tracer with a message saying so. Call them eagerly, between jitted
functions: a jitted function's outputs are ordinary arrays to pass here, and its inputs may be
:func:`to_jax` views (do not donate those: XLA would write into memory the cache owns). JAX
assumes its arrays never change: a view of a buffer that a later call rewrites must have been
read (see above) before it is rewritten.

torch and JAX are imported on first use of the function that needs them; importing this module
imports neither. ``pip install 'hisparse_cupy[interop]'`` (with a CUDA extra) brings both.
"""

from __future__ import annotations

import importlib

import cupy
import numpy as np

from . import _checks
from ._checks import ArrayLike, StreamLike
from ._kernels.launch import as_stream

__all__ = ["as_cupy", "cupy_stream", "to_jax", "to_torch", "torch_stream"]


def _need(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"hisparse_cupy.interop.{what} needs {module.split('.')[0]}, which is "
                          f"not installed: pip install 'hisparse_cupy[interop]' (with the "
                          f"cuda12 or cuda13 extra that matches your driver)") from e


def _is_tracer(x) -> bool:
    """Whether ``x`` is a JAX tracer (an abstract value inside jit/vmap/grad), without
    importing JAX."""
    return any(c.__name__ == "Tracer" and c.__module__.startswith("jax")
               for c in type(x).__mro__)


def _cupy_array(name: str, a) -> cupy.ndarray:
    if not isinstance(a, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array (what the ops return; use as_cupy for "
                        f"other arrays), got {type(a).__name__}")
    return a


def cupy_stream(stream: StreamLike | None = None):
    """The CuPy stream object of any stream kind the ops take (a torch stream, a raw handle,
    ``__cuda_stream__``...); ``None``: CuPy's current stream.

    Use it as a context to make a torch stream CuPy's current one, so that the DLPack imports of
    tensors passed straight to the ops order against it (and stay legal inside
    ``torch.cuda.graph``): ``with cupy_stream(s): step = cache.begin_step(req_t, lens_t,
    stream=s)``. The object wraps the handle and does not own it: keep ``stream`` alive.
    """
    return as_stream(stream)


def torch_stream(stream: StreamLike | None = None):
    """``stream`` (any kind the ops take; ``None``: CuPy's current stream) as a torch stream
    on the same handle, e.g. to run torch work on a step's stream:
    ``with torch.cuda.stream(torch_stream(step.stream)): ...``.

    A torch stream is returned as it is; CuPy's default stream is torch's default stream (both
    are the legacy stream). Other handles give a ``torch.cuda.ExternalStream``, which does not
    own the stream.
    """
    torch = _need("torch", "torch_stream")
    if isinstance(stream, torch.cuda.Stream):
        return stream
    s = as_stream(stream)
    dev = getattr(s, "device_id", -1)
    if dev is None or dev < 0:
        dev = cupy.cuda.runtime.getDevice()
    if s.ptr == 0:
        return torch.cuda.default_stream(dev)
    return torch.cuda.ExternalStream(s.ptr, device=dev)


def as_cupy(x: ArrayLike, *, stream: StreamLike | None = None, name: str = "x") -> cupy.ndarray:
    """A CuPy view of the GPU array ``x`` (a torch tensor, a JAX array, a CuPy array or any
    DLPack exporter) on the current device, without a copy (the data pointers are equal).

    ``stream`` (any stream kind; default: CuPy's current stream) is where the view will be used:
    the import passes it to ``x.__dlpack__``, so work pending on ``x`` is ordered before later
    work on ``stream`` on the device (torch: the work queued on torch's current stream; JAX: the
    computation that produced ``x``). A CuPy array is returned as it is (no order is added).

    Raises ``TypeError`` naming ``name`` for a host array (NumPy, a CPU tensor), a traced JAX
    value (inside ``jax.jit``) or an object that is not an array, and ``ValueError`` for an
    array on another device.
    """
    if _is_tracer(x):
        raise TypeError(f"{name} is a traced JAX value: hisparse_cupy's kernels are not XLA "
                        f"custom calls and cannot run inside jax.jit, vmap or grad; call them "
                        f"outside, on concrete arrays (a jitted function's outputs are fine)")
    if isinstance(x, (cupy.ndarray, np.ndarray)) or not hasattr(x, "__dlpack__"):
        return _checks.as_device_array(name, x)  # nothing to import: CuPy's, or the error
    with as_stream(stream):
        return _checks.as_device_array(name, x)


def to_torch(a: cupy.ndarray, *, stream: StreamLike | None = None):
    """A torch tensor over the CuPy array ``a`` (same memory, same shape and strides).

    ``stream`` (any stream kind; default: CuPy's current stream) is where ``a`` was written (the
    step's stream): torch's current stream waits for the work queued there before the call.
    Inside ``torch.cuda.graph`` pass the capture stream.
    """
    torch = _need("torch", "to_torch")
    a = _cupy_array("a", a)
    with as_stream(stream):
        return torch.from_dlpack(a)


def _compact(a: cupy.ndarray) -> bool:
    """Whether ``a``'s strides are a permutation of a dense layout (what JAX can import)."""
    expect = a.itemsize
    for st, n in sorted((st, n) for st, n in zip(a.strides, a.shape, strict=True) if n > 1):
        if st != expect:
            return False
        expect *= n
    return True


def to_jax(a: cupy.ndarray, *, stream: StreamLike | None = None):
    """A JAX array over the CuPy array ``a`` (same memory: ``unsafe_buffer_pointer()`` equals
    ``a.data.ptr``), for eager JAX code or as an argument of a jitted function.

    ``stream`` (any stream kind; default: CuPy's current stream) is where ``a`` was written: JAX
    computations on the result wait, on the device, for the work queued there before the call.
    JAX imports only dense layouts (a transposition is fine, a column slice is not: make it
    dense with ``cupy.ascontiguousarray``, a copy). JAX takes the array as immutable: see the
    module docstring before letting a later swap rewrite ``a``.
    """
    jdl = _need("jax.dlpack", "to_jax")
    a = _cupy_array("a", a)
    if a.size and not _compact(a):
        raise ValueError(f"a must have a dense layout for JAX (strides {a.strides}, shape "
                         f"{a.shape}); cupy.ascontiguousarray(a) makes a dense copy")
    with as_stream(stream):
        return jdl.from_dlpack(a)
