"""HotBufferCache: the stateful layer engines and examples call, and its per-step plan.

It owns, for ``n_layers`` layers and ``max_requests`` request slots:

- the host pool (:class:`HostKVPool`): request slot ``r``'s token ``p`` lives in host row
  ``r * max_len + p`` of every layer (one request's rows are close together in host memory);
- the device rows: uint8 ``[n_layers, R * (H + P + C), row_bytes]``; request slot ``r`` owns
  rows ``r * (H + P + C) + [0, H + P + C)`` of every layer: its H + P slots, then C scratch
  rows (C = 0 without multi-step state);
- per layer: ``slot_tokens`` and ``slot_locs`` int32 ``[R, H + P]`` and ``lru`` int16
  ``[R, H]``; the token -> hot slot table ``token_slot`` int16 ``[R, max_len]`` (both swaps
  read and write it); with ``max_steps >= 2`` also the multi-step state (``scratch_locs``,
  reference epochs, clock: :class:`MultiStepState` views);
- ``host_locs`` int64 ``[R, max_len]``: -1 until a token's host row has been written.

One plan per decode step (FlashInfer's plan/run): :meth:`HotBufferCache.begin_step` validates the
batch once and returns a :class:`Step`; ``step.swap(layer, top_k)`` then only checks the top-k
and launches. A ``[B, K]`` top-k runs the single-step swap, a ``[B, S, K]`` one the multi-step
swap, over the same hot buffers: both record their admissions in the one token -> slot table, so
the two alternate freely (each policy keeps its own recency record: the LRU order for the
single-step swap, reference epochs for the multi-step CLOCK; an admission by one is seen by the
other as a resident token with no recent use). Request lifecycle: :meth:`admit`, then per step
``step.newest_rows()`` (the model writes the new token's KV there), ``step.backup_newest()``
once, ``step.swap(layer, ...)`` per layer; :meth:`release` at the end. Every call is queued on
the step's stream without host synchronization, so a decode step can be captured in a graph.
"""

from __future__ import annotations

import contextlib

import cupy
import numpy as np

from . import _abi, _build, _checks
from ._device import require_gpu
from ._launch import Params, as_stream, launch, launcher, ptr, resolve_pdl
from .host_pool import HostKVPool
from .multistep import (
    MultiStepConfig,
    MultiStepState,
    MultiStepWorkspace,
    commit_smem_bytes,
    copy_blocks,
    init_states,
)
from .plan import MissPlan, copy_params, default_copy_grid, launch_copy
from .swap import MAX_HOT, SwapState, check_sizes, hash_size, resolve_launch


def _words(dt: np.dtype, size: int) -> dict[str, int]:
    """Field -> index in a ``size``-byte-word view of one struct (fields of that width)."""
    return {n: dt.fields[n][1] // size for n in dt.names if dt[n].itemsize == size}


# per-call fields are written through integer views of a step's struct arrays
_RES8, _RES4 = _words(_abi.SWAP_RESOLVE, 8), _words(_abi.SWAP_RESOLVE, 4)
_MS8, _MS4 = _words(_abi.MULTISTEP, 8), _words(_abi.MULTISTEP, 4)


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
        :func:`hisparse_cupy.multistep.default_scratch`).
    pool : HostKVPool, optional
        The host pool to use (one the engine made, a shared one :meth:`HostKVPool.attach`
        mapped, or one registered in place with :meth:`HostKVPool.from_buffer`):
        ``n_layers`` layers of at least ``max_requests * max_len`` rows of ``row_bytes``.
        Request slot ``r``'s token ``p`` is its row ``r * max_len + p``. The cache does not
        close a pool it was given. Default: the cache allocates one.
    device_rows : uint8 ``[n_layers, D, row_bytes]`` device array, optional
        The device rows to use, allocated by the engine: a CuPy array or any DLPack exporter
        (a PyTorch tensor; imported without a copy, the engine keeps it alive; not a JAX array:
        the cache writes into it).
        C-contiguous, on the current device, ``D >= max_requests * rows_per_request`` (the
        cache uses the first ``max_requests * rows_per_request`` rows of each layer; see
        :meth:`rows_needed`). Its contents are overwritten as requests are admitted. Default:
        the cache allocates them.
    token_table : bool
        Keep a token -> hot slot table per layer and request (``SwapState.token_slot``,
        int16 ``[n_layers, max_requests, max_len]``: 2 bytes per token of every layer), so
        the single-step resolve looks each selected token up instead of hashing the top-k and
        probing it with every hot slot (one block per batch row; measured faster at every
        batch size when no or few tokens miss: benchmarks/NOTES.md). Default True; False gives
        the hash resolve (a cluster of blocks per row at small batch); multi-step state
        (``max_steps >= 2``) needs the table (its lookups use it).
    """

    def __init__(self, *, n_layers: int, max_requests: int, max_len: int, row_bytes: int,
                 hot_size: int = 4096, top_k: int = 2048, extra_page: int = 64,
                 max_batch: int | None = None, max_steps: int = 1, scratch: int | None = None,
                 pool: HostKVPool | None = None, device_rows=None, token_table: bool = True):
        self.n_layers = L = _checks.integer("n_layers", n_layers, 1)
        self.max_requests = R = _checks.integer("max_requests", max_requests, 1)
        self.max_len = _checks.integer("max_len", max_len, 1)
        self.hot_size = H = _checks.integer("hot_size", hot_size, 1, MAX_HOT)
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
        D = R * (W + C)
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
        if pool is None:
            self.pool, self._own_pool = HostKVPool(L, R * self.max_len, row_bytes), True
        else:
            if not isinstance(pool, HostKVPool):
                raise TypeError(f"pool must be a HostKVPool, got {type(pool).__name__}")
            if (pool.n_layers, pool.row_bytes) != (L, row_bytes) or \
                    pool.n_rows < R * self.max_len:
                raise ValueError(f"pool holds {pool.n_layers} layers of {pool.n_rows} rows of "
                                 f"{pool.row_bytes} bytes; the cache needs {L} layers of at "
                                 f"least {R * self.max_len} rows of {row_bytes}")
            self.pool, self._own_pool = pool, False
        self.row_bytes = self.pool.row_bytes
        if self.device is None:
            self.device = cupy.empty((L, D, self.row_bytes), cupy.uint8)
        base = (np.arange(R, dtype=np.int64) * (W + C)).reshape(R, 1)
        self._slot_layout = cupy.asarray((base + np.arange(W)).astype(np.int32))
        self.slot_locs = cupy.empty((L, R, W), cupy.int32)
        self.slot_locs[...] = self._slot_layout
        self.slot_tokens = cupy.full((L, R, W), -1, cupy.int32)
        self.lru = cupy.empty((L, R, H), cupy.int16)
        self.lru[...] = cupy.arange(H, dtype=cupy.int16)
        self.host_locs = cupy.full((R, self.max_len), -1, cupy.int64)
        self.token_slot = (cupy.full((L, R, self.max_len), -1, cupy.int16) if token_table
                           else None)
        self.plan = MissPlan(self.max_batch, K * max(1, S))
        self.out = cupy.empty((self.max_batch, K), cupy.int32)
        self.status = cupy.empty((self.max_batch, _abi.N_STATUS), cupy.int32)
        self._newest = cupy.empty(self.max_batch, cupy.int32)
        # one-entry D2H plan per batch row: newest token's device row -> its host row
        self._backup_src = cupy.empty((self.max_batch, 1), cupy.int32)
        self._backup_dst = cupy.empty((self.max_batch, 1), cupy.int64)
        self._backup_count = cupy.zeros(self.max_batch, cupy.int32)
        self._ms: list[MultiStepState] = []
        if S >= 2:
            cfg = self.ms_config
            self._scratch_layout = cupy.asarray((base + W + np.arange(C)).astype(np.int32))
            self.scratch_locs = cupy.empty((L, R, C), cupy.int32)
            self.scratch_locs[...] = self._scratch_layout
            self.ms_ref = cupy.zeros((L, R, H), cupy.uint32)
            self.ms_clock = cupy.zeros((L, R, 2), cupy.uint32)
            self.ms_clock[..., 0] = 1
            self.workspace = MultiStepWorkspace(self.max_batch, cfg.max_tokens)
            self.ms_out = cupy.empty((self.max_batch, S, K), cupy.int32)
            for layer in range(L):
                self._ms.append(MultiStepState(
                    cfg, self.host_locs, self.slot_tokens[layer], self.slot_locs[layer],
                    self.scratch_locs[layer], n_device_rows=D, workspace=self.workspace,
                    validate=False, storage={"token_slot": self.token_slot[layer],
                                             "ref": self.ms_ref[layer],
                                             "clock": self.ms_clock[layer]}))
        self._states = [self._swap_state(layer) for layer in range(L)]
        self._templates()
        self._free = list(range(R - 1, -1, -1))
        self._len: dict[int, int] = {}
        self._released: dict[int, cupy.cuda.Event] = {}
        # The tables above were filled on CuPy's current stream; every later call takes any
        # stream (admit's is often a non-blocking one, which nothing orders after these fills),
        # so construction ends when they have landed.
        cupy.cuda.get_current_stream().synchronize()

    @staticmethod
    def rows_needed(*, max_requests: int, hot_size: int = 4096, top_k: int = 2048,
                    extra_page: int = 64, max_steps: int = 1, scratch: int | None = None) -> int:
        """Device rows per layer a cache of these sizes uses (for ``device_rows=``):
        ``max_requests * (hot_size + extra_page + scratch rows)``."""
        C = 0
        if max_steps >= 2:
            C = MultiStepConfig(max_requests, hot_size, extra_page, top_k, max_steps=max_steps,
                                scratch=scratch).scratch
        return max_requests * (hot_size + extra_page + C)

    def _templates(self) -> None:
        """Per-layer parameter structs with every field that does not depend on the step.

        A :class:`Step` copies them and fills the batch's fields for all layers at once, so a
        swap only writes its top-k's fields (FlashInfer's plan/run split)."""
        L = self.n_layers
        self._tmpl_resolve = np.zeros(L, _abi.SWAP_RESOLVE)
        self._tmpl_copy = np.zeros(L, _abi.PLANNED_COPY)
        self._tmpl_ms = np.zeros(L, _abi.MULTISTEP) if self._ms else None
        n_host = self.pool.n_rows
        for layer, (res, cp) in enumerate(zip(Params.rows(self._tmpl_resolve),
                                              Params.rows(self._tmpl_copy), strict=True)):
            self._states[layer].params(res)
            res.set(status=ptr(self.status), plan_src=ptr(self.plan.src),
                    plan_dst=ptr(self.plan.dst), plan_count=ptr(self.plan.count),
                    plan_stride=self.plan.width, n_host_rows=n_host)
            copy_params(self.plan.src, self.plan.dst, self.plan.count, 0, None,
                        src_base=int(self.pool.device_ptr(layer)), src_layer_bytes=0,
                        n_src_rows=n_host, dst_base=self.device[layer].data.ptr,
                        dst_layer_bytes=0, n_dst_rows=self.device.shape[1],
                        row_bytes=self.row_bytes, params=cp)
        if self._ms:
            for layer, ms in enumerate(Params.rows(self._tmpl_ms)):
                self._ms[layer].params(ms)
                ms.set(status=ptr(self.status), plan_src=ptr(self.plan.src),
                       plan_dst=ptr(self.plan.dst), plan_count=ptr(self.plan.count),
                       plan_stride=self.plan.width, host_base=int(self.pool.device_ptr(layer)),
                       n_host_rows=n_host, dev_base=self.device[layer].data.ptr,
                       row_bytes=self.row_bytes)

    def _swap_state(self, layer: int) -> SwapState:
        return SwapState(self.host_locs, self.slot_tokens[layer], self.slot_locs[layer],
                         self.lru[layer],
                         token_slot=None if self.token_slot is None else self.token_slot[layer])

    @property
    def token_table(self) -> bool:
        """Whether the cache keeps a token -> hot slot table (``token_slot`` is not None)."""
        return self.token_slot is not None

    # ----------------------------------------------------------------- requests
    @property
    def active(self) -> dict[int, int]:
        """Admitted request slots and the length each was admitted with."""
        return dict(self._len)

    def admit(self, n_tokens: int, kv: np.ndarray | None = None,
              warm_tokens=None, *, stream=None) -> int:
        """Admit a request of ``n_tokens`` tokens whose KV is (or is now) in the host pool.

        Parameters
        ----------
        n_tokens : int
            Current length, 1 .. max_len.
        kv : uint8 ``[n_layers, n_tokens, row_bytes]``, optional
            Prefill KV to write into the host pool first. A GPU array (CuPy, or any DLPack
            exporter: PyTorch, JAX) is copied device -> host on ``stream`` without any host
            synchronization; a host array is written by the CPU (see :meth:`write_host`).
            Without it, the request's host rows (slot ``r``'s rows ``r * max_len + [0,
            n_tokens)`` of :attr:`pool`) must already hold the KV, written into the pool
            directly (an engine-owned or shared pool): admission loads the rows it places
            on the device (the positional layout's, the warm tokens', the newest) from them.
            :meth:`write_host` writes rows of an admitted request only.
        warm_tokens : sequence of int, optional
            For ``n_tokens > H``: up to H distinct tokens in ``[0, n_tokens - 1)`` to load into
            the hot buffer now (default: start cold). A request of ``n_tokens <= H`` is loaded
            whole in positional layout and refuses ``warm_tokens`` (``ValueError``).
        stream : any stream kind (default: CuPy's current stream). The admission is queued
            there and ordered after the slot's previous release; calls on other streams (a step
            on another stream) must be ordered after it by the caller.

        Returns
        -------
        int
            The request slot, to use in ``req_indices``.
        """
        n = _checks.integer("n_tokens", n_tokens, 1, self.max_len)
        if not self._free:
            raise RuntimeError(f"all {self.max_requests} request slots are in use")
        H = self.hot_size
        if n <= H and warm_tokens is not None:
            raise ValueError("warm_tokens applies only to requests longer than hot_size")
        warm = np.zeros(0, np.int64)
        if warm_tokens is not None:
            warm = np.asarray(warm_tokens, dtype=np.int64).reshape(-1)
            if warm.size > H:
                raise ValueError(f"warm_tokens holds {warm.size} tokens, more than hot_size {H}")
            if warm.size and (warm.min() < 0 or warm.max() >= n - 1):
                raise ValueError(f"warm_tokens must lie in [0, n_tokens - 1 = {n - 1})")
            if np.unique(warm).size != warm.size:
                raise ValueError("warm_tokens must be distinct")
        if kv is not None and (len(getattr(kv, "shape", ())) != 3 or kv.shape[1] != n):
            raise ValueError(f"kv must hold the n_tokens={n} rows being admitted: uint8 "
                             f"[{self.n_layers}, {n}, {self.row_bytes}], got shape "
                             f"{tuple(getattr(kv, 'shape', ()))}")
        rid = self._free.pop()
        try:
            s = as_stream(stream)
            released = self._released.get(rid)  # the slot's previous request's reset
            if released is not None:
                s.wait_event(released)  # ordered after it on the device, no host sync
            if kv is not None:
                self.write_host(rid, 0, kv, stream=s, _admitting=n)
            with s:
                self.host_locs[rid, :n] = rid * self.max_len + cupy.arange(n, dtype=cupy.int64)
                self.host_locs[rid, n:] = -1
                self._reset_slot(rid)
                if n <= H:  # positional layout: slot p is token p's
                    self.slot_tokens[:, rid, :H] = cupy.arange(H, dtype=cupy.int32)
                    slots = np.arange(n)
                    tokens = np.arange(n)
                else:  # LRU layout: newest token in slot H, warm tokens in slots 0..w-1
                    w = warm.size
                    self.slot_tokens[:, rid, :w] = cupy.asarray(warm, dtype=cupy.int32)
                    self.slot_tokens[:, rid, H] = n - 1
                    order = np.concatenate([np.arange(w, H), np.arange(w)]).astype(np.int16)
                    self.lru[:, rid] = cupy.asarray(order)
                    slots = np.concatenate([np.arange(w), [H]])
                    tokens = np.concatenate([warm, [n - 1]])
                self._init_multistep(rid, s)
                self._load(rid, slots, tokens, s)
        except Exception:
            self._free.append(rid)
            raise
        self._len[rid] = n
        return rid

    def _reset_slot(self, rid: int) -> None:
        """Every per-layer table of request slot ``rid`` back to empty (on the current stream)."""
        self.slot_tokens[:, rid] = -1
        self.lru[:, rid] = cupy.arange(self.hot_size, dtype=cupy.int16)
        self.slot_locs[:, rid] = self._slot_layout[rid]  # undo multi-step rotations
        if self._ms:
            self.scratch_locs[:, rid] = self._scratch_layout[rid]

    def _init_multistep(self, rid: int, stream) -> None:
        if self._ms:
            rows = cupy.full(1, rid, cupy.int32)
            init_states(rows, None, self.slot_tokens, self.token_slot, self.ms_ref,
                        self.ms_clock, hot_size=self.hot_size, stream=stream)

    def _load(self, rid: int, slots: np.ndarray, tokens: np.ndarray, stream) -> None:
        """Copy host rows of ``tokens`` into ``slots`` of request ``rid`` for every layer."""
        n = len(slots)
        src = cupy.asarray((rid * self.max_len + tokens).astype(np.int64).reshape(1, n))
        dst = cupy.ascontiguousarray(self._slot_layout[rid, cupy.asarray(slots)].reshape(1, n))
        cnt = cupy.full(1, n, dtype=cupy.int32)
        p = copy_params(src, dst, cnt, 1, None, src_base=self.pool.device_ptr(0),
                        src_layer_bytes=self.pool.layer_bytes, n_src_rows=self.pool.n_rows,
                        dst_base=self.device.data.ptr, dst_layer_bytes=self.device[0].nbytes,
                        n_dst_rows=self.device.shape[1], row_bytes=self.row_bytes,
                        n_layers=self.n_layers)
        launch_copy(p, grid=default_copy_grid(1, n, self.n_layers), stream=stream)

    def write_host(self, rid: int, start: int, kv, *, stream=None, _admitting: int = 0) -> None:
        """Write KV rows of tokens ``start .. start + n`` of request ``rid`` into the host pool.

        Parameters
        ----------
        kv : uint8 ``[n_layers, n, row_bytes]``
            A GPU array (CuPy, or any DLPack exporter), each row contiguous: copied device ->
            host rows by one planned-copy launch on ``stream`` (all layers), then the tokens'
            host rows are recorded on the same stream; nothing synchronizes. Or a host array
            (NumPy, or anything ``numpy.asarray`` takes): the CPU writes the rows once the work
            queued before on ``stream`` has finished (that stream is synchronized, not the
            device) and, for a slot being admitted, once its previous request's release has
            (a GPU array's copy waits for that release on the device).
        stream : any stream kind (default: CuPy's current stream).
        """
        rid = _checks.integer("rid", rid, 0, self.max_requests - 1)
        if rid not in self._len and not _admitting:
            raise ValueError(f"request slot {rid} is not admitted")
        start = _checks.integer("start", start, 0)
        s = as_stream(stream)
        dev = getattr(kv, "__dlpack_device__", None)
        on_host = isinstance(kv, np.ndarray) or dev is None or dev()[0] in (1, 3)  # CPU, pinned
        if on_host:
            kv = np.asarray(kv)
            if kv.dtype != np.uint8:
                raise TypeError(f"kv must have dtype uint8, got {kv.dtype}")
        else:
            with s:  # a DLPack import orders on the copy's stream
                kv = _checks.array("kv", kv, np.uint8, ndim=3, contiguous=False)
        if kv.ndim != 3 or kv.shape[0] != self.n_layers or kv.shape[2] != self.row_bytes:
            raise ValueError(f"kv must be uint8 [{self.n_layers}, n, {self.row_bytes}], got "
                             f"{kv.dtype} {tuple(kv.shape)}")
        n = kv.shape[1]
        if start + n > self.max_len:
            raise ValueError(f"tokens {start}..{start + n} exceed max_len {self.max_len}")
        if n == 0:
            return
        base = rid * self.max_len + start
        released = self._released.pop(rid, None)  # the slot's previous request's last work
        if on_host:
            if released is not None:
                released.synchronize()
            s.synchronize()
            self.pool.numpy[:, base: base + n] = kv
        else:
            if kv.strides[2] != 1 or (n > 1 and kv.strides[1] != self.row_bytes):
                raise ValueError(f"kv rows must be contiguous (strides {kv.strides})")
            if released is not None:
                s.wait_event(released)  # ordered after it on the device, no host sync
            with s:
                src = cupy.arange(n, dtype=cupy.int32).reshape(1, n)
                dst = (base + cupy.arange(n, dtype=cupy.int64)).reshape(1, n)
                cnt = cupy.full(1, n, dtype=cupy.int32)
            p = copy_params(src, dst, cnt, 1, None, src_base=kv.data.ptr,
                            src_layer_bytes=kv.strides[0], n_src_rows=n,
                            dst_base=self.pool.device_ptr(0), dst_layer_bytes=self.pool.layer_bytes,
                            n_dst_rows=self.pool.n_rows, row_bytes=self.row_bytes,
                            n_layers=self.n_layers)
            launch_copy(p, to_host=True, grid=default_copy_grid(1, n, self.n_layers), stream=s)
        if not _admitting:
            with s:
                self.host_locs[rid, start: start + n] = base + cupy.arange(n, dtype=cupy.int64)

    def release(self, rid: int, *, stream=None) -> None:
        """Free request slot ``rid``: every table of it (slot tables, LRU order, multi-step
        epochs, clock, rotated rows) and its host rows are reset (token -> slot entries are
        never trusted without the slot table, so they stay)."""
        rid = _checks.integer("rid", rid, 0, self.max_requests - 1)
        if rid not in self._len:
            raise ValueError(f"request slot {rid} is not admitted")
        s = as_stream(stream)
        with s:
            self._reset_slot(rid)
            self.host_locs[rid] = -1
            self._init_multistep(rid, s)
            ev = self._released[rid] = cupy.cuda.Event(disable_timing=True)
            ev.record(s)  # a host write into this slot's rows waits for this, not the device
        del self._len[rid]
        self._free.append(rid)

    # ----------------------------------------------------------------- per layer
    def _layer(self, layer) -> int:
        return _checks.integer("layer", layer, 0, self.n_layers - 1)

    def layer_tables(self) -> dict[str, cupy.ndarray]:
        """Every per-layer table, ``name -> [n_layers, ...]`` array: a layer's whole state
        beside its device rows (``host_locs`` is shared by all layers)."""
        t = {"slot_tokens": self.slot_tokens, "slot_locs": self.slot_locs, "lru": self.lru}
        if self.token_slot is not None:
            t["token_slot"] = self.token_slot
        if self._ms:
            t.update(scratch_locs=self.scratch_locs, ms_ref=self.ms_ref, ms_clock=self.ms_clock)
        return t

    def mirror_layer(self, src: int, dst: int, *, rows: bool = True, stream=None) -> None:
        """Give layer ``dst`` the state of layer ``src``: every table, and the slot layout.

        With ``rows=True`` (default) ``dst``'s device rows are first rearranged into ``src``'s
        layout: the row where ``src`` holds token t (any slot) receives ``dst``'s own bytes of
        t, from the row where ``dst`` held it (the first such slot) or, if ``dst`` did not hold
        it, from ``dst``'s host row of t. Then every table of :meth:`layer_tables` is copied
        from ``src``. After it, a page table of ``src`` is valid for ``dst``'s rows.
        ``rows=False`` copies the tables only, for layers whose device layouts are equal (a
        Prefetcher's group while prefetch is on). Layouts diverge when two layers run the same
        multi-step calls: misses take scratch rows in the order the gather's threads claim
        them.

        Every token a layer holds has a host row or is held by every layer at the same row
        (slot H, the positional layout), so nothing is missing from ``dst``. Queued on
        ``stream`` (no host synchronization; one layer's rows of scratch memory).
        """
        src, dst = self._layer(src), self._layer(dst)
        s = as_stream(stream)
        with s:
            if rows and src != dst:
                self._mirror_rows(src, dst, s)
            for t in self.layer_tables().values():
                t[dst][...] = t[src]

    def _mirror_rows(self, src: int, dst: int, s) -> None:
        R, W, n = self.max_requests, self.slots, self.max_len
        span = max(n, W) + 1  # above every token a slot can name (positional ones < H)
        base = cupy.arange(R, dtype=cupy.int64).reshape(R, 1) * span
        tok_s, loc_s = self.slot_tokens[src], self.slot_locs[src]
        tok_d, loc_d = self.slot_tokens[dst], self.slot_locs[dst]
        # where dst holds each (request, token): its keys sorted, src's keys searched
        key_d = cupy.where(tok_d >= 0, base + tok_d, -1).reshape(-1)
        order = cupy.argsort(key_d)  # stable: a token held twice matches its first slot
        key_s = (base + tok_s).reshape(-1)
        at = cupy.minimum(cupy.searchsorted(key_d[order], key_s), key_s.size - 1)
        wanted = tok_s.reshape(-1) >= 0
        held = wanted & (key_d[order[at]] == key_s)
        to = loc_s.reshape(-1)
        dev = self.device[dst]
        dev[to] = dev[cupy.where(held, loc_d.reshape(-1)[order[at]], to)]  # gathered first
        # the tokens dst did not hold: its host rows (the copy skips -1 sources)
        tok = cupy.clip(tok_s, 0, n - 1)
        hl = self.host_locs[cupy.arange(R).reshape(R, 1), tok]
        hl = cupy.where((wanted & ~held).reshape(R, W) & (tok_s < n), hl, -1)
        cnt = cupy.full(R, W, cupy.int32)
        p = copy_params(hl, loc_s, cnt, R, None, src_base=self.pool.device_ptr(dst),
                        src_layer_bytes=0, n_src_rows=self.pool.n_rows,
                        dst_base=dev.data.ptr, dst_layer_bytes=0,
                        n_dst_rows=self.device.shape[1], row_bytes=self.row_bytes)
        launch_copy(p, grid=default_copy_grid(R, W), stream=s)

    def state(self, layer: int) -> SwapState:
        """The single-step swap tables of ``layer`` (views)."""
        return self._states[self._layer(layer)]

    def multistep_state(self, layer: int) -> MultiStepState:
        """The multi-step state of ``layer`` (views; needs ``max_steps >= 2``)."""
        layer = self._layer(layer)
        if not self._ms:
            raise ValueError("this cache was built with max_steps=1: no multi-step state")
        return self._ms[layer]

    def device_rows(self, layer: int) -> cupy.ndarray:
        """uint8 ``[D, row_bytes]``: the rows that swap outputs index, for ``layer``."""
        return self.device[self._layer(layer)]

    # ----------------------------------------------------------------- per step
    def begin_step(self, req_indices, seq_lens, num_real=None, *, stream=None,
                   pdl: bool | None = None, prefetcher=None) -> Step:
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

        The arrays are used in place (no copy): do not change them while the step's work is
        queued. The step holds no device memory of its own; create one per decode step.
        """
        return Step(self, req_indices, seq_lens, num_real, stream=stream, pdl=pdl,
                    prefetcher=prefetcher)

    def swap(self, layer: int, req_indices, seq_lens, top_k_tokens, *, num_real=None,
             out=None, copy_grid: int | None = None, check: bool = False,
             stream=None, pdl: bool | None = None) -> cupy.ndarray:
        """One swap outside a step: ``begin_step(...).swap(layer, top_k_tokens, ...)``."""
        return self.begin_step(req_indices, seq_lens, num_real, stream=stream, pdl=pdl).swap(
            layer, top_k_tokens, out=out, copy_grid=copy_grid, check=check)

    def newest_rows(self, req_indices, seq_lens, num_real=None, *, backup: bool = False,
                    stream=None) -> cupy.ndarray:
        """``begin_step(...).newest_rows(backup=backup)``."""
        return self.begin_step(req_indices, seq_lens, num_real, stream=stream).newest_rows(
            backup=backup)

    def backup_newest(self, req_indices, seq_lens, num_real=None, *, write_host: bool = True,
                      stream=None) -> None:
        """``begin_step(...).backup_newest(write_host=write_host)``."""
        self.begin_step(req_indices, seq_lens, num_real, stream=stream).backup_newest(
            write_host=write_host)

    def close(self) -> None:
        """Free the host pool the cache made (after the device finished with it)."""
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> HotBufferCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dense_view(buf: cupy.ndarray, shape: tuple[int, ...]) -> cupy.ndarray:
    """A C-contiguous ``shape`` view of the first elements of ``buf`` (the multi-step kernels
    write each row's ``[S, K]`` block densely: a ``[:B, :S, :K]`` slice of a larger buffer
    would not be)."""
    return buf.reshape(-1)[: int(np.prod(shape))].reshape(shape)


def _copy_structs(tmpl: np.ndarray) -> np.ndarray:
    return tmpl.view(np.uint8).copy().view(tmpl.dtype)


class Step:
    """One decode step of a :class:`HotBufferCache`: the batch, validated once.

    Made by :meth:`HotBufferCache.begin_step`. Every method queues work on the step's stream
    without host synchronization (``check=True`` excepted).
    """

    def __init__(self, cache: HotBufferCache, req_indices, seq_lens, num_real=None, *,
                 stream=None, pdl: bool | None = None, prefetcher=None):
        self.cache = c = cache
        self.stream = as_stream(stream)
        with self.stream:  # DLPack imports order on the step's stream (and stay capturable)
            self.req = _checks.index_vector("req_indices", req_indices)
            self.batch = B = self.req.shape[0]
            if B > c.max_batch:
                raise ValueError(f"batch must be in [1, max_batch={c.max_batch}], got {B}")
            self.seq_lens, self._lens_stride, self._lens_step = _checks.lengths(seq_lens, B)
            self.num_real = None if num_real is None else _checks.device_scalar("num_real",
                                                                                num_real)
        self.pdl = resolve_pdl(pdl)
        self.prefetcher = prefetcher
        if prefetcher is not None and prefetcher.cache is not c:
            raise ValueError("prefetcher drives another cache")
        self._key = (self.req.dtype, self.seq_lens.dtype)
        req, lens, nr = ptr(self.req), ptr(self.seq_lens), ptr(self.num_real)
        # every layer's structs, copied from the cache's templates (as bytes: a structured
        # copy is ten times slower) and the batch's fields filled in for all layers at once
        self._resolve = res = _copy_structs(c._tmpl_resolve)
        res["req"], res["lens"], res["lens_stride"] = req, lens, self._lens_stride
        res["B"], res["num_real"] = B, nr
        self._copy = cp = _copy_structs(c._tmpl_copy)
        cp["B"], cp["num_real"] = B, nr
        self._ms = ms = None if c._tmpl_ms is None else _copy_structs(c._tmpl_ms)
        if ms is not None:
            ms["req"], ms["lens"], ms["num_real"], ms["B"] = req, lens, nr, B
            ms["lens_stride"], ms["lens_step"] = self._lens_stride, self._lens_step
        self._dev = cupy.cuda.runtime.getDevice()
        self._launch: dict[tuple, tuple] = {}  # per top-k shape: launchers, grids, outputs

    # ----------------------------------------------------------------- swaps
    def swap(self, layer: int, top_k_tokens, *, out=None, copy_grid: int | None = None,
             check: bool = False) -> cupy.ndarray:
        """Swap in ``layer``'s top-k: int32 ``[B, K]`` (single-step) or ``[B, S, K]``
        (multi-step, ``2 <= S <= max_steps``); returns the device rows (same shape) of
        ``cache.device_rows(layer)``, -1 for unused or invalid entries.

        Without ``out`` the result is a view of a buffer the next swap overwrites; the cache's
        :attr:`~HotBufferCache.plan` and :attr:`~HotBufferCache.status` hold this call's miss plan
        and per-row status until then. ``check``: see :func:`hisparse_cupy.swap_in` (it
        synchronizes). With a prefetcher, shared layers return their full layer's rows (the
        prefetcher's buffer: ``out`` and ``copy_grid`` are refused, set
        ``Prefetcher(copy_grid=)``); ``check`` checks every swap that runs (a full layer's, or
        any layer's with prefetch off) and a shared layer's status is its full layer's.
        """
        if self.prefetcher is not None:
            if out is not None or copy_grid is not None:
                raise ValueError("out= and copy_grid= do not apply to a step driven by a "
                                 "prefetcher: its layers return the prefetcher's page tables "
                                 "(copy them to keep them) and its swaps use "
                                 "Prefetcher(copy_grid=)")
            return self.prefetcher.swap_step(self, layer, top_k_tokens, check=check)
        return self._swap(layer, top_k_tokens, out=out, copy_grid=copy_grid, check=check)

    def _swap(self, layer: int, top_k_tokens, *, out=None, copy_grid: int | None = None,
              check: bool = False, out_checked: bool = False, stage=None) -> cupy.ndarray:
        """:meth:`swap` without the prefetcher; ``out_checked``: ``out`` is a CuPy view the
        caller (the prefetcher, for its own buffer) made with the right shape; ``stage``:
        the prefetcher's staged rows for this layer's single-step copy, a dict of the copy
        struct's ``stage_*`` fields (the caller ordered the staging before this call)."""
        c = self.cache
        if type(layer) is not int or not 0 <= layer < c.n_layers:
            layer = c._layer(layer)  # an int in range, or a TypeError / ValueError naming it
        if type(top_k_tokens) is cupy.ndarray:
            topk = _checks.token_rows("top_k_tokens", top_k_tokens, self._dev)
        else:
            with self.stream:  # a DLPack import orders on the step's stream
                topk = _checks.token_rows("top_k_tokens", top_k_tokens, self._dev)
        B = self.batch
        if topk.ndim == 3:
            return self._swap_multistep(layer, topk, out=out, check=check,
                                        out_checked=out_checked)
        if topk.ndim != 2 or topk.shape[0] != B:
            raise ValueError(f"top_k_tokens must have shape ({B}, K) or ({B}, S, K), got "
                             f"{tuple(topk.shape)}")
        K = topk.shape[1]
        plan = self._launch.get(("single", K, copy_grid))
        if plan is None:
            plan = self._plan_single(K, copy_grid)
        la_resolve, la_copy, grid_resolve, grid_copy, default_out = plan
        if out is None:
            out = default_out
        elif not out_checked:
            out = self._out_arg(out, (B, K))
        if check:
            self.check_requests()
        res = self._resolve
        w8, w4 = layer * (res.itemsize // 8), layer * (res.itemsize // 4)
        u64, i32 = self._res_words
        u64[w8 + _RES8["topk"]] = topk.data.ptr
        u64[w8 + _RES8["out"]] = out.data.ptr
        i32[w4 + _RES4["topk_stride"]] = topk.strides[0] // 4
        i32[w4 + _RES4["out_stride"]] = out.strides[0] // 4
        if i32[w4 + _RES4["K"]] != K:
            i32[w4 + _RES4["K"]] = K
            i32[w4 + _RES4["hash_size"]] = hash_size(K)
        sptr = self.stream.ptr
        la_resolve(grid_resolve, sptr, self._bases[0] + layer * res.itemsize)
        if stage is None:
            la_copy(grid_copy, sptr, self._bases[1] + layer * self._copy.itemsize)
        else:
            cp = self._copy
            for k, v in stage.items():
                cp[k][layer] = v
            try:
                la_copy(grid_copy, sptr, self._bases[1] + layer * cp.itemsize)
            finally:
                cp["stage_map"][layer] = 0  # the struct's bytes were taken at the launch
        if check:
            self.raise_on_status(topk)
        return out

    @property
    def _bases(self) -> tuple[int, int, int]:
        b = self.__dict__.get("_bases_")
        if b is None:
            ms = self._ms
            b = self.__dict__["_bases_"] = (self._resolve.ctypes.data, self._copy.ctypes.data,
                                            0 if ms is None else ms.ctypes.data)
        return b

    @property
    def _res_words(self):
        w = self.__dict__.get("_res_words_")
        if w is None:
            w = self.__dict__["_res_words_"] = (self._resolve.view(np.uint64),
                                                self._resolve.view(np.int32))
        return w

    @property
    def _ms_words(self):
        w = self.__dict__.get("_ms_words_")
        if w is None:
            w = self.__dict__["_ms_words_"] = (self._ms.view(np.uint64), self._ms.view(np.int32))
        return w

    def _plan_single(self, K: int, copy_grid: int | None):
        """Launchers, grids and default output of single-step swaps with K entries."""
        c, B = self.cache, self.batch
        if not 1 <= K <= c.top_k:
            raise ValueError(f"top_k_tokens must have 1..{c.top_k} entries per row (the cache's "
                             f"top_k), got {K}")
        grid = _checks.integer("copy_grid", copy_grid, 1, 2**31 - 1) if copy_grid else \
            default_copy_grid(B, K)
        la_resolve, grid_resolve = resolve_launch(self._key, B, K, c.hot_size, c.token_table)
        plan = (la_resolve,
                launcher(_build.kernel(_build.COPY_H2D[(1, _abi.COPY_WARPS)]), _abi.COPY_WARPS * 32,
                         _abi.smem_bytes("PLANNED_COPY", B=B), self.pdl),
                grid_resolve, (grid, 1, 1), c.out[:B, :K])
        self._launch[("single", K, copy_grid)] = plan
        return plan

    def _out_arg(self, out, shape) -> cupy.ndarray:
        """``out`` checked; a foreign array is imported on the step's stream."""
        with self.stream if type(out) is not cupy.ndarray else contextlib.nullcontext():
            return _checks.array("out", out, np.int32, shape=shape, contiguous=False,
                                 inner_contiguous=True)

    def _swap_multistep(self, layer: int, topk, *, out=None, check: bool = False,
                        out_checked: bool = False):
        c = self.cache
        B, S, K = topk.shape
        if c.max_steps < 2:
            raise ValueError("a [B, S, K] top-k needs a cache built with max_steps >= 2")
        if B != self.batch or not 2 <= S <= c.max_steps or not 1 <= K <= c.top_k:
            raise ValueError(f"top_k_tokens must have shape ({self.batch}, 2..{c.max_steps}, "
                             f"1..{c.top_k}), got {tuple(topk.shape)}")
        plan = self._launch.get(("multi", S, K))
        if plan is None:
            if self._lens_step and self.seq_lens.shape[1] < S:
                raise ValueError(f"seq_lens has {self.seq_lens.shape[1]} step column(s), the "
                                 f"call has {S} steps")
            T = S * K
            G = copy_blocks(B, S)
            plan = self._launch[("multi", S, K)] = (G,
                launcher(_build.kernel(_build.GATHER[self._key]), _abi.GATHER_BLOCK),
                launcher(_build.kernel(_build.COMMIT[self._key]), _abi.COMMIT_BLOCK,
                         commit_smem_bytes(c.hot_size, T), self.pdl),
                (-(-T // _abi.GATHER_BLOCK), B, 1), (B * (1 + G), 1, 1),
                _dense_view(c.ms_out, (B, S, K)))
        G, la_gather, la_commit, grid_gather, grid_commit, default_out = plan
        if out is None:
            out = default_out
        elif not out_checked:
            out = self._out_arg(out, (B, S, K))
        if check:
            self.check_requests()
        ms = self._ms
        u64, i32 = self._ms_words
        w8, w4 = layer * (ms.itemsize // 8), layer * (ms.itemsize // 4)
        u64[w8 + _MS8["topk"]] = topk.data.ptr
        u64[w8 + _MS8["out"]] = out.data.ptr
        i32[w4 + _MS4["topk_stride"]] = topk.strides[0] // 4
        i32[w4 + _MS4["out_stride"]] = out.strides[0] // 4
        i32[w4 + _MS4["S"]] = S
        i32[w4 + _MS4["K"]] = K
        i32[w4 + _MS4["copy_blocks"]] = G
        sptr = self.stream.ptr
        addr = self._bases[2] + layer * ms.itemsize
        la_gather(grid_gather, sptr, addr)
        la_commit(grid_commit, sptr, addr)
        if check:
            self.raise_on_status(topk)
        return out

    # ----------------------------------------------------------------- check=True
    def check_requests(self) -> None:
        """``check=True``'s first half: raise ``ValueError`` if a valid request slot repeats
        among the real rows (synchronizes)."""
        _checks.unique_requests(self.req, self.num_real, self.cache.max_requests)

    def raise_on_status(self, top_k_tokens) -> None:
        """``check=True``'s second half: synchronize the step's stream and raise ``ValueError``
        naming every row and entry the last swap flagged (``top_k_tokens``: that swap's)."""
        with self.stream:  # a foreign array imports on the step's stream
            topk = _checks.token_rows("top_k_tokens", top_k_tokens, self._dev)
        _checks.raise_on_status(self.cache.status[:self.batch], topk, self.seq_lens,
                                max_len=self.cache.max_len,
                                what="multi-step swap" if topk.ndim == 3 else "swap",
                                stream=self.stream)

    # ----------------------------------------------------------------- newest token
    def newest_rows(self, *, backup: bool = False, write_host: bool = True) -> cupy.ndarray:
        """Device row (in every layer) of each row's newest token ``seq_len - 1``.

        The model writes the step's KV there. Returns int32 ``[B]`` (a view valid until the
        next call), -1 for padding or invalid rows. With ``backup=True`` also records the token
        in slot H of every layer (where this step's swaps find it) and, unless
        ``write_host=False``, copies that row of every layer to its host row (what
        :meth:`backup_newest` does).
        """
        c, B = self.cache, self.batch
        p = Params(_abi.NEWEST_ROWS).set(
            req=ptr(self.req), lens=ptr(self.seq_lens), num_real=ptr(self.num_real),
            slot_locs=ptr(c.slot_locs[0]), slot_tokens=ptr(c.slot_tokens),
            host_locs=ptr(c.host_locs), rows_out=ptr(c._newest),
            plan_src=ptr(c._backup_src), plan_dst=ptr(c._backup_dst),
            plan_count=ptr(c._backup_count), slot_layer_stride=c.slot_tokens.strides[0] // 4,
            B=B, R=c.max_requests, max_len=c.max_len, slot_stride=c.slots, H=c.hot_size,
            host_stride=c.max_len, lens_stride=self._lens_stride, n_layers=c.n_layers,
            record=1 if backup else 0)
        launch(_build.kernel(_build.NEWEST[self._key]), -(-B // _abi.NEWEST_BLOCK),
               _abi.NEWEST_BLOCK, p, stream=self.stream)
        if backup and write_host:
            cp = copy_params(c._backup_src, c._backup_dst, c._backup_count, B, self.num_real,
                             src_base=c.device.data.ptr, src_layer_bytes=c.device[0].nbytes,
                             n_src_rows=c.device.shape[1], dst_base=c.pool.device_ptr(0),
                             dst_layer_bytes=c.pool.layer_bytes, n_dst_rows=c.pool.n_rows,
                             row_bytes=c.row_bytes, n_layers=c.n_layers)
            launch_copy(cp, to_host=True, grid=default_copy_grid(B, 1, c.n_layers),
                        stream=self.stream, pdl=self.pdl)
        return c._newest[:B]

    def backup_newest(self, *, write_host: bool = True) -> None:
        """Copy each row's newest token from the device to its host row, all layers, one launch.

        Call once per decode step after the model wrote the step's KV, before any later swap
        that may select that token (queue order on the step's stream guarantees it). It also
        records the token in slot H, where the step's swaps find it on the device.

        ``write_host=False``: record the token but leave its host row to another writer (a
        tensor-parallel rank over a host pool shared with ranks that hold the same KV). The
        caller must then order every later swap that may miss on the token after that writer's
        copy (e.g. an interprocess event, ``examples/tp_decode.py --newest-writer rank0``).
        """
        self.newest_rows(backup=True, write_host=write_host)

    def finish(self) -> None:
        """End the step: with a prefetcher, join its side stream into the step's stream."""
        if self.prefetcher is not None:
            self.prefetcher.finish(self.stream)
