"""A NumPy model of the step API (HotBufferCache, Step, Prefetcher) over the oracle.

Written from the documented behaviour, not from the GPU code: ``reference.swap_in`` and
``reference.multistep_swap_in`` decide every call, each plan's copies move the bytes of NumPy
"device" rows, and the multi-step swap's miss order (the order the gather's threads claim
misses in, which decides their scratch rows) is drawn at random per call and layer, as two
layers running the same call on the GPU may order them differently. The randomized step test
(``_stepfuzz.py``) drives it on the CPU with the same calls and checks it like the GPU cache.
Streams, ``pdl`` and graph capture have no meaning here and are accepted and ignored.
"""

from __future__ import annotations

import copy
import heapq
from types import SimpleNamespace

import numpy as np

from hisparse_cupy import reference as ref
from hisparse_cupy._kernels.multistep import MultiStepConfig
from hisparse_cupy.streams._pattern import layer_pattern


class ModelCache:
    def __init__(self, *, n_layers, max_requests, max_len, row_bytes, hot_size, top_k,
                 extra_page, max_steps=1, scratch=None, seed=0):
        L, R, H, P = n_layers, max_requests, hot_size, extra_page
        self.n_layers, self.max_requests, self.max_len = L, R, max_len
        self.row_bytes, self.hot_size, self.top_k = row_bytes, H, top_k
        self.extra_page, self.max_steps = P, max_steps
        C = 0
        if max_steps >= 2:
            C = MultiStepConfig(R, H, P, top_k, max_steps=max_steps, scratch=scratch).scratch
        self.slots = W = H + P
        self.rows_per_request = W + C
        self.rng = np.random.default_rng(seed)
        self.host = np.zeros((L, R * max_len, row_bytes), np.uint8)
        self.device = np.zeros((L, R * (W + C), row_bytes), np.uint8)
        self.host_locs = np.full((R, max_len), -1, np.int64)
        self._slot_layout = (np.arange(R)[:, None] * (W + C) + np.arange(W)).astype(np.int32)
        self._scratch_layout = (np.arange(R)[:, None] * (W + C) + W +
                                np.arange(C)).astype(np.int32)
        self.slot_locs = np.tile(self._slot_layout, (L, 1, 1))
        self.tables = SimpleNamespace(slot_locs=self.slot_locs)  # the cache's face: .tables
        self.layer_state = [dict(slot_tokens=np.full((R, W), -1, np.int32),
                            slot_locs=self.slot_locs[layer],
                            lru=np.tile(np.arange(H, dtype=np.int16), (R, 1)),
                            scratch_locs=self._scratch_layout.copy(),
                            ref=np.zeros((R, H), np.uint32),
                            clock=np.tile(np.array([1, 0], np.uint32), (R, 1)))
                       for layer in range(L)]
        self._free = list(range(R))  # a heap: admissions take the lowest free slot, as the cache
        self._len: dict[int, int] = {}

    # the driver reads and writes these through the same calls as on the GPU
    def device_rows(self, layer):
        return self.device[layer]

    def _reset(self, rid):
        for t in self.layer_state:
            t["slot_tokens"][rid] = -1
            t["slot_locs"][rid] = self._slot_layout[rid]
            t["lru"][rid] = np.arange(self.hot_size)
            t["scratch_locs"][rid] = self._scratch_layout[rid]
            t["ref"][rid] = 0
            t["clock"][rid] = (1, 0)

    def admit(self, n_tokens, kv=None, warm_tokens=None, *, prefix=None, stream=None):
        """``prefix=(parent, p)``: the first ``p`` tokens are the parent's (their bytes are
        copied: the model keeps the slot layout, where the GPU shares whole pages); ``kv``
        holds the rest."""
        if not self._free:
            raise RuntimeError("all request slots are in use")
        n, H = int(n_tokens), self.hot_size
        if n <= H and warm_tokens is not None:
            raise ValueError("warm_tokens applies only to requests longer than hot_size")
        p = 0
        if prefix is not None:
            parent, p = int(prefix[0]), int(prefix[1])
            if parent not in self._len or not 1 <= p <= n or \
                    (self.host_locs[parent, :p] < 0).any():  # every token written
                raise ValueError(f"prefix {prefix}")
        rid = heapq.heappop(self._free)
        base = rid * self.max_len
        if p:
            self.host[:, base: base + p] = self.host[:, self.host_locs[parent, :p]]
        if kv is not None:
            self.host[:, base + p: base + n] = kv
        self.host_locs[rid, :n] = base + np.arange(n)
        self.host_locs[rid, n:] = -1
        self._reset(rid)
        if n <= H:
            slots = tokens = np.arange(n)
            for t in self.layer_state:
                t["slot_tokens"][rid, :H] = np.arange(H)
        else:
            warm = np.zeros(0, np.int64) if warm_tokens is None else np.asarray(warm_tokens)
            w = warm.size
            for t in self.layer_state:
                t["slot_tokens"][rid, :w] = warm
                t["slot_tokens"][rid, H] = n - 1
                t["lru"][rid] = np.concatenate([np.arange(w, H), np.arange(w)])
            slots = np.concatenate([np.arange(w), [H]]).astype(np.int64)
            tokens = np.concatenate([warm, [n - 1]]).astype(np.int64)
        rows = self._slot_layout[rid, slots]
        self.device[:, rows] = self.host[:, base + tokens]
        self._len[rid] = n
        return rid

    def grow(self, rid, n_tokens, *, stream=None):
        if not (rid in self._len and 1 <= n_tokens <= self.max_len):
            raise ValueError(f"grow({rid}, {n_tokens})")

    def write_host(self, rid, start, kv, *, stream=None):
        n = kv.shape[1]
        base = rid * self.max_len + start
        self.host[:, base: base + n] = kv
        self.host_locs[rid, start: start + n] = base + np.arange(n)
        for t in self.layer_state:  # hot copies of rewritten tokens are stale (the cache's rule)
            st = t["slot_tokens"][rid, : self.hot_size]  # (slot p holding token p: in place)
            st[(st >= start) & (st < start + n) & (st != np.arange(self.hot_size))] = -1

    def release(self, rid, *, stream=None):
        self._reset(rid)
        self.host_locs[rid] = -1
        del self._len[rid]
        heapq.heappush(self._free, rid)

    def mirror_layer(self, src, dst, *, rows=True, stream=None):
        if rows and src != dst:
            ref.mirror_layer(self.layer_state[src], self.layer_state[dst], host_locs=self.host_locs,
                             dst_device=self.device[dst], dst_host=self.host[dst])
        else:
            for name, t in self.layer_state[src].items():
                self.layer_state[dst][name][...] = t

    def begin_step(self, req_indices, seq_lens, num_real=None, *, stream=None, pdl=None,
                   prefetcher=None):
        return ModelStep(self, req_indices, seq_lens, num_real, prefetcher)

    def close(self):
        pass

    # one swap of one layer: outputs, and the plan (host row, device row pairs per row)
    def _swap(self, layer, topk, req, lens, nr):
        t = self.layer_state[layer]
        n_host = self.host.shape[1]
        if topk.ndim == 2:
            r = ref.swap_in(topk, req, lens[:, 0], host_locs=self.host_locs,
                            slot_tokens=t["slot_tokens"], slot_locs=t["slot_locs"],
                            lru=t["lru"], hot_size=self.hot_size, n_host_rows=n_host,
                            num_real=nr)
            out, src, dst, cnt = r.device_locs, r.plan_src, r.plan_dst, r.plan_count
        else:
            S = topk.shape[1]
            args = dict(host_locs=self.host_locs, hot_size=self.hot_size, n_host_rows=n_host,
                        num_real=nr)
            dry = ref.multistep_swap_in(topk, req, lens[:, :S], **args,
                                        **copy.deepcopy(_ms_tables(t)))
            order = [self.rng.permutation(np.asarray(m, np.int64)) for m in dry.misses]
            r = ref.multistep_swap_in(topk, req, lens[:, :S], **args, **_ms_tables(t),
                                      miss_order=order)
            out, src, dst, cnt = r.device_locs, r.plan_src, r.plan_dst, r.plan_count
        plan = [(src[b, : cnt[b]], dst[b, : cnt[b]]) for b in range(len(cnt))]
        self._copy(layer, plan)
        return out, plan

    def _copy(self, layer, plan):
        for src, dst in plan:
            keep = (src >= 0) & (dst >= 0)
            self.device[layer, dst[keep]] = self.host[layer, src[keep]]


def _ms_tables(t):
    return dict(slot_tokens=t["slot_tokens"], slot_locs=t["slot_locs"],
                scratch_locs=t["scratch_locs"], ref=t["ref"], clock=t["clock"])


class ModelStep:
    def __init__(self, cache, req, lens, num_real, prefetcher):
        self.cache = cache
        self.req = np.asarray(req).astype(np.int64)
        lens = np.asarray(lens).astype(np.int64)
        self.lens = lens.reshape(len(self.req), -1)
        self.batch = len(self.req)
        self.nr = self.batch if num_real is None else int(np.asarray(num_real).reshape(-1)[0])
        self.prefetcher = prefetcher

    def _real(self):
        c = self.cache
        for b in range(min(max(self.nr, 0), self.batch)):
            rid, seq = int(self.req[b]), int(self.lens[b, 0])
            if 0 <= rid < c.max_requests and 1 <= seq <= c.max_len:
                yield b, rid, seq - 1

    def newest_rows(self, *, backup=False, write_host=True):
        c = self.cache
        rows = np.full(self.batch, -1, np.int32)
        for b, rid, t in self._real():
            slot = min(t, c.hot_size)
            rows[b] = c.layer_state[0]["slot_locs"][rid, slot]
            if backup:
                c.host_locs[rid, t] = rid * c.max_len + t
                if slot == c.hot_size:
                    for tb in c.layer_state:
                        tb["slot_tokens"][rid, slot] = t
                        hot = tb["slot_tokens"][rid, : c.hot_size]
                        hot[hot == t] = -1  # a rejected draft's copy (the cache's rule)
                if write_host:
                    c.host[:, rid * c.max_len + t] = c.device[:, rows[b]]
        return rows

    def backup_newest(self, *, write_host=True):
        self.newest_rows(backup=True, write_host=write_host)

    def before_indexer(self, layer):
        if self.prefetcher is not None:
            self.prefetcher.before_indexer(layer)

    def swap(self, layer, top_k_tokens, *, out=None, copy_grid=None, check=False):
        if check:
            raise NotImplementedError("the model does not implement check=")
        if self.prefetcher is not None:
            if out is not None or copy_grid is not None:
                raise ValueError("out= and copy_grid= do not apply to a step driven by a "
                                 "prefetcher")
            return self.prefetcher.swap_step(self, layer, top_k_tokens)
        return self.cache._swap(layer, np.asarray(top_k_tokens), self.req, self.lens,
                                self.nr)[0]

    def finish(self):
        if self.prefetcher is not None:
            self.prefetcher.finish()


class ModelPrefetcher:
    def __init__(self, cache, pattern, *, enabled=True, predict=False, **_):
        self.cache = cache
        self.pattern = layer_pattern(pattern)
        self._enabled = bool(enabled)
        self._anchor = None
        self.predict = bool(predict)

    @property
    def enabled(self):
        return self._enabled

    def set_enabled(self, enabled, stream=None):
        enabled = bool(enabled)
        if enabled == self._enabled:
            return
        for a, group in self.pattern.groups.items():
            for sl in group:
                self.cache.mirror_layer(a, sl, rows=enabled)
        self._enabled = enabled
        self._anchor = None

    def set_predict(self, on, stream=None, *, at=None):
        self.predict = bool(on)  # it changes where bytes are read from, never which bytes

    def before_indexer(self, layer, stream=None):  # (when staging runs: no byte changes)
        if not self.pattern.full[layer]:
            raise ValueError(f"layer {layer} is a shared layer: it runs no indexer")

    def finish(self, stream=None):
        self._anchor = None

    def swap_step(self, step, layer, top_k_tokens=None):
        c = self.cache
        if self.pattern.full[layer]:
            topk = np.asarray(top_k_tokens)
            out, plan = c._swap(layer, topk, step.req, step.lens, step.nr)
            self._anchor = (layer, topk, out, plan)
            return out
        a, topk, out, plan = self._anchor
        if a != self.pattern.anchor(layer):
            raise RuntimeError(f"shared layer {layer} called before its full layer")
        if self._enabled:
            c._copy(layer, plan)  # the replay of the full layer's plan
            return out
        return c._swap(layer, topk, step.req, step.lens, step.nr)[0]
