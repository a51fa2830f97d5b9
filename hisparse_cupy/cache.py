"""HotBufferCache: the stateful layer engines and examples call.

It owns, for ``n_layers`` layers and ``max_requests`` request slots:

- the host pool (:class:`HostKVPool`): request slot ``r``'s token ``p`` lives in host row
  ``r * max_len + p`` of every layer (one request's rows are close together in host memory);
- the device rows: uint8 ``[n_layers, R * (H + P), row_bytes]``; slot ``s`` of request slot
  ``r`` is device row ``r * (H + P) + s`` in every layer (``slot_locs``, shared by the layers);
- per layer: ``slot_tokens`` int32 ``[R, H + P]`` and ``lru`` int16 ``[R, H]``;
- ``host_locs`` int64 ``[R, max_len]``: -1 until a token's host row has been written.

Request lifecycle: :meth:`admit` (prefill KV given or already written), then per decode step
the model writes the new token's KV into :meth:`newest_rows` of every layer, calls
:meth:`backup_newest` once (device -> host copy of that row for all layers), and :meth:`swap`
per layer; :meth:`release` at the end. Every call is queued on the current CuPy stream (or the
``stream`` given) without host synchronization, so a decode step can be captured in a graph.
"""

from __future__ import annotations

import cupy
import numpy as np

from . import _build, _checks
from ._launch import Ptr, launch
from .host_pool import HostKVPool
from .plan import MissPlan, copy_rows
from .reference import N_STATUS
from .swap import MAX_HOT, SwapState, check_sizes, swap_in

_FILE = "cache.cu"
_NEWEST = _build.index_instances("hs::newest_rows<{req}, {len}>")
_build.register(_FILE, *_NEWEST.values())


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
        Largest batch a :meth:`swap` call takes (default ``max_requests``).
    """

    def __init__(self, *, n_layers: int, max_requests: int, max_len: int, row_bytes: int,
                 hot_size: int = 4096, top_k: int = 2048, extra_page: int = 64,
                 max_batch: int | None = None):
        self.n_layers = _checks.integer("n_layers", n_layers, 1)
        self.max_requests = R = _checks.integer("max_requests", max_requests, 1)
        self.max_len = _checks.integer("max_len", max_len, 1)
        self.hot_size = H = _checks.integer("hot_size", hot_size, 1, MAX_HOT)
        self.top_k = _checks.integer("top_k", top_k, 1, H)
        self.extra_page = P = _checks.integer("extra_page", extra_page, 1)
        self.max_batch = _checks.integer("max_batch", R if max_batch is None else max_batch, 1)
        check_sizes(self.top_k, H)
        self.slots = H + P
        self.pool = HostKVPool(self.n_layers, R * self.max_len, row_bytes)
        self.row_bytes = self.pool.row_bytes
        D = R * self.slots
        self.device = cupy.empty((self.n_layers, D, self.row_bytes), cupy.uint8)
        self.slot_locs = cupy.arange(D, dtype=cupy.int32).reshape(R, self.slots)
        self.slot_tokens = cupy.full((self.n_layers, R, self.slots), -1, cupy.int32)
        self.lru = cupy.empty((self.n_layers, R, H), cupy.int16)
        self.lru[...] = cupy.arange(H, dtype=cupy.int16)
        self.host_locs = cupy.full((R, self.max_len), -1, cupy.int64)
        self.plan = MissPlan(self.max_batch, self.top_k)
        self.out = cupy.empty((self.max_batch, self.top_k), cupy.int32)
        self.status = cupy.empty((self.max_batch, N_STATUS), cupy.int32)
        self._newest = cupy.empty(self.max_batch, cupy.int32)
        # one-entry D2H plan per batch row: newest token's device row -> its host row
        self._backup_src = cupy.empty((self.max_batch, 1), cupy.int32)
        self._backup_dst = cupy.empty((self.max_batch, 1), cupy.int64)
        self._backup_count = cupy.zeros(self.max_batch, cupy.int32)
        self._free = list(range(R - 1, -1, -1))
        self._len: dict[int, int] = {}

    # ----------------------------------------------------------------- requests
    @property
    def active(self) -> dict[int, int]:
        """Admitted request slots and the length each was admitted with."""
        return dict(self._len)

    def admit(self, n_tokens: int, kv: np.ndarray | None = None,
              warm_tokens=None, *, stream: cupy.cuda.Stream | None = None) -> int:
        """Admit a request of ``n_tokens`` tokens whose KV is (or is now) in the host pool.

        Parameters
        ----------
        n_tokens : int
            Current length, 1 .. max_len.
        kv : uint8 ``[n_layers, n_tokens, row_bytes]``, optional
            Prefill KV to write into the host pool first (else write it with
            :meth:`write_host` before admitting, or host rows stay unwritten).
        warm_tokens : sequence of int, optional
            For ``n_tokens > H``: up to H distinct tokens in ``[0, n_tokens - 1)`` to load into
            the hot buffer now (default: start cold). Ignored for short requests, which are
            loaded whole in positional layout.

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
        if kv is not None and (np.ndim(kv) != 3 or np.shape(kv)[1] != n):
            raise ValueError(f"kv must hold the n_tokens={n} rows being admitted: uint8 "
                             f"[{self.n_layers}, {n}, {self.row_bytes}], got shape {np.shape(kv)}")
        rid = self._free.pop()
        try:
            if kv is not None:
                self.write_host(rid, 0, kv, _admitting=n)
            s = stream or cupy.cuda.get_current_stream()
            with s:
                self.host_locs[rid, :n] = rid * self.max_len + cupy.arange(n, dtype=cupy.int64)
                self.host_locs[rid, n:] = -1
                if n <= H:  # positional layout: slot p is token p's
                    self.slot_tokens[:, rid, :] = -1
                    self.slot_tokens[:, rid, :H] = cupy.arange(H, dtype=cupy.int32)
                    self.lru[:, rid] = cupy.arange(H, dtype=cupy.int16)
                    slots = np.arange(n)
                    tokens = np.arange(n)
                else:  # LRU layout: newest token in slot H, warm tokens in slots 0..w-1
                    w = warm.size
                    self.slot_tokens[:, rid, :] = -1
                    self.slot_tokens[:, rid, :w] = cupy.asarray(warm, dtype=cupy.int32)
                    self.slot_tokens[:, rid, H] = n - 1
                    order = np.concatenate([np.arange(w, H), np.arange(w)]).astype(np.int16)
                    self.lru[:, rid] = cupy.asarray(order)
                    slots = np.concatenate([np.arange(w), [H]])
                    tokens = np.concatenate([warm, [n - 1]])
                self._load(rid, slots, tokens, s)
        except Exception:
            self._free.append(rid)
            raise
        self._len[rid] = n
        return rid

    def _load(self, rid: int, slots: np.ndarray, tokens: np.ndarray, stream) -> None:
        """Copy host rows of ``tokens`` into ``slots`` of request ``rid`` for every layer."""
        n = len(slots)
        src = cupy.asarray((rid * self.max_len + tokens).astype(np.int64).reshape(1, n))
        dst = self.slot_locs[rid, cupy.asarray(slots)].reshape(1, n)
        cnt = cupy.full(1, n, dtype=cupy.int32)
        copy_rows(src, cupy.ascontiguousarray(dst), cnt, 1, None,
                  src_base=self.pool.device_ptr(0), src_layer_bytes=self.pool.layer_bytes,
                  n_src_rows=self.pool.n_rows, dst_base=Ptr(self.device.data.ptr),
                  dst_layer_bytes=self.device[0].nbytes, n_dst_rows=self.device.shape[1],
                  row_bytes=self.row_bytes, n_layers=self.n_layers, stream=stream)

    def write_host(self, rid: int, start: int, kv: np.ndarray, *, _admitting: int = 0) -> None:
        """Write KV rows of tokens ``start .. start + n`` of request ``rid`` into the host pool.

        ``kv`` is uint8 ``[n_layers, n, row_bytes]``. Synchronizes the device first, so no queued
        kernel reads these rows while they change.
        """
        rid = _checks.integer("rid", rid, 0, self.max_requests - 1)
        if rid not in self._len and not _admitting:
            raise ValueError(f"request slot {rid} is not admitted")
        kv = np.asarray(kv)
        if kv.dtype != np.uint8 or kv.ndim != 3 or kv.shape[0] != self.n_layers \
                or kv.shape[2] != self.row_bytes:
            raise ValueError(f"kv must be uint8 [{self.n_layers}, n, {self.row_bytes}], got "
                             f"{kv.dtype} {kv.shape}")
        start = _checks.integer("start", start, 0)
        if start + kv.shape[1] > self.max_len:
            raise ValueError(f"tokens {start}..{start + kv.shape[1]} exceed max_len "
                             f"{self.max_len}")
        cupy.cuda.Device().synchronize()
        base = rid * self.max_len + start
        self.pool.numpy[:, base: base + kv.shape[1]] = kv
        if not _admitting:
            self.host_locs[rid, start: start + kv.shape[1]] = (
                base + cupy.arange(kv.shape[1], dtype=cupy.int64))

    def release(self, rid: int, *, stream: cupy.cuda.Stream | None = None) -> None:
        """Free request slot ``rid``: its slot tables, LRU order and host rows are reset."""
        rid = _checks.integer("rid", rid, 0, self.max_requests - 1)
        if rid not in self._len:
            raise ValueError(f"request slot {rid} is not admitted")
        with stream or cupy.cuda.get_current_stream():
            self.slot_tokens[:, rid] = -1
            self.lru[:, rid] = cupy.arange(self.hot_size, dtype=cupy.int16)
            self.host_locs[rid] = -1
        del self._len[rid]
        self._free.append(rid)

    # ----------------------------------------------------------------- per step
    def state(self, layer: int) -> SwapState:
        """The swap tables of ``layer`` (views)."""
        layer = _checks.integer("layer", layer, 0, self.n_layers - 1)
        return SwapState(self.host_locs, self.slot_tokens[layer], self.slot_locs,
                         self.lru[layer])

    def device_rows(self, layer: int) -> cupy.ndarray:
        """uint8 ``[R * (H + P), row_bytes]``: the rows that swap outputs index, for ``layer``."""
        return self.device[_checks.integer("layer", layer, 0, self.n_layers - 1)]

    def _batch(self, req_indices, seq_lens):
        req = _checks.array("req_indices", req_indices, (np.int32, np.int64), ndim=1)
        B = req.shape[0]
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"batch must be in [1, max_batch={self.max_batch}], got {B}")
        lens = _checks.array("seq_lens", seq_lens, (np.int32, np.int64), shape=(B,))
        return req, lens, B

    def newest_rows(self, req_indices, seq_lens, num_real=None, *, backup: bool = False,
                    stream: cupy.cuda.Stream | None = None) -> cupy.ndarray:
        """Device row (in every layer) of each row's newest token ``seq_len - 1``.

        The model writes the step's KV there. Returns int32 ``[B]`` (a view valid until the
        next call), -1 for padding or invalid rows. With ``backup=True`` also copies that row of
        every layer to its host row (what :meth:`backup_newest` does).
        """
        req, lens, B = self._batch(req_indices, seq_lens)
        nr = None if num_real is None else _checks.device_scalar("num_real", num_real)
        name = _NEWEST[(req.dtype, lens.dtype)]
        args = (req, lens, nr, np.int32(B), np.int32(self.max_requests),
                np.int32(self.max_len), self.slot_locs, _checks.row_stride(self.slot_locs),
                np.int32(self.hot_size), self.host_locs, _checks.row_stride(self.host_locs),
                self._newest, self._backup_src, self._backup_dst, self._backup_count,
                np.int32(1 if backup else 0))
        launch(_build.kernel(_FILE, name), -(-B // 128), 128, args, stream=stream)
        if backup:
            copy_rows(self._backup_src, self._backup_dst, self._backup_count, B, nr,
                      src_base=Ptr(self.device.data.ptr), src_layer_bytes=self.device[0].nbytes,
                      n_src_rows=self.device.shape[1], dst_base=self.pool.device_ptr(0),
                      dst_layer_bytes=self.pool.layer_bytes, n_dst_rows=self.pool.n_rows,
                      row_bytes=self.row_bytes, n_layers=self.n_layers, to_host=True,
                      stream=stream)
        return self._newest[:B]

    def backup_newest(self, req_indices, seq_lens, num_real=None, *,
                      stream: cupy.cuda.Stream | None = None) -> None:
        """Copy each row's newest token from the device to its host row, all layers, one launch.

        Call once per decode step after the model wrote the step's KV, before any later swap
        that may select that token (queue order on one stream guarantees it).
        """
        self.newest_rows(req_indices, seq_lens, num_real, backup=True, stream=stream)

    def swap(self, layer: int, req_indices, seq_lens, top_k_tokens, *, num_real=None,
             out=None, copy_grid: int | None = None, check: bool = False,
             stream: cupy.cuda.Stream | None = None) -> cupy.ndarray:
        """Single-step swap-in of ``layer`` for a batch; returns int32 ``[B, K]`` device rows.

        The result indexes :meth:`device_rows`. Without ``out`` it is a view of a buffer the
        next swap overwrites; :attr:`plan` holds this call's miss plan and :attr:`status` its
        per-row status until then. See :func:`hisparse_cupy.swap.swap_in`.
        """
        req, lens, B = self._batch(req_indices, seq_lens)
        return swap_in(
            top_k_tokens, req, lens, self.state(layer),
            host_rows=self.pool.device_ptr(layer), n_host_rows=self.pool.n_rows,
            device_rows=self.device[layer], plan=self.plan,
            out=self.out[:B] if out is None else out, status=self.status[:B],
            num_real=num_real, copy_grid=copy_grid, check=check, stream=stream,
        )

    def close(self) -> None:
        """Free the host pool (after the device finished with it)."""
        self.pool.close()

    def __enter__(self) -> HotBufferCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
