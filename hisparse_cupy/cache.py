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
- ``host_locs`` int64 ``[R, max_len]``: -1 until a token's host row is written; the counters.

Per decode step :meth:`HotBufferCache.begin_step` returns a :class:`~hisparse_cupy.Step`
(``hisparse_cupy/step.py``), which runs every layer's swap. Request lifecycle: :meth:`admit`,
the steps, :meth:`release`. Every call is queued on a stream without host synchronization.
:meth:`layer_tables` lists the per-layer tables (reset, mirroring, snapshots).
"""

from __future__ import annotations

import cupy
import numpy as np

from . import _abi, _checks, multistep, swap
from ._device import require_gpu
from ._launch import Structs, as_stream
from .counters import LayerCounters
from .host_pool import HostKVPool
from .mirror import mirror_rows
from .multistep import MultiStepConfig, MultiStepState, MultiStepWorkspace, init_states
from .newest import NewestBuffers
from .plan import MissPlan, copy_params, default_copy_grid, launch_copy
from .step import Step
from .swap import SwapState, check_sizes


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
        Keep a token -> hot slot table (``SwapState.token_slot``, int16 ``[n_layers,
        max_requests, max_len]``), so the single-step resolve looks each selected token up
        instead of hashing the top-k (faster at every batch size when few tokens miss:
        benchmarks/NOTES.md). Default True; False gives the hash resolve; ``max_steps >= 2``
        needs the table.
    counters : bool
        Count every layer's swaps on the device (:attr:`counters`,
        :class:`~hisparse_cupy.counters.LayerCounters`, read without a synchronize). Default
        True; False: None, the kernels count nothing.
    """

    def __init__(self, *, n_layers: int, max_requests: int, max_len: int, row_bytes: int,
                 hot_size: int = 4096, top_k: int = 2048, extra_page: int = 64,
                 max_batch: int | None = None, max_steps: int = 1, scratch: int | None = None,
                 pool: HostKVPool | None = None, device_rows=None, token_table: bool = True,
                 counters: bool = True):
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
        self.newest = NewestBuffers(self.max_batch)
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
                    validate=False, token_slot=self.token_slot[layer], ref=self.ms_ref[layer],
                    clock=self.ms_clock[layer]))
        self._states = [self._swap_state(layer) for layer in range(L)]
        self.counters = LayerCounters(L, self.row_bytes) if counters else None
        self._templates()
        self._free = list(range(R - 1, -1, -1))
        self._len: dict[int, int] = {}
        self._released: dict[int, cupy.cuda.Event] = {}
        # The tables were filled on CuPy's current stream; later calls take any stream (often a
        # non-blocking one, not ordered after these fills): construction ends when they landed.
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
        """Every layer's kernel structs with the fields that do not depend on the step: each
        kernel family's per-layer stage. A :class:`Step` copies them and fills the batch's
        fields for all layers at once, so a swap only writes its top-k's (plan/run)."""
        L, n_host = self.n_layers, self.pool.n_rows
        count = [self.counters.address(i) for i in range(L)] if self.counters else ()
        self.resolve_structs = swap.layer_structs(self._states, status=self.status,
                                                  plan=self.plan, n_host_rows=n_host,
                                                  counters=count)
        self.copy_structs = Structs.zeros(_abi.PLANNED_COPY, L)
        for layer in range(L):
            copy_params(self.plan.src, self.plan.dst, self.plan.count, 0, None,
                        src_base=int(self.pool.device_ptr(layer)), src_layer_bytes=0,
                        n_src_rows=n_host, dst_base=self.device[layer].data.ptr,
                        dst_layer_bytes=0, n_dst_rows=self.device.shape[1],
                        row_bytes=self.row_bytes, params=self.copy_structs.row(layer))
        self.multistep_structs = None if not self._ms else multistep.layer_structs(
            self._ms, status=self.status, plan=self.plan,
            host_rows=[self.pool.device_ptr(i) for i in range(L)], n_host_rows=n_host,
            device_rows=[self.device[i].data.ptr for i in range(L)], row_bytes=self.row_bytes,
            counters=count)

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
        """Request slot ``rid``'s per-layer tables back to empty (on the current stream)."""
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
            A GPU array (any DLPack exporter), rows contiguous: one device -> host copy on
            ``stream``, then the host rows are recorded there; nothing synchronizes. A host
            array: the CPU writes the rows after the work queued on ``stream`` (synchronized)
            and, for a slot being admitted, its previous request's release.
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
        """Free request slot ``rid``: its tables and host rows are reset (token -> slot entries,
        never trusted without the slot table, stay)."""
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
    def layer_index(self, layer) -> int:
        """``layer`` checked: an int in ``[0, n_layers)``, else a ``TypeError`` / ``ValueError``
        naming it."""
        if type(layer) is int and 0 <= layer < self.n_layers:
            return layer
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
        src, dst = self.layer_index(src), self.layer_index(dst)
        s = as_stream(stream)
        with s:
            if rows and src != dst:
                mirror_rows(self, src, dst, s)
            for t in self.layer_tables().values():
                t[dst][...] = t[src]

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

    def close(self) -> None:
        """Free the host pool the cache made (after the device finished with it)."""
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> HotBufferCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
