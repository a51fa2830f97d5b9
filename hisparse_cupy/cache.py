"""HotBufferCache: the stateful layer engines and examples call, and its per-step plan.

It owns, for ``n_layers`` layers and ``max_requests`` request slots:

- the host pool (:class:`HostKVPool`) and its map (:class:`~hisparse_cupy._cache_rows.CacheRows`):
  request slot ``r``'s token ``p`` lives in host row ``r * max_len + p`` of every layer (the
  slot layout), or, with ``page_tokens=P``, in pages taken as the request grows and shared
  with requests forked from it (:meth:`HotBufferCache.admit`'s ``prefix``);
- the device rows: uint8 ``[n_layers, R * (H + P + C), row_bytes]``; request slot ``r`` owns
  rows ``r * (H + P + C) + [0, H + P + C)`` of every layer: its H + P slots, then C scratch
  rows (C = 0 without multi-step state);
- per layer (:attr:`HotBufferCache.tables`, a :class:`~hisparse_cupy._tables.LayerTables`):
  the slots' tokens and device rows, the LRU order, the token -> hot slot table, and with
  ``max_steps >= 2`` the multi-step state (:class:`MultiStepState` views);
- ``host_locs`` int64 ``[R, max_len]`` (the map's): -1 until a token's host row is written;
  the counters.

Per decode step :meth:`HotBufferCache.begin_step` returns a :class:`~hisparse_cupy.Step`
(``hisparse_cupy/step.py``), which runs every layer's swap. Request lifecycle: :meth:`admit`,
:meth:`grow` and a step per token, :meth:`release`, each queued on a stream without host
synchronization. The calls may go to any streams with nothing between them: each call's work
follows every earlier call's (``hisparse_cupy/_order.py``: the calls' order, page fences, and
the KV arrays a call still reads held).
"""

from __future__ import annotations

import heapq

import cupy
import numpy as np

from . import _abi, _checks
from ._cache_rows import CacheRows, host_pool
from ._checks import ArrayLike, StreamLike
from ._device import require_gpu
from ._kernels.launch import as_stream
from ._kernels.multistep import MultiStepConfig, MultiStepState, MultiStepWorkspace
from ._kernels.plan import MissPlan
from ._kernels.rows import copy_pool_rows, load_rows
from ._kernels.swap import SwapState, check_sizes
from ._order import StreamOrder
from ._tables import LayerTables, rows_needed
from .counters import LayerCounters
from .host import HostKVPool, HostPages
from .residency import Residency
from .step import Step, StepParts

__all__ = ["HotBufferCache", "SlotsExhausted"]


# moved in 0.2 (residency composed: docs/design.md section 10)
_MOVED = {**{m: f"call cache.residency.{m}() (the same arguments, no token count)"
             for m in ("demote", "promote", "switch_promoted", "make_room", "promote_ready",
                       "lean_step")},
          "arena": "read cache.residency (its budget: cache.residency.budget)"}


class SlotsExhausted(RuntimeError):
    """Every one of the cache's ``max_requests`` request slots is admitted: :meth:`admit` takes
    nothing until one is released. Not a :class:`~hisparse_cupy.host._pages.PoolExhausted`
    (a paged pool without the host pages): an engine can catch either alone."""

    def __init__(self, max_requests: int):
        super().__init__(f"all {max_requests} request slots are in use (release one first)")
        self.max_requests = max_requests


class HotBufferCache:
    """Per-layer hot buffers for ``max_requests`` request slots over a pinned host pool.

    Parameters
    ----------
    n_layers, max_requests, max_len : int
        Layers, request slots, and the longest sequence a request may reach.
    row_bytes : int
        Bytes of one token's KV row in one layer (multiple of 16), e.g. 656.
    hot_size : int
        H, hot slots per request (default 4096).
    top_k : int
        K, entries per top-k row (default 2048); K <= H.
    extra_page : int
        P, slots after the hot slots; slot H holds the newest token (default 64).
    max_batch : int
        Largest batch a step takes (default ``max_requests``).
    max_steps : int
        1 (default): single-step swaps only. 2-4: also multi-step (MTP) swaps of up to that many
        draft steps, with their state for every layer.
    scratch : int, optional
        Scratch rows per request for multi-step admission (default
        :func:`hisparse_cupy._kernels.multistep.default_scratch`).
    page_tokens, pool_rows : int, optional
        Page the host pool: pages of ``page_tokens`` tokens taken as requests are admitted
        and grow (:meth:`grow`), shared by a ``prefix``, given back at :meth:`release`
        (:attr:`pages`); the pool the cache allocates holds ``pool_rows`` rows per layer
        (whole pages; default every slot at ``max_len`` tokens,
        ``max_requests * ceil(max_len / page_tokens)`` pages; :meth:`host_bytes_needed`).
        Default: the slot layout, request slot ``r``'s token ``p`` in row ``r * max_len + p``.
    pool : HostKVPool, optional
        The host pool to use (one the engine made, a shared one :meth:`HostKVPool.attach`
        mapped, or one registered in place with :meth:`HostKVPool.from_buffer`):
        ``n_layers`` layers of rows of ``row_bytes``, at least ``max_requests * max_len`` of
        them in the slot layout, a page's when paged (its ``n_rows // page_tokens`` pages).
        The cache does not close a pool it was given. Default: the cache allocates one.
    device_rows : uint8 ``[n_layers, D, row_bytes]`` device array, optional
        The device rows to use, allocated by the engine: a CuPy array or any DLPack exporter
        (a PyTorch tensor; imported without a copy, the engine keeps it alive; not a JAX array:
        the cache writes into it). C-contiguous, on the current device, ``D >= max_requests *
        rows_per_request`` (the first such rows of each layer are used: :meth:`rows_needed`),
        overwritten as requests are admitted. Default: the cache allocates them.
    token_table : bool
        Keep a token -> hot slot table (``SwapState.token_slot``, int16 ``[n_layers,
        max_requests, max_len]``), so the single-step resolve looks each selected token up
        instead of hashing the top-k (faster at every batch size when few tokens miss:
        benchmarks/NOTES.md). Default True; False gives the hash resolve; ``max_steps >= 2``
        needs the table.
    counters : bool
        Count every layer's swaps on the device (:attr:`counters`,
        :class:`~hisparse_cupy.counters.LayerCounters`, read without a synchronize). Default
        True; False: None, the kernels count nothing.
    device_budget : int, optional
        Device rows per layer for a budget (``docs/design.md`` section 10): requests are
        resident (every token in pages of ``device_page`` rows) while their pages fit, else
        sparse (a block of ``H + P + C`` rows); size it with :meth:`DeviceBudget.rows_needed
        <hisparse_cupy.residency.DeviceBudget.rows_needed>`. Default None: every request
        sparse in its own ``H + P + C`` rows.
    device_page : int
        Rows per device page under a budget (default 64).

    Attributes
    ----------
    residency : :class:`~hisparse_cupy.residency.Residency`
        The requests' residency under ``device_budget`` (rows per layer, in pages of
        ``device_page``): ``demote``, ``promote``, ``make_room``, ``promote_ready``,
        ``switch_promoted``, ``lean_step``, and ``budget``, the scheduler's view. Without a
        budget every request is sparse and every move refuses.
    """

    def __init__(self, *, n_layers: int, max_requests: int, max_len: int, row_bytes: int,
                 hot_size: int = 4096, top_k: int = 2048, extra_page: int = 64,
                 max_batch: int | None = None, max_steps: int = 1, scratch: int | None = None,
                 page_tokens: int | None = None, pool_rows: int | None = None,
                 pool: HostKVPool | None = None, device_rows: ArrayLike | None = None,
                 token_table: bool = True, counters: bool = True,
                 device_budget: int | None = None, device_page: int = 64):
        self.n_layers = L = _checks.integer("n_layers", n_layers, 1)
        self.max_requests = R = _checks.integer("max_requests", max_requests, 1)
        self.max_len = _checks.integer("max_len", max_len, 1)
        self.hot_size = H = _checks.integer("hot_size", hot_size, 1, _abi.MAX_HOT)
        self.top_k = K = _checks.integer("top_k", top_k, 1, H)
        self.extra_page = P = _checks.integer("extra_page", extra_page, 1)
        self.max_batch = _checks.integer("max_batch", R if max_batch is None else max_batch, 1)
        self.max_steps = S = _checks.integer("max_steps", max_steps, 1, _abi.MS_MAX_STEPS)
        require_gpu()  # the sizes are checked against the device; everything below is CUDA
        check_sizes(K, H)
        if S >= 2 and not token_table:
            raise ValueError("max_steps >= 2 needs token_table=True: the multi-step swap looks "
                             "tokens up in the token -> slot table")
        self.ms_config = None
        C = 0
        if S >= 2:
            self.ms_config = MultiStepConfig(R, H, P, K, max_steps=S, scratch=scratch,
                                             max_batch=self.max_batch)
            C = self.ms_config.scratch
        elif scratch is not None:
            raise ValueError("scratch applies only with max_steps >= 2")
        self.slots = W = H + P
        self.scratch = C
        self.rows_per_request = W + C
        row_bytes = _checks.row_bytes("row_bytes", row_bytes)
        self.residency = Residency.of(device_budget, device_page, max_requests=R,
                                      max_len=self.max_len, block_rows=W + C)
        D = R * (W + C) if self.residency.n_rows is None else self.residency.n_rows
        # the engine's device rows are checked before a host pool is pinned
        if device_rows is None:
            self.device = None
        else:
            dev = _checks.array("device_rows", device_rows, np.uint8,
                                shape=(L, None, row_bytes))
            if dev.shape[1] < D:
                raise ValueError(f"device_rows holds {dev.shape[1]} rows per layer; the cache "
                                 f"needs at least max_requests * rows_per_request = {R} * "
                                 f"{W + C} = {D}")
            self.device = dev
        self.pool, self._own_pool = host_pool(L, R, self.max_len, row_bytes, page_tokens,
                                              pool_rows, pool)
        self.host = CacheRows(R, self.max_len, self.pool, page_tokens)
        self.row_bytes = self.pool.row_bytes
        if self.device is None:
            self.device = cupy.empty((L, D, self.row_bytes), cupy.uint8)
        self.tables = t = LayerTables(n_layers=L, max_requests=R, hot_size=H, extra_page=P,
                                      scratch=C, max_len=self.max_len, token_table=token_table,
                                      multistep=S >= 2, placed=self.residency.enabled)
        self.host_locs = self.host.locs
        self.residency.bind(tables=t, device=self.device, pool=self.pool, host=self.host,
                            order=self.order)
        self.plan = MissPlan(self.max_batch, K * max(1, S))
        self.status = cupy.empty((self.max_batch, _abi.N_STATUS), cupy.int32)
        self._ms: list[MultiStepState] = []
        if S >= 2:
            cfg = self.ms_config
            ws = MultiStepWorkspace(self.max_batch, cfg.max_tokens)  # the layers' calls share it
            for layer in range(L):
                self._ms.append(MultiStepState(
                    cfg, self.host_locs, t.slot_tokens[layer], t.slot_locs[layer],
                    t.scratch_locs[layer], n_device_rows=D, workspace=ws,
                    validate=False, token_slot=t.token_slot[layer], ref=t.ms_ref[layer],
                    clock=t.ms_clock[layer]))
                if self.residency.enabled:
                    self._ms[-1].set_residency(**self.residency.fields())
        self._states = [self._swap_state(layer) for layer in range(L)]
        self.counters = LayerCounters(L, self.row_bytes) if counters else None
        self.step_parts = StepParts.build(self)
        self._free = list(range(R))  # a heap: admissions take the lowest free slot
        self._len: dict[int, int] = {}
        self._order = StreamOrder()
        # The tables were filled on CuPy's current stream; later calls take any stream (often a
        # non-blocking one, not ordered after these fills): construction ends when they landed.
        cupy.cuda.get_current_stream().synchronize()

    host_bytes_needed = staticmethod(HostPages.host_bytes_needed)

    rows_needed = staticmethod(rows_needed)

    def _swap_state(self, layer: int) -> SwapState:
        t = self.tables
        return SwapState(self.host_locs, t.slot_tokens[layer], t.slot_locs[layer], t.lru[layer],
                         token_slot=None if t.token_slot is None else t.token_slot[layer],
                         **self.residency.fields())

    @property
    def token_table(self) -> bool:
        """Whether the cache keeps a token -> hot slot table (``tables.token_slot``)."""
        return self.tables.token_slot is not None

    # ----------------------------------------------------------------- requests
    @property
    def active(self) -> dict[int, int]:
        """Admitted request slots and the length each was admitted with."""
        return dict(self._len)

    def admit(self, n_tokens: int, kv: np.ndarray | None = None,
              warm_tokens: ArrayLike | None = None, *, prefix: tuple[int, int] | None = None,
              pages: ArrayLike | None = None, resident: bool | None = None,
              stream: StreamLike | None = None) -> int:
        """Admit a request of ``n_tokens`` tokens whose KV is (or is now) in the host pool.

        Parameters
        ----------
        n_tokens : int
            Current length, 1 .. max_len.
        kv : uint8 ``[n_layers, n, row_bytes]``, optional
            Prefill KV of the tokens not shared (``n = n_tokens`` less the ``prefix`` or
            ``pages`` tokens), written first (as :meth:`write_host` does: a GPU array with no
            host synchronization). Without it the pool must hold the KV: slot ``r``'s rows
            ``r * max_len + [0, n_tokens)`` in the slot layout (written there directly),
            ``prefix`` or ``pages`` covering every token when paged. Admission loads the rows
            it places on the device (the positional layout's, the warm tokens', the newest).
        warm_tokens : sequence of int, optional
            For ``n_tokens > H``: up to H distinct tokens in ``[0, n_tokens - 1)`` to load into
            the hot buffer now (default: start cold). A request of ``n_tokens <= H`` is loaded
            whole in positional layout and refuses ``warm_tokens`` (``ValueError``).
        prefix : (parent, p), paged pools only
            The first ``p`` tokens are admitted request slot ``parent``'s: whole pages
            shared (reference-counted; the parent may leave first), a partial last page copied
            on ``stream``. Neither request writes a shared page again, so ``parent`` must have
            written all ``p`` (its admission's, :meth:`write_host`'s, its steps' backups
            queued on ``stream`` before), whatever pages it was grown to; else ``ValueError``
            naming the first token not written. A prefix past the tokens the host wrote reads
            the parent's rows on the device: the admission then synchronizes ``stream``.
        pages : sequence of int, paged pools only
            Pages the engine holds and wrote (:attr:`pages` ``.take(k)``, its prefix tree's)
            for the first ``len(pages) * page_tokens`` tokens; not with ``prefix``.
        stream : any stream kind (default: CuPy's current stream). The admission is queued
            there after every earlier call's work, and every later call's work follows it
            (``_order.py``). A ``kv`` on the GPU must be complete in the order of ``stream``;
            the caller may drop it as soon as the call returns (the cache holds it until its
            copies ran).

        Returns the request slot (the lowest free one), to use in ``req_indices``. Raises
        (nothing taken) :class:`SlotsExhausted` (every request slot admitted),
        :class:`~hisparse_cupy.host._pages.PoolExhausted` (a paged pool without the pages),
        or ``ValueError`` / ``TypeError`` / ``KeyError`` naming it.
        """
        n = _checks.integer("n_tokens", n_tokens, 1, self.max_len)
        if not self._free:
            raise SlotsExhausted(self.max_requests)
        H = self.hot_size
        warm = _checks.warm_tokens(warm_tokens, n, H)
        s = self.order(stream)
        if kv is not None:
            kv, on_host = _checks.kv_rows("kv", kv, self.n_layers, self.row_bytes, s)
        shared = self.host.shared_tokens(n, prefix, pages)
        need = n - shared
        if (kv is None and need and self.host.paged) or (kv is not None and kv.shape[1] != need):
            raise ValueError(f"kv must hold the {need} rows being admitted (tokens {shared}.."
                             f"{n}): uint8 [{self.n_layers}, {need}, {self.row_bytes}], got "
                             f"{None if kv is None else tuple(kv.shape)}")
        rid = heapq.heappop(self._free)
        res = self.residency
        try:  # the device budget first: it refuses taking nothing
            block = res.on_admit(rid, n, resident, s)
            copies = self.host.admit(rid, n, prefix, pages, s)
        except BaseException:
            res.on_release(rid, s)
            heapq.heappush(self._free, rid)
            raise
        try:
            copy_pool_rows(self.pool, copies, s)
            rows = self.host.rows(rid, 0, n)
            if kv is not None:
                self.host.store(rows[shared:], kv, on_host, s)
            t = self.tables
            t.place(rid, block, s)  # (a budget's block; nothing without one)
            t.reset(rid, s)
            with s:
                self.host_locs[rid, :n] = cupy.asarray(rows)
                self.host_locs[rid, n:] = -1
            if res.is_resident(rid):  # every row in its pages
                t.init_multistep(rid, s)
                res.on_load(rid, n, rows, None if kv is None or on_host else kv, shared, s)
            else:
                slots, tokens = t.fill_admitted(rid, n, warm, s)
                t.init_multistep(rid, s)
                dev = rid * self.rows_per_request + slots if block is None else block[slots]
                load_rows(self.pool, rows[tokens], self.device, dev, s)
        except BaseException:  # the slot back as release() leaves one (tables reset too: a
            res.on_release(rid, s)  # mirror_layer walks every slot's, a freed block's rows)
            self.tables.reset(rid, s)
            self.tables.init_multistep(rid, s)
            with s:
                self.host_locs[rid] = -1
            self.host.release(rid, s)  # (its pages carry the event after what was queued)
            heapq.heappush(self._free, rid)
            raise
        finally:
            if kv is not None and not on_host:  # read by copies queued on s until they ran
                self._order.keep(s, kv)
        self._len[rid] = n
        return rid

    def grow(self, rid: int, n_tokens: int, *, stream: StreamLike | None = None) -> None:
        """Make room in the host pool for request slot ``rid``'s tokens up to ``n_tokens``.

        Call it before the step (or graph replay) whose newest token is ``n_tokens - 1``:
        paged, it takes the pages on the host and writes their table entries on ``stream``
        (when a page is taken), where :meth:`Step.backup_newest` finds the row (a token
        without a page is not backed up; a swap missing it later flags ``nohost``). Raises
        :class:`~hisparse_cupy.host._pages.PoolExhausted`, nothing taken (the engine can
        preempt). A no-op where the rows are there (the slot layout has every row).
        """
        rid = self._admitted(rid)
        n = _checks.integer("n_tokens", n_tokens, 1, self.max_len)
        s = self.order(stream)
        self.residency.on_grow(rid, n, s, check=True)  # before the host takes pages
        self.host.grow(rid, n, s)
        self.residency.on_grow(rid, n, s)

    @property
    def pages(self):
        """The :class:`~hisparse_cupy.host._pages.HostPages` of a paged pool (free pages,
        engine-held pages: :meth:`~hisparse_cupy.host._pages.HostPages.take`), else None."""
        return self.host.pages

    def order(self, stream: StreamLike | None = None) -> cupy.cuda.Stream:
        """Make ``stream`` wait for the work of every earlier call of the cache (no host
        synchronization; ``_order.py``, rule 1) and return it as a CuPy stream. Every call
        does this itself; an engine calls it before work of its own that reads the cache's
        state on a stream no call used since (a graph replay with no cache call before it on
        that stream, a kernel reading ``device_rows``)."""
        s = as_stream(stream)
        self._order.enter(s)
        return s

    def _admitted(self, rid) -> int:
        rid = _checks.integer("rid", rid, 0, self.max_requests - 1)
        if rid not in self._len:
            raise ValueError(f"request slot {rid} is not admitted")
        return rid

    def write_host(self, rid: int, start: int, kv: ArrayLike, *,
                   stream: StreamLike | None = None) -> None:
        """Write KV rows of tokens ``start .. start + n`` of request ``rid`` into the host pool.

        Parameters
        ----------
        kv : uint8 ``[n_layers, n, row_bytes]``
            A GPU array (any DLPack exporter), rows contiguous: one device -> host copy on
            ``stream``, then the host rows are recorded there; nothing synchronizes. A host
            array: the CPU writes the rows after the work queued on ``stream`` and earlier
            releases (synchronized).
        stream : any stream kind (default: CuPy's current stream); as :meth:`admit`'s (a GPU
            ``kv`` may be dropped when the call returns).

        Tokens below ``pages.own_from(rid)`` lie in shared pages and are refused; paged, or
        under a device budget, the tokens must have been grown to (:meth:`grow`). Rewriting a
        token's KV (an MTP draft the verify step rejected, its position given a new token) is
        what this call is for: the hot slots that held those tokens are emptied in every layer,
        so the next swap loads the new rows.
        Slot p holding token p (below H) keeps it: the positional layout reads token p in slot
        p's row, so write the new KV there too, as for any token a request below H holds.
        """
        rid = self._admitted(rid)
        start = _checks.integer("start", start, 0)
        s = self.order(stream)
        kv, on_host = _checks.kv_rows("kv", kv, self.n_layers, self.row_bytes, s)
        n = kv.shape[1]
        if start + n > self.max_len:
            raise ValueError(f"tokens {start}..{start + n} exceed max_len {self.max_len}")
        own = self.host.own_from_host(rid)
        if start < own:
            raise ValueError(f"start {start}: request slot {rid}'s tokens below {own} lie in "
                             f"host pages it shares; they are never written")
        if self.host.paged and start + n > self.pages.tokens(rid):
            raise ValueError(f"tokens {start}..{start + n}: request slot {rid} has pages for "
                             f"{self.pages.tokens(rid)} tokens (grow() it first)")
        self.residency.check_write(rid, start, start + n)
        if n == 0:
            return
        rows = self.host.rows(rid, start, start + n)
        try:
            self.host.store(rows, kv, on_host, s)
            with s:
                self.host_locs[rid, start: start + n] = cupy.asarray(rows)
            self.tables.drop_tokens(rid, start, start + n, s)  # hot copies of them are stale
            self.residency.on_write(rid, start, rows, s)  # a resident request's pages too
        finally:  # the caller may drop kv now, even if a step above raised: held until its
            if not on_host:  # copy (queued first) ran
                self._order.keep(s, kv)
        self.host.wrote(rid, start, start + n)

    def release(self, rid: int, *, stream: StreamLike | None = None) -> None:
        """Free request slot ``rid``: its tables and host rows are reset (token -> slot entries,
        never trusted without the slot table, stay); a paged pool's pages no other request
        holds are free again."""
        rid = self._admitted(rid)
        s = self.order(stream)
        self.residency.on_release(rid, s)
        self.tables.reset(rid, s)
        self.tables.init_multistep(rid, s)
        with s:
            self.host_locs[rid] = -1
        self.host.release(rid, s)  # its pages carry the event after all this
        del self._len[rid]
        heapq.heappush(self._free, rid)

    # ----------------------------------------------------------------- per layer
    def layer_index(self, layer) -> int:
        """``layer`` checked: an int in ``[0, n_layers)``, else a ``TypeError`` / ``ValueError``
        naming it."""
        if type(layer) is int and 0 <= layer < self.n_layers:
            return layer
        return _checks.integer("layer", layer, 0, self.n_layers - 1)

    def mirror_layer(self, src: int, dst: int, *, rows: bool = True,
                     stream: StreamLike | None = None) -> None:
        """Give layer ``dst`` the state of layer ``src``: every table, and the slot layout.

        ``rows=True`` (default): ``dst``'s device rows are first rearranged into ``src``'s
        layout: the row where ``src`` holds token t gets ``dst``'s bytes of t, from the row
        where ``dst`` held it (the first such slot) or else from its host row (every token a
        layer holds has one, or is held by every layer at the same row: slot H, the
        positional layout). Then every table of :meth:`LayerTables.named` is copied: a page
        table of ``src`` is then valid for ``dst``'s rows. ``rows=False`` copies the tables
        only, for equal device layouts (a Prefetcher's group while prefetch is on; multi-step
        calls make layouts diverge: misses take scratch rows in the gather threads' order).
        Queued on ``stream`` (no host synchronization; one layer's rows of scratch memory).
        """
        src, dst = self.layer_index(src), self.layer_index(dst)
        self.tables.mirror(src, dst, rows=self.device[dst] if rows else None,
                           host_locs=self.host_locs, pool=self.pool, stream=self.order(stream))

    def state(self, layer: int) -> SwapState:
        """The single-step swap tables of ``layer`` (views)."""
        return self._states[self.layer_index(layer)]

    def multistep_state(self, layer: int) -> MultiStepState:
        """The multi-step state of ``layer`` (views; needs ``max_steps >= 2``)."""
        layer = self.layer_index(layer)
        if not self._ms:
            raise ValueError("this cache was built with max_steps=1: no multi-step state")
        return self._ms[layer]

    def device_rows(self, layer: int) -> cupy.ndarray:
        """uint8 ``[D, row_bytes]``: the rows that swap outputs index, for ``layer``."""
        return self.device[self.layer_index(layer)]

    # ----------------------------------------------------------------- per step
    def begin_step(self, req_indices: ArrayLike, seq_lens: ArrayLike,
                   num_real: ArrayLike | None = None, *, stream: StreamLike | None = None,
                   pdl: bool | None = None, prefetcher=None, lean: bool | None = None) -> Step:
        """Validate a decode step's batch once; the returned :class:`Step` runs every layer.

        Parameters
        ----------
        req_indices : int32 or int64 ``[B]`` device array, batch row -> request slot,
            ``1 <= B <= max_batch`` (unique among real rows).
        seq_lens : int32 or int64 ``[B]`` (each request's length including the newest token) or
            ``[B, S]`` (per draft step; single-step calls use column 0).
        num_real : int32 device scalar, optional: rows ``>= num_real`` are graph padding.
        stream : CuPy, PyTorch or ``__cuda_stream__`` stream, or an int handle (default: CuPy's
            current stream); every launch of the step goes there.
        pdl : Programmatic Dependent Launch for the dependent kernels (default: where supported).
        prefetcher : :class:`hisparse_cupy.Prefetcher` driving this cache, optional: then
            :meth:`Step.swap` runs each layer through it (IndexCache shared-layer overlap).
        lean : run the step lean (``residency.lean_step``: by default when every admitted
            request is resident; ``Step.lean`` says which ran).

        The arrays are used in place (no copy): do not change them while the step's work is
        queued. The step holds no device memory of its own; create one per decode step.
        """
        s = self.order(stream)
        self.residency.on_step(s)  # (promotions that landed switched, outside a capture)
        return Step(self, req_indices, seq_lens, num_real, stream=s, pdl=pdl,
                    prefetcher=prefetcher, lean=self.residency.lean_step(lean))

    def __getattr__(self, name: str):
        """Names that moved in 0.2 are named with where they went (only reached when an
        attribute is missing)."""
        if name in _MOVED:
            raise AttributeError(f"HotBufferCache.{name} moved in 0.2: {_MOVED[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def close(self) -> None:
        """Free the host pool the cache made (after the device finished with it)."""
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> HotBufferCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
