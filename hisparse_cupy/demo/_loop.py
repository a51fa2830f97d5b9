"""The decode loop on the GPU: one mode (gpu-only, offload, overlap, predict), eager or
graph-captured.

Per step (DESIGN's request lifecycle): the newest token's KV of every layer is written into its
device row (``step.newest_rows()``) and backed up to the host pool (``step.backup_newest()``,
queued before any swap that could miss on it); the step's input goes through the first query
projection; then per layer: a full layer's indexer (its cost, :class:`~._model.Indexer`, then
its row of the pre-generated lru top-k, or a drifting top-k), the swap-in (or, for a shared
layer with overlap, the wait on its side-stream replay), the sparse attention over the
returned device rows and the matmuls. Everything is queued on one non-blocking stream; the step
index and sequence lengths live on the device, so one captured step replays for every step.
"""

from __future__ import annotations

import dataclasses
import time

import cupy
import numpy as np

from .._abi import LC_MISSES
from .._cli.usage import UsageError
from .._kernels.launch import ptr
from ..cache import HotBufferCache
from ..streams import Prefetcher
from ._config import DEVICE_PAGE, PAGE_TOKENS, Config
from ._model import Indexer, Kernels, Model, prompt_kv


@dataclasses.dataclass
class RunResult:
    mode: str
    exec: str
    step_ms: np.ndarray  # per timed step
    digest: np.ndarray  # uint64 [total_steps, L]: every layer's attention output, hashed
    rows_moved: np.ndarray  # per timed step: rows copied host -> device (all layers)
    misses: np.ndarray  # per timed step: misses of the full layers' swaps
    swap_call_us: float | None  # eager: mean Python time of one step.swap call, measured in
    # warm-up steps 1.. that start on an idle stream (so no launch waits for queue space)
    # offloaded runs: the cache's device counters over every step (LayerCounters.latest()),
    # with "full" (the full-layer mask) and "batch" for the self-check
    counters: dict | None = None
    predict: dict | None = None  # predict mode: Prefetcher.predict_summary() over every step
    resident: int | None = None  # offloaded runs with a device budget: requests resident
    lean: bool | None = None  # offloaded runs: whether the steps ran lean (Step.lean)


def coprime(n: int) -> int:
    """A multiplier near n / phi with gcd(a, n) = 1 (x -> a x mod n is a bijection)."""
    a = max(2, int(n * 0.6180339887))
    while np.gcd(a, n) != 1:
        a += 1
    return a


class Rig:
    """Buffers shared by every mode, and the per-mode state (resident KV or cache).

    ``cfg.resident_layers`` = R: layers ``0..R-1`` attend over GPU-resident KV in every mode
    (:attr:`low` in the offloaded ones); the cache holds layers ``R..`` (local index
    ``layer - R``) and its prefetcher runs on the pattern's stage from layer R.

    ``pool``: a host pool to put the caches over (e.g. one shared by tensor-parallel ranks,
    ``HostKVPool.attach``), in the slot layout (``write_pool``: whether this process writes
    its prompt rows, one writer per shared pool; the others must wait for it before their
    first offloaded run), or ``paged`` (its rows :meth:`paged_rows`; every process admits its
    requests with the KV it makes, as without a pool).
    ``tp``: see :class:`Model`. ``backup``: what an offloaded step does with its newest
    rows once the model wrote them, ``backup(step)``; default ``step.backup_newest()`` (a
    tensor-parallel rank that leaves the backup to another rank waits for it there instead).
    ``admission``: how requests get their prompts in a paged pool, ``admission(rig)`` called
    once the cache exists, returning an object whose ``admit_all()`` admits every request at
    its prompt (slots ``0..batch-1``, as :meth:`admit_all`) and whose ``close()`` runs before
    the cache closes (``examples/pd_decode.py``: the prompts arrive over NIXL); default
    :meth:`admit_all`.
    """

    def __init__(self, cfg: Config, stream: cupy.cuda.Stream, log, *, pool=None,
                 write_pool: bool = True, tp=None, backup=None, partition=None,
                 admission=None, paged: bool | None = None):
        self.cfg, self.s, self.log = cfg, stream, log
        self.partition = partition  # an SMPartition (stream is its main group's) or None
        self.pool, self.write_pool = pool, write_pool
        self.paged = pool is None if paged is None else bool(paged)
        self.admission, self._admission = admission, None
        self.backup = backup or (lambda st: st.backup_newest())
        self.pool_ready = False
        self.pattern = cfg.pattern_obj()
        self.full = self.pattern.full
        self.groups = self.pattern.groups
        # layers 0 .. R-1 keep their KV on the GPU in every mode; the cache holds the rest
        self.R = R = cfg.resident_layers
        self.cached = range(R, cfg.layers)
        if R and (admission is not None or pool is not None and
                  getattr(pool, "n_layers", None) != cfg.layers - R):
            raise UsageError("demo: --resident-layers needs a host pool of the cached layers "
                             "alone (a given pool or admission hook holds every layer): "
                             "--resident-layers 0")
        self.k = Kernels()
        with stream:
            self.model = Model(self.k, queries=cfg.queries, top_k=cfg.top_k, hidden=cfg.hidden,
                               n_layers=cfg.layers, stream=stream, tp=tp,
                               sms=None if partition is None else partition.main_sms,
                               matmul=cfg.matmul, fp8=cfg.fp8)
            B, S, K = cfg.batch, cfg.mtp, cfg.top_k
            self.indexer = Indexer(self.k, n_full=len(self.pattern.full_layers), slots=B,
                                   max_len=cfg.max_len, queries=cfg.queries, drafts=S,
                                   stream=stream) if cfg.indexer else None
            self.req = cupy.arange(B, dtype=cupy.int32)  # request slot b (the cache's rids too)
            self.lens = cupy.empty(B, cupy.int32)
            self.step_ctr = cupy.zeros(1, cupy.int32)
            self.topk = cupy.empty((B, S, K), cupy.int32)
            self.locs = cupy.empty((B, S, K), cupy.int32)
            self.digest = cupy.zeros((cfg.total_steps, cfg.layers), cupy.uint64)
            self.moved = cupy.zeros((cfg.total_steps, 2), cupy.uint64)
            # the tally's weights per cached layer: offload, every layer moves its own misses;
            # replays, a full layer's misses move once more for each shared layer it serves
            # (whose own counters stay zero)
            full = [self.full[layer] for layer in self.cached]
            self.full_dev = cupy.asarray(np.array(full, np.int32))
            self.weight = [cupy.ones(len(full), cupy.int32), cupy.asarray(np.array(
                [1 + len(self.groups.get(layer, ())) if self.full[layer] else 1
                 for layer in self.cached], np.int32))]
        self.U = cfg.context
        self.a = np.int64(coprime(self.U))
        self.M = max(1, round(cfg.new_share * K))
        self.salt = {layer: (1_000_003 * j) % self.U
                     for j, layer in enumerate(self.pattern.full_layers)}
        self.full_rank = {layer: j for j, layer in enumerate(self.pattern.full_layers)}
        self.table = self.topk_shape = None
        if cfg.topk_model == "lru":
            self._generate()
        self._structs()
        self.resident = self.kv_buf = self.low = None
        self.cache = self.pf = None
        self.swap_s = 0.0
        self.swap_n = 0
        self.time_host = False
        self.lean = False  # the last offloaded step ran lean

    def _generate(self) -> None:
        """``--topk-model lru``: every step's top-k of every full layer, made on the CPUs
        before the runs (the same for every mode) and kept on the GPU; each step copies its
        own on the device (:attr:`table`, int32 ``[steps, n_full, B, K]``)."""
        import os

        from ._topk_model import draft_lens, draft_union, generate, shape_for, shape_report

        c = self.cfg
        shape = shape_for(c.step_overlap, c.layer_overlap, c.recent)
        n_full, S = len(self.pattern.full_layers), c.mtp
        lens = draft_lens(c.context, c.total_steps, S, c.batch)  # S draws per decode step
        T = lens.shape[0]
        t0 = time.perf_counter()
        tab, initial = generate(shape, n_full=n_full, top_k=c.top_k, context=c.context,
                                lens=lens, rng=np.random.default_rng(c.seed))
        self.log(f"top-k streams: {T} steps x {n_full} full layers x {c.batch} requests made in "
                 f"{time.perf_counter() - t0:.1f} s ({min(c.batch, os.cpu_count() or 1)} "
                 f"processes)" + (f"; MTP {S}: each call's {S} draft steps are {S} "
                                  f"consecutive draws" if S > 1 else ""))
        self.topk_shape = shape_report(shape, list(tab), initial, c.hot, requests=4,
                                       log=self.log)
        if S > 1:  # what the multi-step swap resolves once
            self.topk_shape["draft_union"] = u = draft_union(tab, S)
            self.log(f"MTP {S}: a call's draft steps select {100 * u:.1f} % distinct tokens "
                     f"of their {S} x {c.top_k} entries")
        with self.s:
            self.table = cupy.asarray(tab)

    def _structs(self) -> None:
        """The step's kernels' structs with their fixed fields (a step sets the rest)."""
        c, k = self.cfg, self.k
        B, S, K = c.batch, c.mtp, c.top_k
        fp8 = bool(c.fp8)
        self._newest = k.kv_newest[fp8]
        self._newest_p = self._newest.params(req=ptr(self.req), lens=ptr(self.lens),
                                             max_len=c.max_len)
        self._table_p = None if self.table is None else k.topk_table.params(
            table=ptr(self.table), n_full=self.table.shape[1], BK=B * K, K=K, S=S,
            step=ptr(self.step_ctr), topk=ptr(self.topk))
        self._drift_p = k.topk_drift.params(
            topk=ptr(self.topk), S=S, K=K, M=self.M, Md=max(1, self.M // 2), U=self.U,
            a=int(self.a), recent=c.recent, step=ptr(self.step_ctr), lens=ptr(self.lens))
        self._direct_p = k.direct_locs.params(topk=ptr(self.topk), req=ptr(self.req), SK=S * K,
                                              max_len=c.max_len, n=B * S * K,
                                              locs=ptr(self.locs))
        self._tally_p = k.tally.params(col=LC_MISSES, full=ptr(self.full_dev),
                                       acc=ptr(self.moved), step=ptr(self.step_ctr))
        self._tick_p = k.tick.params(step=ptr(self.step_ctr), lens=ptr(self.lens), B=B)

    # ------------------------------------------------------------------ state
    def _prefill(self, base: int, layer_bytes: int, reqs=None, p0: int = 0,
                 req_rows: int | None = None, layers: range | None = None) -> None:
        """Prompt KV of positions ``[p0, context)`` of ``layers`` (default all): every
        request's, in the slot layout (rows ``r * max_len + p``), or ``reqs``' with
        ``req_rows=0`` (one request, rows from 0: an admission's KV)."""
        prompt_kv(self.k, self.cfg, base, layer_bytes, self.req if reqs is None else reqs,
                  self.s, p0, self.cfg.max_len if req_rows is None else req_rows, layers)

    @staticmethod
    def paged_rows(c: Config) -> int:
        """Host rows per layer of a paged pool for ``c``: each request's longest in pages, and
        one page more (an admission on received pages copies a partial last page into a page
        of its own before the received one goes back)."""
        return (c.batch * -(-c.max_len // PAGE_TOKENS) + 1) * PAGE_TOKENS

    def admit_all(self) -> list[int]:
        """Every request admitted at its prompt: in a paged pool (the default) with its KV made
        on the GPU and copied into its pages (requests 1.. forked from request 0's first
        ``--shared-prefix`` tokens); in a given pool's slot layout from the rows there."""
        c, s, cache = self.cfg, self.s, self.cache
        res = self.resident_plan()
        if cache.pages is None:
            return self.log_residency([cache.admit(c.context, stream=s, resident=res[b])
                                       for b in range(c.batch)])
        if self.kv_buf is None:
            with s:
                self.kv_buf = cupy.empty((len(self.cached), c.context, c.row_bytes), cupy.uint8)
        buf, N = self.kv_buf, c.shared_prefix
        t0 = cupy.cuda.Event()
        t0.record(s)
        rids, nbytes = [], 0
        for b in range(c.batch):
            p0 = N if b else 0
            if p0 < c.context:  # (a fork of every prompt token has no KV of its own)
                self._prefill(buf.data.ptr, buf[0].nbytes, self.req[b:b + 1], p0, 0,
                              self.cached)
            kv = buf[:, :c.context - p0]
            rids.append(cache.admit(c.context, kv, prefix=(0, N) if p0 else None, stream=s,
                                    resident=res[b]))
            nbytes += kv.size
        t1 = cupy.cuda.Event()
        t1.record(s)
        t1.synchronize()
        ms = cupy.cuda.get_elapsed_time(t0, t1)
        self.log(f"admission: {c.batch} requests, {nbytes / 1e9:.2f} GB of prompt KV made on "
                 f"the GPU and copied into host pages in {ms:.0f} ms ({nbytes / ms / 1e6:.1f} "
                 f"GB/s with the KV kernel)" + (f", requests 1.. sharing request 0's first "
                                                f"{N} tokens" if N else ""))
        return self.log_residency(rids)

    def resident_plan(self) -> list[bool | None]:
        """With a device budget: the first k requests resident, the rest sparse, for the
        largest k whose pages (for every token the run grows to) leave a block for each of
        the others (``DeviceBudget.rows_needed``); without one, None each."""
        c, b = self.cfg, self.cache.residency.budget
        if b is None:
            return [None] * c.batch
        k = max(0, b.max_resident([c.max_len] * c.batch, b.n_rows,
                                  page_tokens=b.page_tokens, block_rows=b.block_rows))
        return [i < k for i in range(c.batch)]

    def log_residency(self, rids: list[int]) -> list[int]:
        """With a device budget: how many requests it holds resident (logged)."""
        b = self.cache.residency.budget
        if b is not None:
            st = [b.state(r) for r in rids]
            gb = b.n_rows * len(self.cached) * self.cfg.row_bytes / 1e9
            self.log(f"device budget: {b.n_rows} rows a layer ({gb:.2f} GB)"
                     f", {st.count('resident')} of {len(rids)} requests resident")
        return rids

    def use_resident(self) -> None:
        """GPU-only mode: every layer's KV resident on the GPU (rows ``r * max_len + p``)."""
        c = self.cfg
        self.free_cache()
        if self.resident is None:
            t0 = time.perf_counter()
            self.resident = self._resident_kv(c.layers)
            self.log(f"gpu-only: {self.resident.nbytes / 1e9:.1f} GB of KV written on the GPU "
                     f"in {time.perf_counter() - t0:.1f} s")

    def free_resident(self) -> None:
        if self.resident is not None:
            self.s.synchronize()
            self.resident = None
            cupy.get_default_memory_pool().free_all_blocks()

    def use_cache(self) -> None:
        """Offloaded modes: the full KV in the pinned host pool, hot buffers on the GPU."""
        c = self.cfg
        self.free_resident()
        if self.cache is None:
            t0 = time.perf_counter()
            if not self.paged and (c.shared_prefix or self.admission is not None):
                raise UsageError("demo: --shared-prefix and an admission hook need a paged "
                                 "host pool; this one is in the slot layout")
            paged = {} if not self.paged else {"page_tokens": PAGE_TOKENS} \
                if self.pool is not None else \
                {"page_tokens": PAGE_TOKENS, "pool_rows": self.paged_rows(c)}
            # rows per cached layer; auto: what the free memory holds past the resident
            # layers' KV (made after the cache)
            free = cupy.cuda.runtime.memGetInfo()[0] - self.R * c.batch * c.max_len * c.row_bytes
            rows = c.budget_rows(len(self.cached), free)
            if rows is not None:
                paged.update(device_budget=rows, device_page=DEVICE_PAGE)
            self.cache = HotBufferCache(n_layers=len(self.cached), max_requests=c.batch,
                                        max_len=c.max_len, row_bytes=c.row_bytes, hot_size=c.hot,
                                        top_k=c.top_k, extra_page=c.extra_page,
                                        max_steps=c.mtp, pool=self.pool, **paged)
            t1 = time.perf_counter()
            pool = self.cache.pool
            if not self.paged and self.pool is not None and self.write_pool and \
                    not self.pool_ready:
                self._prefill(int(pool.device_ptr(0)), pool.layer_bytes,  # the GPU writes it
                              layers=self.cached)
                self.s.synchronize()
                self.pool_ready = True
            pattern = self.pattern.stage(self.R, c.layers) if self.R else self.pattern
            self.pf = Prefetcher(self.cache, pattern, partition=self.partition,
                                 predict_rule=c.predict_rule, replay_grid=c.replay_grid,
                                 replay_rows_per_warp=c.replay_rows_per_warp,
                                 group_replay_batch=c.group_replay_batch,
                                 predict_at=c.predict_at)
            self.log(f"side streams: replays and staging on {self.pf.replay_grid} blocks, "
                     f"{self.pf.replay_rows_per_warp} rows in flight per warp; "
                     + ("a group's replays in one launch, one wait"
                        if self.pf.replays_whole_groups(c.batch) else
                        "one replay and one wait per shared layer")
                     + f" (group_replay_batch {self.pf.group_replay_batch})")
            if self.admission is not None:
                self._admission = self.admission(self)
            how = ("given, " if self.pool is not None else "") + (
                f"paged ({PAGE_TOKENS} tokens a page), pinned" if self.paged else "slot layout")
            self.log(f"offload: {pool.n_layers * pool.layer_bytes / 1e9:.1f} GB host pool "
                     f"{how} in {t1 - t0:.1f} s" + ("" if self.pool is None or self.paged else
                     f", {'written' if self.write_pool else 'not written here'} in "
                     f"{time.perf_counter() - t1:.1f} s"))
        if self.R and self.low is None:
            self.low = self._resident_kv(self.R)

    def _resident_kv(self, n: int) -> cupy.ndarray:
        """Layers ``0..n-1``' KV on the GPU in the slot layout, every prompt written."""
        c = self.cfg
        with self.s:
            kv = cupy.empty((n, c.batch * c.max_len, c.row_bytes), cupy.uint8)
        self._prefill(kv.data.ptr, kv[0].nbytes, layers=range(n))
        self.s.synchronize()
        return kv

    def free_cache(self) -> None:
        if self.cache is not None:
            self.s.synchronize()
            self.pf.synchronize()
            admission, self._admission = self._admission, None
            try:
                if admission is not None:
                    admission.close()
            finally:
                self.cache.close()
            self.cache = self.pf = self.low = None
            cupy.get_default_memory_pool().free_all_blocks()

    def reset(self, mode: str) -> None:
        """Every request back at its prompt (cold hot buffers), step 0, outputs cleared."""
        c, s = self.cfg, self.s
        if mode != "gpu-only":
            cache, pf = self.cache, self.pf
            pf.finish(s)
            pf.set_enabled(mode in ("overlap", "predict"), stream=s)
            pf.set_predict(mode == "predict", stream=s)
            if pf.predict:
                with s:
                    pf.predict_stats.fill(0)
            cache.counters.reset(s)
            for rid in list(cache.active):
                cache.release(rid, stream=s)
            rids = (self.admit_all() if self._admission is None else
                    self._admission.admit_all())
            # batch row b is request slot b in every mode (a KV row is a function of the slot)
            if sorted(rids) != list(range(c.batch)):
                raise RuntimeError(f"unexpected request slots {rids}")
        with s:
            self.lens.fill(c.context)
            self.step_ctr.fill(0)
            self.digest.fill(0)
            self.moved.fill(0)
        self.swap_s, self.swap_n = 0.0, 0

    # ------------------------------------------------------------------ one step
    def step(self, mode: str) -> None:
        c, s, k, m = self.cfg, self.s, self.k, self.model
        B, S, K = c.batch, c.mtp, c.top_k
        gpu_only, R = mode == "gpu-only", self.R
        res = self.resident if gpu_only else self.low  # layers 0 .. (all or R) - 1
        newest, newest_p = self._newest, self._newest_p
        if res is not None:  # the slot layout's rows (rows: null)
            newest((B, res.shape[0]), newest_p.set(base=res.data.ptr, layer_bytes=res[0].nbytes,
                                                   rows=0, first=0), s)
        if not gpu_only:
            cache = self.cache
            st = cache.begin_step(self.req, self.lens, stream=s, prefetcher=self.pf,
                                  lean=None if c.lean else False)
            self.lean = st.lean
            rows = st.newest_rows()  # the model writes this step's KV there
            dev = cache.device
            newest((B, len(self.cached)), newest_p.set(base=dev.data.ptr,
                                                       layer_bytes=dev[0].nbytes,
                                                       rows=rows.data.ptr, first=R), s)
            self.backup(st)  # before any later swap that may select these tokens
        m.start(self.step_ctr)
        if self.indexer is not None:
            self.indexer.query(self.step_ctr)
        topk = self.topk if S > 1 else self.topk.reshape(B, K)
        locs = self.locs if S > 1 else self.locs.reshape(B, K)
        for layer in range(c.layers):
            if self.full[layer] and not gpu_only and layer >= R:  # its top-k is computed next
                st.before_indexer(layer)
            if self.full[layer] and self.indexer is not None:  # scores every token it holds
                self.indexer.score(self.full_rank[layer], self.req, self.lens)
            if self.full[layer] and self.table is not None:
                n = B * S * K  # draft s of step t: the table's step t * S + s
                k.topk_table((-(-n // 256),), self._table_p.set(j=self.full_rank[layer]), s)
            elif self.full[layer]:
                k.topk_drift((-(-K // 256), B * S), self._drift_p.set(salt=self.salt[layer]), s)
            direct = gpu_only or layer < R
            if self.full[layer] and direct:
                n = B * S * K
                k.direct_locs((-(-n // 256),), self._direct_p, s)
            if direct:
                out, rows = locs, res[layer]
            elif self.time_host:
                t0 = time.perf_counter()
                out = st.swap(layer, topk)
                self.swap_s += time.perf_counter() - t0
                self.swap_n += 1
            else:
                out = st.swap(layer, topk)
            if not direct:
                rows = cache.device[layer - R]
            m.layer(out, rows, layer, self.digest, self.step_ctr, last=layer == c.layers - 1)
        if not gpu_only:
            st.finish()
            ctr = cache.counters.device  # the step's rows moved and misses, from its counters
            k.tally((1,), self._tally_p.set(counters=ctr.data.ptr, n_layers=ctr.shape[0],
                                            stride=ctr.shape[1],
                                            weight=self.weight[mode != "offload"].data.ptr), s)
        k.tick((1,), self._tick_p, s)

    # ------------------------------------------------------------------ one mode
    def run(self, mode: str, exec_: str, progress) -> RunResult:
        c, s = self.cfg, self.s
        (self.use_resident if mode == "gpu-only" else self.use_cache)()
        self.reset(mode)
        n = c.total_steps
        ev = [cupy.cuda.Event() for _ in range(n + 1)]
        graph = None
        every = max(1, n // 10)
        t0 = time.perf_counter()
        grow = self.cache is not None and self.cache.pages is not None
        for i in range(n):
            if grow:  # the newest token's page, taken before the step (replay) writes it
                for rid in range(c.batch):
                    self.cache.grow(rid, c.context + i, stream=s)
            ev[i].record(s)
            if graph is not None:
                graph.launch(s)
            else:
                # eager warm-up steps 1.. start on an idle stream: their host time per swap
                # call is the Python overhead alone (later, launches wait for queue space)
                self.time_host = exec_ == "eager" and 1 <= i < c.warmup
                if self.time_host:
                    s.synchronize()
                self.step(mode)
                self.time_host = False
                if exec_ == "graph":  # step 0 ran eagerly (kernels loaded): capture the step
                    s.begin_capture()
                    try:
                        self.step(mode)
                    finally:
                        graph = s.end_capture()
            if progress and (i + 1) % every == 0:
                progress(f"  {mode} {exec_}: step {i + 1}/{n} queued, "
                         f"{time.perf_counter() - t0:.1f} s")
        ev[n].record(s)
        ev[n].synchronize()
        w = c.warmup
        step_ms = np.array([cupy.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(w, n)])
        moved = np.diff(cupy.asnumpy(self.moved).astype(np.int64), axis=0,
                        prepend=np.zeros((1, 2), np.int64))  # the tally's totals, per step
        swap_us = None
        if exec_ == "eager" and self.swap_n:
            swap_us = 1e6 * self.swap_s / self.swap_n
        ctr = pred = None
        if mode == "predict":
            pred = self.pf.predict_summary()
        if mode != "gpu-only":
            ctr = {**self.cache.counters.read(s),
                   "full": np.asarray(self.full[self.R:], bool), "batch": c.batch}
        b = None if mode == "gpu-only" else self.cache.residency.budget
        resident = None if b is None else sum(b.state(r) == "resident" for r in range(c.batch))
        return RunResult(mode, exec_, step_ms, cupy.asnumpy(self.digest),
                         moved[w:, 0], moved[w:, 1], swap_us,
                         ctr, pred, resident, None if mode == "gpu-only" else self.lean)

    def close(self) -> None:
        self.free_cache()
        self.free_resident()
        self.model.close()
