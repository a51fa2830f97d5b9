"""Randomized step-level test: drive the step API as an engine would, check every byte.

One run (a seed) draws a cache configuration (layers, a full/shared pattern and often a
Prefetcher, request slots, H, K, P, max_steps, row bytes, and on the GPU mostly a paged host
pool of 1-16 tokens a page, its pages handed out in random order) and then decode steps:

- on the GPU, often a device budget: requests admitted resident or sparse, demoted, promoted
  and switched between steps, grown with a demotion first where their pages would take the
  room kept for blocks; steps begun lean by default while every request is resident, at times
  ``lean=False`` or ``lean=True`` where it may be, and a graph captured lean captured again once
  a request is not resident (docs/overlap_hazards.md, hazard 17);
- lifecycle churn: requests admitted (short ones in positional layout, long ones cold or warm,
  prefill KV from the host or the device; on paged pools often a fork of a live request's
  written prefix, ``admit(prefix=...)``, and at times one past it, which must be refused; on
  the GPU's paged pools at times whole pages the engine took and wrote itself,
  ``admit(pages=...)``, as prefill KV arriving over NIXL lands, resident or sparse under a
  budget, the engine's hold dropped after the admission) and released at random, slots reused;
  on paged pools requests grown ahead of their steps;
- per step a random batch (real rows then graph-style padding rows with garbage slots and
  lengths past ``num_real``), its pages grown first (``grow``), lengths ``[B]`` or per draft
  step ``[B, S]`` (equal, or ``L, L+1, ...`` with the draft tokens' host rows written
  first), the newest token's KV written where ``step.newest_rows()`` says and backed up;
- per full layer a single-step ``[B, K]`` or multi-step ``[B, S, K]`` top-k (tokens it held,
  new ones, the newest and draft tokens in every step, duplicates, -1, out-of-range entries);
  shared layers through the Prefetcher;
- prefetch and prediction toggled between steps, prediction staging right after a full layer's
  swap or at the next full layer's ``before_indexer`` (called before most full layers, at times
  for another full layer, and refused for a shared one), a group's replays in one launch or
  layer by layer as the step's batch decides (``group_replay_batch`` drawn per run), any stream
  kind per call, with no synchronization and no event of the fuzz's own between calls on
  different streams (admissions, releases, growth, moves and steps are ordered only by the
  library's own events: ``docs/design.md`` section 9), on the GPU a call's stream at times held
  busy first (its work lands late, after later calls' work on other streams), one step in ten
  with CuPy's current stream another one held busy (every call must queue what it needs on the
  stream it is given), and captured steps replayed with new batches and ``num_real`` (captured
  in CuPy's relaxed mode or torch's global one, at times with a host pool collected unclosed
  inside the capture: the collector runs where it likes);
- on the GPU, prefill and draft KV at times made on another stream than the call's and dropped
  right after the call, its memory reused at once by a new array on that stream (the call must
  hold what it still reads); promotions cancelled mid-fill (demoted or released at once,
  the fill held back behind a busy stream), their pages taken by the next growth; moves asked
  at times with a token count, right or off by one either way (refused: the cache counts
  the written tokens itself); ``write_host`` at times past the tokens the device budget counts
  (refused: grow first).

After every step every output entry is checked: -1 exactly where the semantics say (padding
rows and columns, -1, out of range), a row elsewhere, one row per token within a call, and the
row's bytes equal to the pattern of (layer, request instance, token), so a stale row of a
slot's previous request is caught too. Counters stay on the device; the host reads them every
``sync_every`` steps. The CPU part runs the same driver on ``_stepmodel`` (NumPy).

    python tests/_stepfuzz.py --steps 100000 --procs 8 --json out.json   # the GPU run
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np

from hisparse_cupy import PoolExhausted
from hisparse_cupy.testing.selfcheck import pattern

VERSION_SHIFT = 40  # a draft's version, above every token's pattern id (uid * max_len + token)
CHECKS = ("missing row", "two rows for one token", "wrong bytes", "row for an invalid entry",
          "newest row")


def draw_config(rng, budget: bool = False) -> dict:
    """One run's cache configuration; ``budget``: a device budget whatever the draw (on the
    GPU; otherwise about half the runs have one)."""
    H = int(rng.choice([16, 32]))
    K = int(rng.choice([4, 8, H // 2]))
    L = int(rng.integers(2, 5))
    pats = {2: ["FS", "FF"], 3: ["FSS", "FFS", "FSF"], 4: ["FSSS", "FSFS", "FFSS", "FSSF"]}[L]
    return dict(n_layers=L, max_requests=int(rng.integers(2, 5)), hot_size=H, top_k=K,
                extra_page=int(rng.choice([1, 2, 4])), max_steps=int(rng.choice([1, 2, 3, 4])),
                row_bytes=int(rng.choice([16, 32, 64])), max_len=int(H * rng.choice([4, 8])),
                pattern=str(rng.choice(pats)), prefetch=bool(rng.random() < 0.75),
                page_tokens=None if rng.random() < 0.4 else int(rng.choice([1, 3, 8, 16])),
                # GPU: a device budget, a share of what every request resident would take
                device_budget=None if rng.random() < 0.5 and not budget else
                float(rng.choice([0.25, 0.6, 1.2])),
                device_page=int(rng.choice([4, 8, 16])))


def _band(rng) -> tuple[float, float]:
    """The default policy's watermarks: none (1.0, 1.0) half the time, else a band in [0, 1]."""
    if rng.random() < 0.5:
        return (1.0, 1.0)
    low = float(rng.random())
    return (low, low + float(rng.random()) * (1.0 - low))


class Backend:
    """What differs between the GPU and the model: arrays, objects, streams, graphs."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        if gpu:
            import cupy

            self.xp = cupy
        else:
            self.xp = np
        if gpu:
            import cupy

            from _util import stream_kinds

            self.streams = stream_kinds(cupy, every=True)
            self.busy = cupy.cuda.Stream(non_blocking=True)  # CuPy's current one, at times
        else:
            self.streams = [("none", None, None)]

    def cache(self, cfg: dict, seed: int, busy_stream: bool):
        keys = ("n_layers", "max_requests", "max_len", "row_bytes", "hot_size", "top_k",
                "extra_page", "max_steps")
        kw = {k: cfg[k] for k in keys}
        if not self.gpu:
            from _stepmodel import ModelCache

            return ModelCache(**kw, seed=seed)
        import cupy

        from hisparse_cupy import HotBufferCache

        from _util import spin

        if cfg.get("page_tokens"):
            kw["page_tokens"] = cfg["page_tokens"]
        if cfg.get("device_budget"):  # a block for every request slot, then a share of the rest
            page = cfg["device_page"]
            block = HotBufferCache.rows_needed(
                max_requests=1, hot_size=kw["hot_size"], top_k=kw["top_k"],
                extra_page=kw["extra_page"], max_steps=kw["max_steps"])
            R = kw["max_requests"]
            kw["device_budget"] = R * (block + page) + int(cfg["device_budget"] * R *
                                                           kw["max_len"])
            kw["device_page"] = page
        if busy_stream:  # construction queued behind a long kernel on a non-blocking stream
            busy = cupy.cuda.Stream(non_blocking=True)  # (defect C)
            with busy:
                spin(cupy, 200_000_000)
                c = HotBufferCache(**kw)
        else:
            c = HotBufferCache(**kw)
        if c.pages is not None:  # pages handed out in random order: no row where the slot
            got = c.pages.take(c.pages.free_pages)  # layout would have it
            c.pages.put(np.random.default_rng(seed).permutation(got))
        if c.residency.budget is not None:  # the default policy's hysteresis (0: none)
            g = np.random.default_rng(seed + 1)
            c.residency.budget.cooldown = int(g.integers(0, 4))
            c.residency.budget.watermarks = _band(g)
        return c

    def prefetcher(self, cache, pattern: str, rule: str, group: int, at: str):
        if not self.gpu:  # (the stager's rule and the replays' launches move no byte: the
            # model has neither)
            from _stepmodel import ModelPrefetcher

            return ModelPrefetcher(cache, pattern)
        from hisparse_cupy.streams import Prefetcher

        return Prefetcher(cache, pattern, predict_rule=rule, group_replay_batch=group,
                          predict_at=at)


class Fuzz:
    """One seeded run over one cache (see the module docstring)."""

    def __init__(self, gpu: bool, seed: int, cfg: dict | None = None, *, graphs: bool = True,
                 sync_every: int = 200, detail: bool = False, record: str | None = None,
                 budget: bool = False):
        self.seed = seed
        # record: a flight recorder (GPU, no synchronization): every step's tables, outputs
        # and error counts kept on the device; the steps around the first bad one are written
        # to this JSON path when the run fails
        self.record, self.tape = record, []
        # detail: every check also read on the host (synchronizes), and the first offending
        # entries described (the call, the row, the token, its rows, where the tables hold it)
        self.detail, self.details, self.kind = detail, [], "eager"
        self.rng = rng = np.random.default_rng(seed)
        self.cfg = cfg = dict(cfg or draw_config(rng, budget))
        self.be = be = Backend(gpu)
        self.xp = be.xp
        self.c = be.cache(cfg, seed, busy_stream=gpu and rng.random() < 0.5)
        c = self.c
        self.L, self.R, self.H = cfg["n_layers"], cfg["max_requests"], cfg["hot_size"]
        self.K, self.P, self.S = cfg["top_k"], cfg["extra_page"], cfg["max_steps"]
        self.max_len, self.row = cfg["max_len"], cfg["row_bytes"]
        self.rows_per_request = c.rows_per_request
        rule = ("misses", "selection")[int(rng.integers(2))]
        group = int(rng.choice([0, 2, 4, 64]))  # group_replay_batch: batches mix the two ways
        at = ("swap", "indexer")[int(rng.integers(2))]  # when prediction stages
        self.pf = be.prefetcher(c, cfg["pattern"], rule, group, at) if cfg["prefetch"] else None
        from hisparse_cupy.streams._pattern import layer_pattern

        self.full = layer_pattern(cfg["pattern"]).full if self.pf else (True,) * self.L
        self.graphs = graphs and gpu
        self.sync_every = sync_every
        self.active: dict[int, list] = {}  # rid -> [uid, n (tokens held, newest n - 1)]
        self.origin: dict[int, list] = {}  # rid -> [(bound, uid)]: tokens a fork shares
        # rid -> {token: version}: drafts written with other bytes than their final ones (a
        # rejected MTP draft's; its position gets its final bytes later: write_host of the next
        # call's drafts, or the newest token's row)
        self.ver: dict[int, dict[int, int]] = {}
        self.grown: dict[int, int] = {}  # rid -> the tokens it has pages for (grown ahead)
        self.uid = 0
        self.hist: dict[int, np.ndarray] = {}  # rid -> tokens selected last
        xp = self.xp
        self.errors = xp.zeros(len(CHECKS), xp.int64)
        self.first_bad = xp.full(1, 2**62, xp.int64)
        self.steps = self.calls = self.graph_steps = self.toggles = self.busy_steps = 0
        self.forks = self.refused_forks = self.moves = 0
        self.lean_steps = self.lean_asked = self.indexer_calls = self.engine_admits = 0
        self.refused_resident = 0  # resident=True without a budget, refused
        self.busy_now = False
        self.holds = self.cancels = self.refused_counts = self.orphans = 0
        self.refused_writes = 0  # write_host past the budget's count, refused
        self.global_captures = 0
        self.rewrites = 0  # draft writes with other bytes than their final ones
        self._freed: list = []  # (stream, shape) of KV arrays dropped after the last call
        self._junk: list = []  # the arrays that reused their memory (kept a while)
        self.kinds_used: set = set()
        self.stream_obj, self.stream = None, None  # the last step's (argument, CuPy view)
        self.stream_name = None
        self._graph = None

    # ------------------------------------------------------------------ streams
    def _pick_stream(self):
        kinds = self.be.streams
        if self.pf is not None and self.pf.enabled:
            kinds = [k for k in kinds if k[0] != "legacy default"]
        if self.busy_now:  # a call given None would take the busy stream: the engine's own
            kinds = [k for k in kinds if k[1] is not None]
        name, obj, view = kinds[int(self.rng.integers(len(kinds)))]
        self.stream_name = name
        self.kinds_used.add(name)
        self.stream_obj, self.stream = obj, view
        self._hold(view)
        return obj, view

    def _hold(self, view, p: float = 0.15) -> None:
        """At times (GPU) hold ``view`` busy for ~0.05-0.5 ms before the next call queues
        there: its work then lands after work queued later on other streams. No event of the
        fuzz's own orders the streams: only the library's may (the engine's rule it follows:
        no synchronization between steps)."""
        if not self.be.gpu or self.rng.random() >= p or view is None:
            return
        import cupy

        from _util import spin

        with view:
            spin(cupy, int(self.rng.integers(100_000, 1_000_000)))
        self.holds += 1

    def _with(self, view):
        import contextlib

        return view if view is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ lifecycle
    def _kv(self, uid: int, start: int, n: int, view, version: int = 0):
        """The KV rows of instance ``uid``'s tokens ``[start, start + n)``: on the host, or on
        the GPU made on ``view`` or (at times) on another stream, complete before the call
        (the engine's own order for its own data). :meth:`_reuse_freed` after the call drops
        it there and reuses its memory at once."""
        xp = self.xp
        ids = uid * self.max_len + np.arange(start, start + n) + (version << VERSION_SHIFT)
        on_device = self.be.gpu and self.rng.random() < 0.5
        mod = xp if on_device else np
        at = view
        if on_device and self.rng.random() < 0.4:
            at = self.be.streams[int(self.rng.integers(len(self.be.streams) - 1))][2]
        with self._with(at if on_device else None):
            kv = mod.stack([pattern(layer, ids, self.row, xp=mod) for layer in range(self.L)])
        if on_device and at is not view:
            at.synchronize()  # made elsewhere: complete before the call reads it
            self._freed.append((at, kv.shape))
        return kv

    def _reuse_freed(self) -> None:
        """The KV arrays the last call was given were dropped by the fuzz (they are the
        callers' to free): new arrays of the same size on the streams they were made on
        reuse their memory at once and overwrite it (zeros)."""
        while self._freed:
            at, shape = self._freed.pop()
            with at:
                self._junk.append(self.xp.zeros(shape, self.xp.uint8))
        del self._junk[:-8]

    def _churn(self) -> None:
        rng, c = self.rng, self.c
        for rid in list(self.active):
            uid, n = self.active[rid]
            if rng.random() < 0.03 or n + self.S + 2 > self.max_len:
                obj, view = self._pick_stream()
                c.release(rid, stream=obj)
                del self.active[rid], self.origin[rid], self.grown[rid]
        top = self.max_len - 2 * self.S - 4  # room to grow
        while len(self.active) < self.R and (not self.active or rng.random() < 0.4):
            obj, view = self._pick_stream()
            H = self.H
            if rng.random() < 0.35:
                n = int(rng.integers(1, H + 1))
            else:
                n = int(rng.integers(H + 1, top))
            fork = None  # (parent, p): a paged pool's fork of a prefix the parent wrote
            if self.cfg.get("page_tokens") and self.active and rng.random() < 0.3:
                parent = int(rng.choice(list(self.active)))
                if rng.random() < 0.2:
                    self._fork_past_written(parent, obj, view)
                p = int(rng.integers(1, min(self.active[parent][1], top - 1) + 1))
                fork, n = (parent, p), max(n, p)
            warm = None
            if n > H and rng.random() < 0.5:
                warm = rng.choice(n - 1, size=int(rng.integers(0, min(H, n - 1) + 1)),
                                  replace=False)
            self.uid += 1
            start = 0 if fork is None else fork[1]
            pages = None  # GPU paged pools: whole pages the engine wrote (PD's admission)
            if fork is None and self.be.gpu and c.pages is not None and rng.random() < 0.25:
                P = c.pages.page_tokens
                pages = self._engine_pages(self.uid, int(rng.integers(0, n // P + 1)))
                start = 0 if pages is None else len(pages) * P
            kv = self._kv(self.uid, start, n - start, view) if n > start else None
            res = {} if pages is None else {"pages": pages}
            if self._budget() is not None:  # resident when its pages leave the blocks' room
                res["resident"] = self._room(self._budget().pages_for(n)) and \
                    rng.random() < 0.8
            elif self.be.gpu and rng.random() < 0.05:  # no budget: resident=True refused
                before = (len(c.active), None if c.pages is None else c.pages.free_pages)
                try:
                    c.admit(n, kv=kv, warm_tokens=warm, prefix=fork, stream=obj,
                            **{**res, "resident": True})
                except ValueError as e:
                    assert "needs a device budget" in str(e), e
                else:
                    raise AssertionError(f"seed {self.seed}: resident=True admitted without "
                                         f"a device budget")
                assert (len(c.active), None if c.pages is None else c.pages.free_pages) == \
                    before, f"seed {self.seed}: a refused admission took something"
                self.refused_resident += 1
                res["resident"] = None if rng.random() < 0.5 else False  # both: sparse
            try:
                rid = c.admit(n, kv=kv, warm_tokens=warm, prefix=fork, stream=obj, **res)
            finally:
                if pages is not None:  # the engine drops its hold (KVReceiver.admit does)
                    c.pages.put(pages)
                del kv
                self._reuse_freed()
            self.engine_admits += pages is not None
            self.active[rid] = [self.uid, n]
            self.ver.pop(rid, None)
            self.grown[rid] = n
            self.origin[rid] = [] if fork is None else self._fork_origin(*fork)
            self.forks += fork is not None
            self.hist[rid] = np.arange(max(0, n - H), n)

    def _engine_pages(self, uid: int, k: int):
        """``k`` pages the engine takes and writes with tokens ``[0, k * P)`` of instance
        ``uid`` (as KV arriving over NIXL lands), or None (none asked, or none free)."""
        c = self.c
        if not k or c.pages.free_pages < k:
            return None
        pages = c.pages.take(k)
        P = c.pages.page_tokens
        rows = (np.asarray(pages, np.int64)[:, None] * P + np.arange(P)).reshape(-1)
        ids = uid * self.max_len + np.arange(k * P)
        self.xp.cuda.Device().synchronize()  # the engine writes after the pages' last reader
        for layer in range(self.L):
            c.pool.numpy[layer, rows] = pattern(layer, ids, self.row)
        return pages

    def _fork_past_written(self, parent: int, obj, view) -> None:
        """A fork over tokens the parent has pages for (grown ahead) but has not written: it
        must be refused (``ValueError`` naming the prefix), with nothing taken."""
        lo = self.active[parent][1] + self.S + 2  # past every token a step or a draft wrote
        if self.grown[parent] < lo:
            return
        p = int(self.rng.integers(lo, self.grown[parent] + 1))
        admitted = self._admitted()
        res = {} if self._budget() is None else {"resident": False}
        try:
            self.c.admit(p, prefix=(parent, p), stream=obj, **res)
        except ValueError as e:
            if "prefix" not in str(e):
                raise
            self.refused_forks += 1
        else:
            raise AssertionError(f"seed {self.seed}: a fork of {p} tokens over request slot "
                                 f"{parent}, which wrote {self.active[parent][1]}, was taken")
        assert self._admitted() == admitted, "a refused fork took a request slot"

    def _admitted(self) -> int:
        """Request slots the cache holds (the GPU cache's ``active``, the model's lengths)."""
        c = self.c
        return len(c.active) if hasattr(c, "active") else len(c._len)

    # ------------------------------------------------------------------ residency (GPU)
    def _budget(self):
        res = getattr(self.c, "residency", None)  # (the CPU model has none)
        return None if res is None else res.budget

    def _room(self, pages: int) -> bool:
        """The fuzz's engine keeps a block free for every request slot that holds none, so a
        sparse admission or a demotion always fits: may ``pages`` more be taken?"""
        b = self._budget()
        holders = sum(1 for r in self.active if b.state(r) != "resident")
        return b.free_pages - pages >= b.block_pages * (self.R - holders)

    def _grow_to(self, rid: int, m: int, obj) -> None:
        """``grow``, a request with pages demoted first when its pages would eat the room
        kept for blocks (a promotion in flight is cancelled so)."""
        b = self._budget()
        if b is not None and b.state(rid) != "sparse":
            need = b.pages_for(m) - b.pages_for(b.tokens(rid))
            if need > 0 and not self._room(need):
                self._demote(rid, obj)
                self.moves += 1
        self.c.grow(rid, m, stream=obj)
        self.grown[rid] = max(self.grown[rid], m)

    def _move(self) -> None:
        """A residency change between steps: a resident request demoted, a sparse one
        promoted when its pages fit, or the promotions that landed switched; or the cache's
        default policy (``make_room`` for more pages than are free, ``promote_ready`` keeping
        the blocks the fuzz's engine keeps)."""
        b = self._budget()
        rid = int(self.rng.choice(list(self.active)))
        obj, view = self._pick_stream()
        if self.rng.random() < 0.03:  # the policy's hysteresis changed mid-run
            b.cooldown = int(self.rng.integers(0, 4))
            b.watermarks = _band(self.rng)
        if self.rng.random() < 0.3:  # the cache's default policy
            if self.rng.random() < 0.2:  # down to the high watermark, 0 or 1 request kept
                keep = self.rng.choice(list(self.active), int(self.rng.integers(0, 2)))
                self.moves += len(self.c.residency.shed(keep=keep, stream=obj))
            elif self.rng.random() < 0.5:
                try:
                    self.moves += len(self.c.residency.make_room(
                        b.free_pages + int(self.rng.integers(1, 64)), stream=obj))
                except PoolExhausted:  # nothing demoted
                    pass
            else:
                holders = sum(1 for r in self.active if b.state(r) != "resident")
                self.moves += len(self.c.residency.promote_ready(
                    keep_free=b.block_pages * (self.R - holders), stream=obj))
            return
        st = b.state(rid)
        if st == "resident":
            self._demote(rid, obj)
        elif st == "sparse" and self._room(b.pages_for(b.tokens(rid))):
            self._promote(rid, obj)
            if self.rng.random() < 0.3:  # cancelled mid-fill (its fill behind obj's hold)
                obj, view = self._pick_stream()
                if self.rng.random() < 0.5 or len(self.active) == 1:
                    self._demote(rid, obj)
                else:
                    self.c.release(rid, stream=obj)
                    del self.active[rid], self.origin[rid], self.grown[rid]
                self.cancels += 1
        else:
            self.c.residency.switch_promoted(stream=obj)
        self.moves += 1

    def _demote(self, rid: int, obj) -> None:
        self._refuse_count("demote", rid, obj)
        self.c.residency.demote(rid, stream=obj)

    def _promote(self, rid: int, obj) -> None:
        self._refuse_count("promote", rid, obj)
        self.c.residency.promote(rid, stream=obj)

    def _refuse_count(self, call: str, rid: int, obj) -> None:
        """At times the move is first asked with a token count, right or off by one either
        way, as an engine's bookkeeping can be: the cache counts written tokens itself, so a
        count is refused (``TypeError``) with nothing moved."""
        if self.rng.random() >= 0.1:
            return
        n = self.active[rid][1] + int(self.rng.integers(-1, 2))
        state = self._budget().state(rid)
        try:
            getattr(self.c.residency, call)(rid, n, stream=obj)
        except TypeError as e:  # (every argument after the request slot is keyword-only)
            if "positional argument" not in str(e):
                raise
        else:
            raise AssertionError(f"seed {self.seed}: {call}({rid}, {n}) took a count")
        assert self._budget().state(rid) == state, f"a refused {call} moved request {rid}"
        self.refused_counts += 1

    def _refuse_write(self, rid: int, uid: int, budget, obj, view) -> None:
        """At times a write past the tokens the device budget counts, as an engine that did
        not grow first: refused by name before anything is written (the bytes checked after
        every step show nothing was)."""
        have = budget.tokens(rid)
        if have >= self.max_len:
            return
        n = 1 + int(self.rng.integers(0, min(2, self.max_len - have)))
        try:
            self.c.write_host(rid, have, self._kv(uid, have, n, view, 1), stream=obj)
        except ValueError as e:
            if "grow() it first" not in str(e):
                raise
        else:
            raise AssertionError(f"seed {self.seed}: write_host past the {have} tokens the "
                                 f"budget counts for request {rid} was taken")
        self._reuse_freed()
        self.refused_writes += 1

    def _grow_ahead(self) -> None:
        """The engine takes pages ahead of its steps (a paged pool): a request grown to more
        tokens than it has written."""
        rid = int(self.rng.choice(list(self.active)))
        n = self.active[rid][1]
        m = min(n + int(self.rng.integers(1, 4 * self.S + 8)), self.max_len)
        obj, view = self._pick_stream()
        self._grow_to(rid, m, obj)

    def _fork_origin(self, parent: int, p: int) -> list[tuple[int, int]]:
        """A fork's tokens below ``p`` are its parent's: the parent's origin cut at ``p``, then
        the parent's own tokens up to ``p``."""
        cut = [(min(lim, p), u) for lim, u in self.origin[parent]]
        return [(lim, u) for lim, u in cut if lim > 0] + [(p, self.active[parent][0])]

    def _ids(self, rid: int, tok: np.ndarray) -> np.ndarray:
        """The pattern ids of request slot ``rid``'s tokens ``tok``: its own instance's, below
        a fork point the instance that wrote them."""
        ids = self.active[rid][0] * self.max_len + tok
        for lim, u in reversed(self.origin[rid]):  # the lowest bound decides last
            ids = np.where(tok < lim, u * self.max_len + tok, ids)
        if self.ver.get(rid):  # drafts written with other bytes (their version)
            v = np.vectorize(lambda t: self.ver[rid].get(int(t), 0), otypes=[np.int64])(tok)
            ids = ids + (v << VERSION_SHIFT)
        return ids

    # ------------------------------------------------------------------ top-k
    def _row(self, rid: int, seq: int, k: int, newest: list) -> np.ndarray:
        rng = self.rng
        pool = self.hist.get(rid, np.zeros(0, np.int64))
        pool = pool[pool < seq]
        out = np.empty(k, np.int64)
        r = rng.random(k)
        out[:] = rng.integers(0, seq, k)  # new tokens
        if pool.size:
            m = r < 0.6
            out[m] = rng.choice(pool, int(m.sum()))
        m = r > 0.93
        out[m] = rng.choice(newest, int(m.sum()))
        out[rng.random(k) < 0.05] = -1
        bad = rng.random(k) < 0.02
        out[bad] = rng.choice([-7, seq, seq + 3, self.max_len + 5], int(bad.sum()))
        return out

    def _topk(self, S: int, lens: np.ndarray, B: int, nr: int, req: np.ndarray):
        rng = self.rng
        K = int(rng.integers(1, self.K + 1)) if rng.random() < 0.2 else self.K
        tk = rng.integers(-3, 3 * self.max_len, size=(B, S, K))  # padding rows: garbage
        for b in range(nr):
            rid = int(req[b])
            newest = [int(lens[b, s]) - 1 for s in range(lens.shape[1])]
            base = self._row(rid, int(lens[b, 0]), K, newest)
            for s in range(S):
                row = base.copy() if rng.random() < 0.5 else \
                    self._row(rid, int(lens[b, s]), K, newest)
                keep = rng.random(K) < 0.3
                row[keep] = base[keep]
                tk[b, s] = row
        tk = tk.astype(np.int32)
        return tk[:, 0] if S == 1 else tk

    # ------------------------------------------------------------------ expected
    def _expect(self, layer: int, tk: np.ndarray, req, lens, nr: int):
        """(flat indices that must be -1, flat indices with a row, their ids, the index of
        the first entry of their token in the row)."""
        B = tk.shape[0]
        t3 = tk.reshape(B, -1, tk.shape[-1])
        S, K = t3.shape[1], t3.shape[2]
        seqs = lens[:, :S] if S > 1 else lens[:, :1]
        col = np.arange(K).reshape(1, 1, K)
        seq = seqs[:, :, None]
        ok = (t3 >= 0) & (t3 < seq) & (t3 < self.max_len) & ~((seq <= self.H) & (col >= seq))
        ok[nr:] = False
        flat_ok = ok.reshape(-1)
        idx = np.nonzero(flat_ok)[0]
        bb = idx // (S * K)
        tok = t3.reshape(-1)[idx].astype(np.int64)
        ids = np.empty_like(tok)
        for b in np.unique(bb):
            ids[bb == b] = self._ids(int(req[b]), tok[bb == b])
        key = bb * (4 * self.max_len) + tok
        order = np.argsort(key, kind="stable")
        ks = key[order]
        first = np.searchsorted(ks, ks)  # first position of each key in sorted order
        canon = np.empty_like(idx)
        canon[order] = idx[order[first]]
        return np.nonzero(~flat_ok)[0], idx, ids, canon

    # ------------------------------------------------------------------ one step
    def step(self) -> None:
        """One step; on the GPU one in ten with CuPy's current stream another, busy one (a
        library call must queue everything on the stream it is given)."""
        if not (self.be.gpu and self.rng.random() < 0.1):
            return self._step()
        import cupy

        from _util import spin

        with self.be.busy:
            spin(cupy, 2_000_000)  # ~1 ms
            self.busy_now = True
            try:
                self._step()
            finally:
                self.busy_now = False
        self.busy_steps += 1

    def _step(self) -> None:
        rng = self.rng
        self._churn()
        if self.cfg.get("page_tokens") and rng.random() < 0.1:
            self._grow_ahead()
        if self._budget() is not None and rng.random() < 0.08:
            self._move()
        if self.pf is not None and rng.random() < 0.08:
            self._toggle()
        rids = list(self.active)
        rng.shuffle(rids)
        B = int(rng.integers(1, len(rids) + 1))
        req = np.array(rids[:B], np.int64)
        S = int(rng.integers(2, self.S + 1)) if self.S >= 2 and rng.random() < 0.6 else 1
        n = np.array([self.active[int(r)][1] for r in req], np.int64)
        if S > 1 and rng.random() < 0.5:
            lens = n[:, None] + 1 + np.arange(S)[None]  # L, L+1, ...: draft tokens
        else:
            lens = np.repeat(n[:, None] + 1, S, axis=1)
        use_graph = self.graphs and rng.random() < 0.3
        self.kind = "graph" if use_graph else "eager"
        if use_graph:
            self._graph_step(req, lens, S)
        else:
            pad = int(rng.integers(0, self.R - B + 1)) if rng.random() < 0.3 else 0
            self._eager_step(req, lens, S, pad)
        for r in req:
            self.active[int(r)][1] += 1
        self.steps += 1
        if self.steps % self.sync_every == 0:
            self.raise_if_bad()

    def _draw_lean(self) -> dict:
        """``begin_step``'s lean: mostly the default (lean while every request is resident),
        sometimes forced off, sometimes demanded when it may be (a budget's cache only)."""
        b, u = self._budget(), self.rng.random()
        if b is None or u < 0.6:
            return {}
        if u < 0.8 or not b.all_resident():
            return {"lean": False}
        self.lean_asked += 1
        return {"lean": True}

    def _toggle(self) -> None:
        """Prefetch and/or prediction flipped between steps, on any stream it accepts."""
        rng, pf = self.rng, self.pf
        obj, view = self._pick_stream()
        legacy = view is not None and view.ptr == 0
        if not legacy:  # set_enabled needs an explicit main stream
            pf.set_enabled(not pf.enabled, stream=obj)
            self.toggles += 1
        if rng.random() < 0.5 and not legacy:
            at = ("swap", "indexer")[int(rng.integers(2))] if rng.random() < 0.5 else None
            pf.set_predict(not pf.predict, stream=obj, at=at)
        self._graph = None  # a captured step belongs to the modes it was captured in

    def _drafts(self, req, lens, obj, view) -> None:
        """The draft tokens a ``[B, S]`` step may select, written first: their host rows, and
        for those below H (a request in positional layout reads token t from slot t) the row
        of slot t in every layer. At times with bytes of another version than their final
        ones: drafts the verify step will reject, whose positions get their final bytes later
        (the next call's drafts, or the newest token's row), as an MTP engine rewrites them."""
        xp = self.xp
        for b, r in enumerate(req):
            hi = int(lens[b].max()) - 1
            lo = int(lens[b, 0])
            if hi < lo:
                continue
            uid = self.active[int(r)][0]
            v = 0 if self.rng.random() < 0.6 else int(self.rng.integers(1, 4))
            vers = self.ver.setdefault(int(r), {})
            for tok in range(lo, hi + 1):
                if v:
                    vers[tok] = v
                else:
                    vers.pop(tok, None)
            self.rewrites += v > 0
            if (budget := self._budget()) is not None and self.rng.random() < 0.05:
                self._refuse_write(int(r), uid, budget, obj, view)
            self.c.write_host(int(r), lo, self._kv(uid, lo, hi - lo + 1, view, v), stream=obj)
            self._reuse_freed()
            t = np.arange(lo, min(hi + 1, self.H))
            b = self._budget()
            if t.size and not (b is not None and b.state(int(r)) == "resident"):  # (pages:
                # write_host reached them)
                with self._with(view):
                    for layer in range(self.L):
                        rows = self.c.tables.slot_locs[layer, int(r), xp.asarray(t)]
                        self.c.device_rows(layer)[rows] = pattern(
                            layer, uid * self.max_len + t + (v << VERSION_SHIFT), self.row,
                            xp=xp)

    def _lens_arg(self, lens, S, nr):
        """``[B, S]`` lengths, or ``[B]`` (half the time) when the real rows' steps are equal."""
        if (lens[:nr] == lens[:nr, :1]).all() and self.rng.random() < 0.5:
            return lens[:, 0]
        return lens

    def _grow(self, req, lens, obj) -> None:
        """The engine's part before a step: room in the host pool for its tokens; with a device
        budget, the step's requests touched (the policy's idleness and cooldown count steps)."""
        for b, r in enumerate(req):
            self._grow_to(int(r), int(lens[b].max()), obj)
        if (budget := self._budget()) is not None:
            budget.touch(req)

    def _eager_step(self, req, lens, S, pad) -> None:
        rng, c, xp = self.rng, self.c, self.xp
        obj, view = self._pick_stream()
        self._grow(req, lens, obj)
        self._drafts(req, lens, obj, view)
        B, nr = len(req) + pad, len(req)
        greq = np.concatenate([req, rng.integers(-2, self.R + 3, pad)]).astype(
            rng.choice([np.int32, np.int64]))
        glens = np.concatenate([lens, rng.integers(-3, 3 * self.max_len, (pad, S))])
        glens = self._lens_arg(glens, S, nr).astype(rng.choice([np.int32, np.int64]))
        with self._with(view):
            d_req, d_lens = xp.asarray(greq), xp.asarray(glens)
            d_nr = xp.asarray(np.array([nr], np.int32)) if pad or rng.random() < 0.2 else None
        step = c.begin_step(d_req, d_lens, d_nr, stream=obj, prefetcher=self.pf,
                            **self._draw_lean())
        self.lean_steps += getattr(step, "lean", False)
        # a model's order at times (single-step): each layer's new row written right before
        # its swap, the backup after the last layer (docs/guide.md's engine loop)
        late = S == 1 and rng.random() < 0.5
        with self._with(view):
            rows = step.newest_rows()
            if not late:
                self._write_newest(req, lens, rows, nr)
        if not late:
            step.backup_newest()
        outs, tks = self._layers(step, B, nr, req, lens, S, glens,
                                 late=(view, rows) if late else None)
        if late:
            step.backup_newest()
        step.finish()
        with self._with(view):
            self._check(outs, tks, greq, np.asarray(glens).reshape(B, -1), nr, rows)
            self._tape(outs, tks, greq, glens, nr)

    def _write_newest(self, req, lens, rows, nr, layers=None) -> None:
        """The step's new rows (of ``layers``, default every layer) where ``rows`` says."""
        xp = self.xp
        uid = np.array([self.active[int(r)][0] for r in req], np.int64)
        ids = uid * self.max_len + lens[:, 0] - 1
        for r, t in zip(req[:nr], lens[:nr, 0] - 1, strict=True):  # its final bytes now
            self.ver.get(int(r), {}).pop(int(t), None)
        r = rows[:nr]
        for layer in range(self.L) if layers is None else layers:
            self.c.device_rows(layer)[r] = pattern(layer, ids, self.row, xp=xp)

    def _expected_newest(self, req, lens) -> np.ndarray:
        t = lens[:, 0] - 1
        b = self._budget()
        if b is None:
            return (req * self.rows_per_request + np.minimum(t, self.H)).astype(np.int32)
        # a budget places every request's rows: a resident one's page row, else its slot's
        locs = self.xp.asnumpy(self.c.tables.slot_locs[0])
        return np.array([b.rows(int(r))[int(tt)] if b.state(int(r)) == "resident" else
                         locs[int(r), min(int(tt), self.H)] for r, tt in zip(req, t,
                                                                           strict=True)],
                        np.int32)

    def _layers(self, step, B, nr, req, lens, S, glens, late=None):
        """Every layer's swap; ``late`` ``(stream, rows)``: each layer's new row written there
        right before its swap."""
        xp, rng = self.xp, self.rng
        outs, tks, anchor = [], [], None
        for layer in range(self.L):
            if late is not None:
                with self._with(late[0]):
                    self._write_newest(req, lens, late[1], nr, layers=(layer,))
            if self.full[layer]:
                s_here = S if S == 1 or rng.random() < 0.8 else 1
                tk = self._topk(s_here, lens, B, nr, req)
                anchor = tk
                self._remember(tk, req, nr)
                with self._with(self.stream):
                    d_tk = xp.asarray(tk)
                self._indexer(step, layer, rng.random())
                got = step.swap(layer, d_tk)
            else:
                tk = anchor
                got = step.swap(layer, None)
            with self._with(self.stream):
                outs.append(got.copy())  # the next swap may rewrite the buffer
            tks.append(tk)
            self.calls += 1
        return outs, tks

    def _indexer(self, step, layer: int, u: float) -> None:
        """``step.before_indexer`` before full ``layer``'s swap (``u`` < 0.75), at times for
        another full layer (a no-op for the bytes); a shared layer's is refused."""
        full = [i for i in range(self.L) if self.full[i]]
        if u < 0.75:
            step.before_indexer(layer)
            self.indexer_calls += 1
        elif u < 0.85:
            step.before_indexer(full[int(self.rng.integers(len(full)))])
        elif u < 0.9 and self.pf is not None and not all(self.full):
            shared = next(i for i in range(self.L) if not self.full[i])
            try:
                step.before_indexer(shared)
            except ValueError:
                return
            raise AssertionError(f"before_indexer({shared}) of a shared layer was accepted")

    def _remember(self, tk, req, nr) -> None:
        """The tokens a full layer selected: the next steps select many of them again."""
        for b in range(nr):
            row = tk[b].reshape(-1)
            self.hist[int(req[b])] = np.unique(row[row >= 0])[: self.H]

    def _check(self, outs, tks, req, lens, nr, rows) -> None:
        """Queue every check of one step on the current stream; counters stay on the device."""
        xp = self.xp
        exp_rows = self._expected_newest(req[:nr].astype(np.int64), lens[:nr])
        bad_newest = (rows[:nr] != xp.asarray(exp_rows)).sum()
        errs = [0, 0, 0, 0, bad_newest]
        for layer, (out, tk) in enumerate(zip(outs, tks, strict=True)):
            neg, idx, ids, canon = self._expect(layer, tk, req, lens, nr)
            flat = out.reshape(-1)
            o = flat[xp.asarray(idx)]
            errs[0] = errs[0] + (o < 0).sum()
            errs[1] = errs[1] + (o != flat[xp.asarray(canon)]).sum()
            oc = xp.maximum(o, 0)
            got = self.c.device_rows(layer)[oc] if idx.size else None
            if idx.size:
                want = pattern(layer, ids, self.row, xp=xp)
                errs[2] = errs[2] + ((got != want).any(axis=1) & (o >= 0)).sum()
            errs[3] = errs[3] + (flat[xp.asarray(neg)] != -1).sum()
            if self.detail and len(self.details) < 20:
                self._describe(layer, tk, req, lens, nr, flat, idx, canon)
        e = xp.stack([xp.asarray(v, dtype=xp.int64) for v in errs])
        self.errors += e
        here = xp.where(e.sum() > 0, self.steps, 2**62)
        self.first_bad[...] = xp.minimum(self.first_bad, here)

    def _describe(self, layer, tk, req, lens, nr, flat, idx, canon) -> None:
        """The entries of this call whose row is not their token's first entry's row."""
        host = self.xp.asnumpy if self.be.gpu else np.asarray
        f = host(flat)
        bad = np.nonzero(f[idx] != f[canon])[0]
        if not bad.size:
            return
        t3 = np.asarray(tk).reshape(tk.shape[0], -1, tk.shape[-1])
        S, K = t3.shape[1], t3.shape[2]
        for j in bad[:4]:
            b, s, k = np.unravel_index(int(idx[j]), (t3.shape[0], S, K))
            _, s0, k0 = np.unravel_index(int(canon[j]), (t3.shape[0], S, K))
            rid, t = int(req[b]), int(t3[b, s, k])
            st = self._slot_tokens(layer, rid)
            self.details.append(dict(
                step=self.steps, kind=self.kind, layer=layer, row=int(b), num_real=int(nr),
                request=rid, lens=[int(x) for x in np.asarray(lens[b]).reshape(-1)], S=S,
                token=t, at=(int(s), int(k)), first_at=(int(s0), int(k0)),
                rows=(int(f[idx[j]]), int(f[canon[j]])),
                slots_holding=[int(x) for x in np.nonzero(st == t)[0]] if st is not None else None,
                hot_size=self.H))

    def _slot_tokens(self, layer: int, rid: int):
        """Layer ``layer``'s slot tokens of request slot ``rid`` after the call, on the host."""
        tabs = getattr(self.c, "tables", None)
        if getattr(tabs, "slot_tokens", None) is not None:  # the cache
            return self.xp.asnumpy(tabs.slot_tokens[layer, rid])
        state = getattr(self.c, "layer_state", None)  # the NumPy model
        return None if state is None else np.asarray(state[layer]["slot_tokens"][rid])

    def _tape(self, outs, tks, req, lens, nr) -> None:
        """The flight recorder's entry for this step (queued on the current stream)."""
        if not (self.record and self.be.gpu):
            return
        pf = self.pf
        self.tape.append(dict(
            step=self.steps, kind=self.kind, stream=self.stream_name, num_real=int(nr),
            req=np.asarray(req).tolist(), lens=np.asarray(lens).tolist(),
            prefetch=None if pf is None else [bool(pf.enabled), bool(pf.predict)],
            top_k=[None if t is None else np.asarray(t).tolist() for t in tks],
            dev=dict(outs=[o.copy() for o in outs], errors=self.errors.copy(),
                     tables={k: v.copy() for k, v in self.c.tables.named().items()},
                     host_locs=self.c.host_locs.copy())))

    def dump_tape(self, first: int) -> None:
        """Write the recorded steps first - 2 .. first + 1 (host copies) to ``self.record``."""
        import cupy

        cupy.cuda.Device().synchronize()
        keep = []
        for e in self.tape:
            if first - 2 <= e["step"] <= first + 1:
                d = e.pop("dev")
                e["outs"] = [cupy.asnumpy(o).tolist() for o in d["outs"]]
                e["errors"] = cupy.asnumpy(d["errors"]).tolist()
                e["tables"] = {k: cupy.asnumpy(v).tolist() for k, v in d["tables"].items()}
                e["host_locs"] = cupy.asnumpy(d["host_locs"]).tolist()
                keep.append(e)
        with open(self.record, "w") as fh:
            json.dump(dict(seed=self.seed, config=self.cfg, first_bad_step=first,
                           steps=keep), fh)

    # ------------------------------------------------------------------ graphs
    def _graph_step(self, req, lens, S) -> None:
        """A captured step (shapes fixed per graph) replayed with this batch."""
        import cupy

        rng = self.rng
        obj, view = self._pick_stream()
        if view.ptr == 0:  # no capture on the legacy stream: take a non-blocking one
            self.stream_name, obj, view = self.be.streams[0]
            self.stream_obj, self.stream = obj, view
        self._grow(req, lens, obj)
        self._drafts(req, lens, obj, view)
        B = self.R
        g = self._graph
        if g is None or g["S"] != S or g["view"] is not view or (
                g["lean"] and not self._budget().all_resident()):  # hazard 17
            g = self._capture(S, obj, view)
        nr = len(req)
        greq = np.concatenate([req, rng.integers(-2, self.R + 3, B - nr)]).astype(np.int32)
        glens = np.concatenate([lens, rng.integers(-3, 3 * self.max_len, (B - nr, S))])
        tks = []
        for layer in range(self.L):
            if self.full[layer]:
                tk = self._topk(S, lens, B, nr, req)
                shape = g["tk"][layer].shape
                if tk.shape[-1] != shape[-1]:  # the graph's K: pad the row with -1
                    pad = np.full(shape, -1, np.int32)
                    pad[..., : tk.shape[-1]] = tk
                    tk = pad
                anchor = tk
                self._remember(tk, req, nr)
            else:
                tk = anchor
            tks.append(tk)
        with view:
            g["req"].set(greq, stream=view)
            g["lens"].set(glens.astype(np.int64), stream=view)
            g["nr"].set(np.array([nr], np.int32), stream=view)
            for layer in range(self.L):
                if self.full[layer]:
                    g["tk"][layer].set(tks[layer], stream=view)
            # the newest token's row, where the captured newest_rows will find it
            rows = cupy.asarray(self._expected_newest(req, lens))
            self._write_newest(req, lens, rows, nr)
            g["graph"].launch(view)
            self.lean_steps += g["lean"]
            self._check(g["outs"], tks, greq, glens, nr, g["rows"])
            self._tape(g["outs"], tks, greq, glens, nr)
        self.graph_steps += 1
        self.calls += self.L

    def _capture(self, S, obj, view):
        """Capture one step of shapes (R rows, S steps, K) on ``view`` (warmed up eagerly
        first, a step with every row padding: no state changes)."""
        import cupy

        c, B = self.c, self.R
        with view:
            g = dict(S=S, view=view, req=cupy.zeros(B, cupy.int32),
                     lens=cupy.ones((B, S), cupy.int64), nr=cupy.zeros(1, cupy.int32))
            g["tk"] = [cupy.full((B, S, self.K) if S > 1 else (B, self.K), -1, cupy.int32)
                       if self.full[layer] else None for layer in range(self.L)]
            shape = (B, S, self.K) if S > 1 else (B, self.K)
            g["rows"] = cupy.empty(B, cupy.int32)
            g["outs"] = [cupy.empty(shape, cupy.int32) for _ in range(self.L)]
        step = c.begin_step(g["req"], g["lens"], g["nr"], stream=obj, prefetcher=self.pf,
                            **self._draw_lean())
        g["lean"] = getattr(step, "lean", False)
        g["u"] = [self.rng.random() for _ in range(self.L)]  # before_indexer, per layer

        def body():
            rows = step.newest_rows()
            step.backup_newest()
            anchor = None
            for layer in range(self.L):
                if self.full[layer]:
                    anchor = g["tk"][layer]
                    self._indexer(step, layer, g["u"][layer])
                    got = step.swap(layer, anchor)
                else:
                    got = step.swap(layer, None)
                with view:  # before the next swap rewrites the buffer
                    g["outs"][layer][...] = got
            step.finish()
            with view:
                g["rows"][...] = rows

        body()  # warm-up: num_real 0, nothing selected
        view.synchronize()
        # at times a host pool collected unclosed inside the capture (the collector runs
        # where it likes, in either capture mode): it must make no CUDA call there
        orphan = self._orphan_pool() if self.rng.random() < 0.3 else None
        rt = cupy.cuda.runtime  # CuPy captures in relaxed mode, torch.cuda.graph in global
        strict = self.rng.random() < 0.5
        self.global_captures += strict
        view.begin_capture(rt.streamCaptureModeGlobal if strict else rt.streamCaptureModeRelaxed)
        if orphan is not None:
            del orphan
            gc.collect()
        body()
        g["graph"] = view.end_capture()
        self._graph = g
        return g

    def _orphan_pool(self):
        from hisparse_cupy import HostKVPool

        self.orphans += 1
        return HostKVPool(1, 16, 64, threads=1, alloc=str(self.rng.choice(["mmap", "cuda"])))

    # ------------------------------------------------------------------ results
    def summary(self) -> dict:
        xp = self.xp
        if self.be.gpu:  # the checks ran on the steps' streams
            xp.cuda.Device().synchronize()
        errs = [int(v) for v in (xp.asnumpy(self.errors) if self.be.gpu else self.errors)]
        first = int((xp.asnumpy if self.be.gpu else np.asarray)(self.first_bad)[0])
        return {**self.counts(), "errors": dict(zip(CHECKS, errs, strict=True)),
                "first_bad_step": None if first >= 2**62 else first,
                **({"details": self.details} if self.details else {})}

    def counts(self) -> dict:
        """What the seed ran (its summary without the device's error counts)."""
        return dict(seed=self.seed, config=self.cfg, steps=self.steps, calls=self.calls,
                    graph_steps=self.graph_steps, toggles=self.toggles,
                    busy_steps=self.busy_steps, forks=self.forks,
                    refused_forks=self.refused_forks, moves=self.moves,
                    lean_steps=self.lean_steps, lean_asked=self.lean_asked,
                    indexer_calls=self.indexer_calls, engine_admits=self.engine_admits,
                    holds=self.holds, cancels=self.cancels, rewrites=self.rewrites,
                    orphans=self.orphans, global_captures=self.global_captures,
                    refused_counts=self.refused_counts, refused_resident=self.refused_resident,
                    refused_writes=self.refused_writes,
                    # stagings the GPU's prefetcher launched in an indexer's window (host count:
                    # a captured step's once)
                    window_stagings=getattr(getattr(self.pf, "_predictor", None), "windows", 0),
                    streams=sorted(self.kinds_used))

    def raise_if_bad(self) -> None:
        s = self.summary()
        if any(s["errors"].values()):
            if self.record and self.be.gpu and s["first_bad_step"] is not None:
                self.dump_tape(s["first_bad_step"])
            raise AssertionError(f"seed {self.seed}: {s['errors']} (first at step "
                                 f"{s['first_bad_step']}); config {s['config']}"
                                 + (f"; first offending entry {self.details[0]}"
                                    if self.details else ""))

    def run(self, steps: int) -> dict:
        for _ in range(steps):
            self.step()
        self.raise_if_bad()
        return self.summary()


def _one(args) -> dict:
    gpu, seed, steps, detail, record, budget = args
    f = Fuzz(gpu, seed, detail=detail, budget=budget,
             record=None if record is None else f"{record}/seed_{seed}.json")
    try:
        return f.run(steps)
    except AssertionError as e:
        s = f.summary()
        s["failure"] = str(e)
        return s
    except Exception as e:  # noqa: BLE001 - a call that raised: the seed failed, with where
        import traceback

        # (the device state may be unusable: its counts, no error counts read back)
        return {**f.counts(), "errors": {}, "first_bad_step": None,
                "failure": f"seed {seed}: step {f.steps} raised {type(e).__name__}: {e}; "
                           f"config {f.cfg}\n" + "".join(traceback.format_exc(limit=-6))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20000, help="steps in all (default 20000)")
    ap.add_argument("--per-seed", type=int, default=400, help="steps per seed (one cache)")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--procs", type=int, default=1, help="processes sharing the GPU")
    ap.add_argument("--cpu", action="store_true", help="the NumPy model instead of the GPU")
    ap.add_argument("--json", help="write the summaries here")
    ap.add_argument("--detail", action="store_true",
                    help="check every call on the host too (slow) and describe the first "
                         "offending entries (for a failing seed)")
    ap.add_argument("--budget", action="store_true",
                    help="GPU: a device budget in every configuration (residency's moves in "
                         "every seed)")
    ap.add_argument("--record", metavar="DIR",
                    help="GPU: keep every step's tables and outputs on the device and write "
                         "the steps around a failing seed's first bad one to DIR/seed_N.json")
    a = ap.parse_args(argv)
    if a.record:
        __import__("os").makedirs(a.record, exist_ok=True)
    n_seeds = -(-a.steps // a.per_seed)
    jobs = [(not a.cpu, a.seed + i, a.per_seed, a.detail, a.record, a.budget)
            for i in range(n_seeds)]
    t0 = time.perf_counter()
    if a.procs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(a.procs) as pool:
            res = pool.map(_one, jobs, chunksize=1)
    else:
        res = [_one(j) for j in jobs]
    wall = time.perf_counter() - t0
    bad = [r for r in res if "failure" in r]
    tot = {k: sum(r[k] for r in res)
           for k in ("steps", "calls", "graph_steps", "toggles", "busy_steps", "forks",
                     "refused_forks", "moves", "lean_steps", "lean_asked", "indexer_calls",
                     "window_stagings", "engine_admits", "holds", "cancels", "rewrites",
                     "orphans", "global_captures",
                     "refused_counts", "refused_resident", "refused_writes")}
    kinds = sorted(set().union(*(r["streams"] for r in res)))
    print(f"step fuzz ({'CPU model' if a.cpu else 'GPU'}): {len(res)} seeds, {tot['steps']} "
          f"steps, {tot['calls']} swap calls, {tot['graph_steps']} graph replays, "
          f"{tot['toggles']} prefetch toggles, {tot['forks']} forks ({tot['refused_forks']} "
          f"past the written tokens refused), {tot['engine_admits']} admissions of engine-"
          f"written pages, {tot['moves']} residency moves ({tot['cancels']} promotions "
          f"cancelled mid-fill, {tot['refused_counts']} token counts refused, "
          f"{tot['refused_resident']} resident=True without a budget refused, "
          f"{tot['refused_writes']} writes past the budget's count refused), "
          f"{tot['holds']} calls behind a held stream, {tot['rewrites']} draft writes to be "
          f"rewritten (rejected), "
          f"{tot['lean_steps']} lean steps ({tot['lean_asked']} asked lean=True), "
          f"{tot['indexer_calls']} before_indexer calls ({tot['window_stagings']} stagings "
          f"launched there), "
          f"{tot['global_captures']} captures in global mode, "
          f"{tot['orphans']} host pools collected unclosed inside a capture, "
          f"{tot['busy_steps']} steps "
          f"with CuPy's current "
          f"stream busy, streams {kinds}, {wall:.0f} s: "
          f"{len(bad)} seed(s) failed")
    for r in bad[:10]:
        print("  FAIL", r["failure"])
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(wall_s=wall, totals=tot, streams=kinds, runs=res), fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    sys.exit(main())
