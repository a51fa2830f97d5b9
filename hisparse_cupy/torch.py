"""The cache's step as PyTorch custom ops (``torch.library``), for engines that compile their
model with ``torch.compile`` and capture it in CUDA graphs.

DLPack calls cannot be traced by Dynamo, so a model that calls the CuPy API inside
``torch.compile(fullgraph=True)`` does not compile. Here the step's calls are operators in the
``hisparse`` namespace with fake (meta) implementations: Dynamo puts them in the graph as they
are, and Inductor calls them as it would call any other operator. They take torch tensors and
return fresh ones, and run on torch's current stream (the capture stream inside
``torch.cuda.graph``).

    from hisparse_cupy.torch import TorchCache
    tc = TorchCache(cache)                    # or TorchCache(cache, prefetcher=pf)
    rows = tc.device_rows                     # uint8 [n_layers, D, row_bytes], the cache's rows

    @torch.compile(fullgraph=True)
    def step(req, lens, top_k):               # torch tensors on the GPU
        for layer in range(n_layers):
            locs = tc.swap(layer, top_k[layer], req, lens)   # int32 [B, K]: rows of layer
            kv = rows[layer][locs.clamp(min=0).long()]       # the layer's selected KV
            ...
        tc.finish()                           # with a prefetcher: join its side streams

The operators (``torch.ops.hisparse.*``):

- ``swap(cache, layer, top_k, req, seq_lens, num_real, rows) -> Tensor``:
  :meth:`hisparse_cupy.Step.swap` of ``layer`` (``top_k`` ``[B, K]`` or ``[B, S, K]``; the
  result has its shape, -1 for unused or invalid entries);
- ``newest_rows(cache, req, seq_lens, num_real) -> Tensor`` and
  ``backup_newest(cache, req, seq_lens, num_real, write_host, rows) -> Tensor``: the step's
  newest-token rows (:meth:`Step.newest_rows`, :meth:`Step.backup_newest`);
- ``before_indexer(cache, layer) -> ()``: :meth:`Step.before_indexer` (with a prefetcher that
  stages at the indexer, call it before each full layer's indexer; it is ordered with the other
  ``hisparse`` operators only, not with the model's own kernels, so a compiler may move the
  indexer's kernels across it: the staging's place, never its bytes);
- ``finish(cache) -> ()``: :meth:`Step.finish`.

A cache with a device budget (``docs/design.md`` section 10): the operators' steps run lean
while every request is resident (``cache.residency.lean_step``) and a new step begins after a
demotion or an admission that is not resident; promotions switch at the first call after a
``finish``. Demote and promote between steps; a graph captured lean is captured again once a
request is not resident (as for ``begin_step``).

Order. The operators change state that torch does not hold (the cache's tables, its device
rows, the host pool), so they are registered as *ordered effects*: torch.compile threads an
effect token through them, which keeps them in program order and never drops one (``finish``
returns nothing). The model's own tensors order by data: a swap's result is what the model
reads the rows through (``rows[layer][locs]``), so those reads follow the swap. ``rows`` (the
cache's device rows, every layer) is an input of ``swap`` and ``backup_newest`` so that a KV
write the model made into it earlier in the graph comes first. That write must land in the
cache's own memory: Inductor re-inplaces a write into a graph input, and if a compiler hands the
operator a copy of ``rows`` instead (the write went to the copy), the operator raises rather
than work on rows that miss the write. They are not declared mutated: torch would then give
each call a functional copy of the whole row array. So do not read ``rows`` before a swap and
rely on the value after it: read the rows a swap returns, through its result.

``cache`` is an integer naming the :class:`TorchCache` (Dynamo bakes it into the graph as a
constant). The batch is validated once per (request, length, padding buffer, stream): a step
with the same buffers, as in a CUDA graph or a compiled model with static inputs, reuses the
validated batch. With a prefetcher every result is a copy of the prefetcher's page-table buffer
(one small copy on the stream), a full layer's top-k is copied into the TorchCache's own buffer
(its shared layers and the prediction stager read it later), a shared layer must be given a
top-k of its full layer's shape (which it ignores), and torch's current stream must not be the
legacy default stream.

Needs torch (``pip install 'hisparse_cupy[interop]'`` with a CUDA extra); importing this module
registers the operators once per process.
"""

# No `from __future__ import annotations` here: torch.library reads the operators' schemas from
# their annotations, and it takes typing.Optional (not `X | None`) for an optional tensor.
import itertools
import weakref
from typing import Optional

try:
    import torch
except ImportError as e:  # pragma: no cover - the message is what a user sees
    raise ImportError("hisparse_cupy.torch needs PyTorch, which is not installed: pip install "
                      "'hisparse_cupy[interop]' (with the cuda12 or cuda13 extra that matches "
                      "torch.version.cuda)") from e

import cupy
from torch import Tensor

from .cache import HotBufferCache
from .interop import to_torch

__all__ = ["TorchCache"]

_caches = weakref.WeakValueDictionary()  # id -> TorchCache
_ids = itertools.count(1)


class TorchCache:
    """A :class:`~hisparse_cupy.HotBufferCache` (and optionally its
    :class:`~hisparse_cupy.Prefetcher`) driven through the ``hisparse`` operators.

    Attributes
    ----------
    cache, prefetcher
    id : int, the ``cache`` argument of the operators.
    device_rows : uint8 ``[n_layers, D, row_bytes]`` torch view of the cache's device rows
        (``cache.device``): index it with a swap's result.

    Keep the object alive while its operators may run (the registry holds it weakly).
    """

    def __init__(self, cache: HotBufferCache, prefetcher=None):
        if not isinstance(cache, HotBufferCache):
            raise TypeError(f"cache must be a HotBufferCache, got {type(cache).__name__}")
        if prefetcher is not None and prefetcher.cache is not cache:
            raise ValueError("prefetcher drives another cache")
        self.cache, self.prefetcher = cache, prefetcher
        self.device_rows = to_torch(cache.device)
        self.id = next(_ids)
        self._step = None  # (key, Step): the last validated batch
        self._anchor = self._full_rank = None  # the full layers' top-k copies (anchor_top_k)
        if prefetcher is not None:  # allocated now: not inside a graph capture
            n = cache.max_batch * max(1, cache.max_steps) * cache.top_k
            self._anchor = cupy.empty((2, n), cupy.int32)
            self._full_rank = {f: j for j, f in enumerate(prefetcher.pattern.full_layers)}
            cupy.cuda.get_current_stream().synchronize()  # (as the Prefetcher's buffers)
        _caches[self.id] = self

    # the model's calls (each one operator)
    def swap(self, layer: int, top_k: Tensor, req: Tensor, seq_lens: Tensor,
             num_real: Tensor | None = None) -> Tensor:
        return torch.ops.hisparse.swap(self.id, layer, top_k, req, seq_lens, num_real,
                                       self.device_rows)

    def newest_rows(self, req: Tensor, seq_lens: Tensor, num_real: Tensor | None = None):
        return torch.ops.hisparse.newest_rows(self.id, req, seq_lens, num_real)

    def backup_newest(self, req: Tensor, seq_lens: Tensor, num_real: Tensor | None = None, *,
                      write_host: bool = True) -> Tensor:
        return torch.ops.hisparse.backup_newest(self.id, req, seq_lens, num_real, write_host,
                                                self.device_rows)

    def before_indexer(self, layer: int) -> None:
        torch.ops.hisparse.before_indexer(self.id, layer)

    def finish(self) -> None:
        torch.ops.hisparse.finish(self.id)

    # the operators' side
    def step(self, req: Tensor, seq_lens: Tensor, num_real: Tensor | None):
        """The :class:`~hisparse_cupy.Step` of this batch on torch's current stream (the last
        one again when the buffers and the stream are the same)."""
        s = torch.cuda.current_stream()
        # with a device budget, whether the step runs lean (a demotion between steps makes a
        # new, not lean, Step: the cached one would refuse the demoted request's rows)
        lean = self.cache.residency.lean_step()
        key = (_layout(req), _layout(seq_lens), None if num_real is None else _layout(num_real),
               s.cuda_stream, lean)
        if self._step is None or self._step[0] != key:
            st = self.cache.begin_step(
                _view(req), _view(seq_lens), None if num_real is None else _view(num_real),
                stream=s, prefetcher=self.prefetcher)
            self._step = (key, st)
        else:  # a cache call on another stream since (write_host, admit, a move) is followed,
            # as begin_step would (rule 1; no event while the stream is the last call's)
            self.cache.order(self._step[1].stream)
        return self._step[1]

    def forget_step(self) -> None:
        """Make the next operator call begin a new :class:`~hisparse_cupy.Step` (``finish``
        does, while a promotion is in flight: its switch happens at a step's beginning)."""
        self._step = None

    def anchor_top_k(self, layer: int, top_k: Tensor, stream):
        """With a prefetcher: a full layer's top-k copied into the TorchCache's own buffer. Its
        shared layers and the prediction stager read it after the operator returned, when torch
        may already have reused the tensor's memory. A shared layer's is not read (its full
        layer's is used)."""
        pat = self.prefetcher.pattern
        j = self._full_rank.get(pat.local_index(layer))
        if j is None:  # a shared layer
            return _view(top_k)
        n = top_k.numel()
        buf = self._anchor[j % 2]  # the stager of full layer j - 1 reads the other one until
        # full layer j's swap joins it, after this copy
        if n > buf.size or top_k.dtype != torch.int32 or not top_k.is_cuda:
            return _view(top_k)  # no swap takes it: the swap's checks name what is wrong
        own = buf[:n].reshape(tuple(top_k.shape))
        with stream:
            own[...] = _view(top_k)
        return own

    def check_rows(self, rows: Tensor) -> None:
        """Raise if the operator was handed a copy of the cache's device rows (a compiler that
        did not re-inplace the model's write into them)."""
        own = self.device_rows
        if rows.data_ptr() != own.data_ptr() or rows.shape != own.shape:
            raise RuntimeError(
                f"a hisparse operator got a copy of TorchCache.device_rows (data pointer "
                f"{rows.data_ptr():#x}, the cache's {own.data_ptr():#x}): a write into the rows "
                f"earlier in the graph went to a copy, not to the cache's rows. Pass "
                f"TorchCache.device_rows itself (the TorchCache methods do) and write into it in "
                f"place")


def _layout(t: Tensor) -> tuple:
    """What the Step's validation of ``t`` depends on."""
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def _cache(cache_id: int) -> TorchCache:
    tc = _caches.get(cache_id)
    if tc is None:
        raise ValueError(f"no live TorchCache with id {cache_id} (keep the TorchCache alive "
                         f"while compiled code calls its operators)")
    return tc


# ------------------------------------------------------------------ the operators
@torch.library.custom_op("hisparse::swap", mutates_args=(), device_types="cuda")
def _swap(cache: int, layer: int, top_k: Tensor, req: Tensor, seq_lens: Tensor,
          num_real: Optional[Tensor], rows: Tensor) -> Tensor:  # noqa: UP045
    tc = _cache(cache)
    tc.check_rows(rows)
    step = tc.step(req, seq_lens, num_real)
    if tc.prefetcher is None:
        out = torch.empty(top_k.shape, dtype=torch.int32, device=top_k.device)
        step.swap(layer, _view(top_k), out=_view(out))
        return out
    res = step.swap(layer, tc.anchor_top_k(layer, top_k, step.stream))
    if res.shape != tuple(top_k.shape):
        raise ValueError(f"layer {layer} is a shared layer: it returns its full layer's page "
                         f"table, shape {res.shape}; pass a top_k of that shape (its full "
                         f"layer's), got {tuple(top_k.shape)}")
    return _copy_out(res, top_k.device, step.stream)


@_swap.register_fake
def _(cache, layer, top_k, req, seq_lens, num_real, rows):
    return torch.empty(top_k.shape, dtype=torch.int32, device=top_k.device)


@torch.library.custom_op("hisparse::newest_rows", mutates_args=(), device_types="cuda")
def _newest_rows(cache: int, req: Tensor, seq_lens: Tensor,
                 num_real: Optional[Tensor]) -> Tensor:  # noqa: UP045
    step = _cache(cache).step(req, seq_lens, num_real)
    return _copy_out(step.newest_rows(), req.device, step.stream)


@_newest_rows.register_fake
def _(cache, req, seq_lens, num_real):
    return torch.empty(req.shape, dtype=torch.int32, device=req.device)


@torch.library.custom_op("hisparse::backup_newest", mutates_args=(), device_types="cuda")
def _backup_newest(cache: int, req: Tensor, seq_lens: Tensor, num_real: Optional[Tensor],  # noqa: UP045
                   write_host: bool, rows: Tensor) -> Tensor:
    tc = _cache(cache)
    tc.check_rows(rows)
    step = tc.step(req, seq_lens, num_real)
    return _copy_out(step.backup_newest(write_host=write_host), req.device, step.stream)


@_backup_newest.register_fake
def _(cache, req, seq_lens, num_real, write_host, rows):
    return torch.empty(req.shape, dtype=torch.int32, device=req.device)


@torch.library.custom_op("hisparse::before_indexer", mutates_args=())  # no tensor
def _before_indexer(cache: int, layer: int) -> None:
    tc = _cache(cache)
    if tc.prefetcher is None:
        tc.cache.layer_index(layer)
    else:
        tc.prefetcher.before_indexer(layer, torch.cuda.current_stream())


@_before_indexer.register_fake
def _(cache, layer):
    return None


@torch.library.custom_op("hisparse::finish", mutates_args=())  # no tensor: every device
def _finish(cache: int) -> None:
    tc = _cache(cache)
    if tc.prefetcher is not None:
        tc.prefetcher.finish(torch.cuda.current_stream())
    if tc.cache.residency.promoting:
        tc.forget_step()  # the next step's begin_step switches the promotions that landed


@_finish.register_fake
def _(cache):
    return None


def _register_ordered(*ops) -> None:
    """Register ``ops`` as ordered side effects (the module docstring says why). The function
    moved between torch releases; every release that has custom_op has one of them."""
    from torch._higher_order_ops import effects

    register = getattr(torch.library, "_register_effectful_op", None) or \
        effects._register_effectful_op
    for op in ops:
        register(op._opoverload, effects._EffectType.ORDERED)


_register_ordered(_swap, _newest_rows, _backup_newest, _before_indexer, _finish)


def _copy_out(res: cupy.ndarray, device, stream) -> Tensor:
    """The package's buffer ``res`` (rewritten by later calls) copied, on ``stream``, into a
    fresh torch tensor: an operator's result never aliases state."""
    out = torch.empty(res.shape, dtype=torch.int32, device=device)
    with stream:
        _view(out)[...] = res
    return out


_DTYPES = {torch.int32: cupy.int32, torch.int64: cupy.int64, torch.uint8: cupy.uint8}


def _view(t: Tensor):
    """A CuPy array over the memory of the CUDA tensor ``t`` (same shape and strides), without
    DLPack: an operator runs on torch's current stream, which every tensor it gets is ordered
    on, so the import's stream handshake (tens of microseconds) has nothing to do. Another dtype
    or device: ``t`` itself, which the step's checks then name."""
    dt = _DTYPES.get(t.dtype)
    if dt is None or not t.is_cuda or t.numel() == 0:
        return t
    item = t.element_size()
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), extent * item, t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dt, cupy.cuda.MemoryPointer(mem, 0),
                        strides=tuple(st * item for st in t.stride()))
