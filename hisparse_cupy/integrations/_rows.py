"""Where a model's cached rows live and how a step's selected rows reach its attention: two
backends with one interface, used by :mod:`hisparse_cupy.integrations.transformers`.

- :class:`CacheRows`: the GPU path, a :class:`hisparse_cupy.HotBufferCache` whose device rows
  are a torch tensor (``uint8 [L, D, row_bytes]``, viewed as the model's dtype): each layer's
  selected rows are swapped into the request's hot buffer and gathered from there.
- :class:`OracleRows`: the same calls over the NumPy oracle's tables
  (:func:`hisparse_cupy.reference.swap_in`, the kernels' specification) and torch tensors on the
  CPU standing for the host pool and the device rows: the integration runs, and is tested,
  without a GPU.

A decode step, per batch of requests of one length: :meth:`begin` (the step's length, counting
its new token), then for every layer in order :meth:`write_newest` (the new token's row, where
the step's swaps find it) and :meth:`select` (the rows of the layer's top-k, and which are
valid), then :meth:`end` (the new token's rows of every layer backed up to the host pool, which
needs every layer's written: a model writes them layer by layer).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import reference as ref


class OracleRows:
    """The rows on the CPU, moved by the NumPy oracle's swap. Slot layout: request slot ``r``'s
    token ``t`` in host row ``r * max_len + t``; ``hot_size + extra_page`` device rows a
    request, its newest token in slot ``min(t, hot_size)`` (positional while it fits)."""

    def __init__(self, *, n_layers: int, row_values: int, dtype, max_requests: int,
                 max_len: int, hot_size: int, top_k: int, extra_page: int):
        L, R, H, W = n_layers, max_requests, hot_size, hot_size + extra_page
        self.n_layers, self.max_len, self.hot_size, self.top_k = L, max_len, H, top_k
        self.host = torch.zeros(L, R * max_len, row_values, dtype=dtype)
        self.device = torch.zeros(L, R * W, row_values, dtype=dtype)
        self.host_locs = np.full((R, max_len), -1, np.int64)
        self.slot_locs = (np.arange(R)[:, None] * W + np.arange(W)).astype(np.int32)
        self.slot_tokens = np.full((L, R, W), -1, np.int32)
        self.lru = np.tile(np.arange(H, dtype=np.int16), (L, R, 1))
        self.free = list(range(R))
        self.stats = {"selected": np.zeros(L, np.int64), "misses": np.zeros(L, np.int64)}

    def admit(self, rows: torch.Tensor) -> int:
        """A request whose tokens' rows are ``rows [L, n, V]``: its slot."""
        if not self.free:
            raise RuntimeError("every request slot is taken")
        rid = self.free.pop(0)
        n, H = rows.shape[1], self.hot_size
        base = rid * self.max_len
        self.host[:, base:base + n] = rows
        self.host_locs[rid] = -1
        self.host_locs[rid, :n] = base + np.arange(n)
        self.slot_tokens[:, rid] = -1
        self.lru[:, rid] = np.arange(H)
        if n <= H:  # positional: token t in slot t
            self.slot_tokens[:, rid, :n] = np.arange(n)
            self.device[:, self.slot_locs[rid, :n]] = rows
        else:  # cold, the newest token in slot H
            self.slot_tokens[:, rid, H] = n - 1
            self.device[:, self.slot_locs[rid, H]] = rows[:, n - 1]
        return rid

    def begin(self, rids, seq_len: int) -> None:
        self.rids, self.seq = np.asarray(rids, np.int64), int(seq_len)
        t = self.seq - 1
        self.newest = torch.as_tensor(self.slot_locs[self.rids, min(t, self.hot_size)],
                                      dtype=torch.long)
        self.written: list[torch.Tensor | None] = [None] * self.n_layers

    def write_newest(self, layer: int, rows: torch.Tensor) -> None:
        self.device[layer, self.newest] = rows
        self.written[layer] = rows
        if self.seq - 1 >= self.hot_size:
            self.slot_tokens[layer, self.rids, self.hot_size] = self.seq - 1

    def select(self, layer: int, top_k: torch.Tensor):
        """``(rows [B, K, V], valid [B, K])`` of ``top_k [B, K]`` (token ids)."""
        res = ref.swap_in(top_k.numpy(), self.rids, np.full(len(self.rids), self.seq),
                          host_locs=self.host_locs, slot_tokens=self.slot_tokens[layer],
                          slot_locs=self.slot_locs, lru=self.lru[layer],
                          hot_size=self.hot_size, n_host_rows=self.host.shape[1])
        for b in range(len(self.rids)):  # the miss plan's copies, host -> device
            n = int(res.plan_count[b])
            self.device[layer, res.plan_dst[b, :n]] = self.host[layer, res.plan_src[b, :n]]
        self.stats["selected"][layer] += top_k.numel()
        self.stats["misses"][layer] += int(res.plan_count.sum())
        locs = torch.as_tensor(res.device_locs, dtype=torch.long)
        return self.device[layer][locs.clamp(min=0)], locs >= 0

    def end(self) -> None:
        if any(w is None for w in self.written):
            raise RuntimeError("a decode step ended before every layer wrote its new row")
        t = self.seq - 1
        rows = self.rids * self.max_len + t
        for layer, w in enumerate(self.written):
            self.host[layer, rows] = w
        self.host_locs[self.rids, t] = rows

    def release(self, rid: int) -> None:
        self.host_locs[rid] = -1
        self.free = sorted(self.free + [rid])

    def counters(self) -> dict:
        sel, miss = self.stats["selected"], self.stats["misses"]
        return {"selected": sel.copy(), "misses": miss.copy(),
                "hit_rate": np.where(sel > 0, 1.0 - miss / np.maximum(sel, 1), np.nan)}


class CacheRows:
    """The rows in a :class:`hisparse_cupy.HotBufferCache` (host pool + hot buffers), every
    call on torch's current stream. ``device_budget``: rows of a residency budget (requests
    resident while it holds them, sparse beyond); None: every request sparse."""

    def __init__(self, *, n_layers: int, row_values: int, dtype, max_requests: int,
                 max_len: int, hot_size: int, top_k: int, extra_page: int,
                 device_budget: int | None = None, pattern=None):
        from .. import HotBufferCache, Prefetcher

        itemsize = torch.empty((), dtype=dtype).element_size()
        rb = row_values * itemsize
        D = device_budget or HotBufferCache.rows_needed(
            max_requests=max_requests, hot_size=hot_size, top_k=top_k, extra_page=extra_page)
        self.device = torch.empty((n_layers, D, rb), dtype=torch.uint8, device="cuda")
        self.cache = HotBufferCache(n_layers=n_layers, max_requests=max_requests,
                                    max_len=max_len, row_bytes=rb, hot_size=hot_size,
                                    top_k=top_k, extra_page=extra_page, device_rows=self.device,
                                    device_budget=device_budget)
        self.rows = self.device.view(dtype)  # [L, D, V]
        self.prefetcher = None if pattern is None else Prefetcher(self.cache, pattern)
        self.out = torch.empty((max_requests, top_k), dtype=torch.int32, device="cuda")
        self.n_layers, self._rids = n_layers, None

    def admit(self, rows: torch.Tensor) -> int:
        s = torch.cuda.current_stream()
        return self.cache.admit(rows.shape[1], kv=rows.contiguous().view(torch.uint8), stream=s)

    def begin(self, rids, seq_len: int) -> None:
        from ..interop import to_torch

        s = torch.cuda.current_stream()
        for rid in rids:  # (pages: a paged pool's or a resident request's device pages)
            self.cache.grow(rid, seq_len, stream=s)
        if self._rids != list(rids):  # (a generate call's requests: one upload)
            self._rids = list(rids)
            self.req = torch.as_tensor(self._rids, dtype=torch.int32).cuda()
            self.lens = torch.empty(len(rids), dtype=torch.int32, device="cuda")
        self.lens.fill_(seq_len)  # (in place, on the step's stream: after the last step's reads)
        self.step = self.cache.begin_step(self.req, self.lens, stream=s,
                                          prefetcher=self.prefetcher)
        self.newest = to_torch(self.step.newest_rows(), stream=s).long()  # (a copy: .long())

    def write_newest(self, layer: int, rows: torch.Tensor) -> None:
        self.rows[layer].index_copy_(0, self.newest, rows)

    def select(self, layer: int, top_k: torch.Tensor | None):
        """As :meth:`OracleRows.select`; ``top_k`` None on a prefetcher's shared layer."""
        from ..interop import to_torch

        s = torch.cuda.current_stream()
        if self.prefetcher is None:
            B, k = len(self.req), top_k.shape[-1]  # k <= K: the indexer's top-k is shorter
            locs = self.out.view(-1)[: B * k].view(B, k)  # while the sequence is (contiguous)
            self.step.swap(layer, top_k.to(torch.int32).contiguous(), out=locs)
        else:
            locs = to_torch(self.step.swap(layer, top_k), stream=s)
        locs = locs.long()
        return self.rows[layer][locs.clamp(min=0)], locs >= 0

    def end(self) -> None:
        self.step.backup_newest()
        self.step.finish()

    def release(self, rid: int) -> None:
        self.cache.release(rid, stream=torch.cuda.current_stream())

    def counters(self) -> dict:
        return self.cache.counters.read(torch.cuda.current_stream())
