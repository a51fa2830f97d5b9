"""The GPU test harness: device state over host rows of known bytes, its NumPy twin driven by
:mod:`hisparse_cupy.reference`, and the checks of a call against it (every GPU test and
``python -m hisparse_cupy check`` use it).

A :class:`Twin` holds the state of one of three owners:

- ``Twin(rng)``: a :class:`~hisparse_cupy.HotBufferCache` of ``L`` layers (max_steps 4), every
  request admitted warm; the tests run its steps (``t.c.begin_step(...).swap(...)``);
- :meth:`Twin.single`: one layer's :class:`~hisparse_cupy.SwapState` for
  :func:`~hisparse_cupy.swap_in`: shuffled host rows (some missing or beyond the pool),
  shuffled device rows, a random LRU order, a garbage token -> slot table if asked;
- :meth:`Twin.multi`: one layer's :class:`~hisparse_cupy.MultiStepState` for
  :func:`~hisparse_cupy.multistep_swap_in`: its row layout, positional and random hot sets,
  the newest tokens in the extra page, host rows missing for some tokens.

Token t of request r has the identity ``r * max_len + t``; in layer l its bytes are
``pattern(l, identity)``, in its host row ``host_locs[r, t]`` (where that lies in the pool) and
in the device row of every slot holding it. :meth:`Twin.call` runs one stand-alone call with
poisoned outputs and checks it; :meth:`Twin.expect_single` / :meth:`Twin.expect_multi` drive the
oracle on the twin; :meth:`Twin.verify` compares outputs, status, the miss plan and statistics
(when given), every per-layer table, both policies' invariants and the bytes of every row an
output points to (and, for :meth:`Twin.multi`, of every resident hot slot).
"""

from __future__ import annotations

import contextlib

import numpy as np

from .. import reference as ref

__all__ = ["MAX_LEN", "POISON", "TWIN_TABLES", "Twin", "UNTWINNED", "lru_state", "pattern",
           "twin_tables"]

# the cache twin's sizes (layers, request slots, H, P, K, max steps, row bytes, max_len)
L, R, H, P, K, S_MAX, ROW = 3, 6, 64, 8, 24, 4, 64
MAX_LEN = 600
POISON = 0x5A5A5A5A  # in a stand-alone call's outputs, status and plan counts before it runs

# The per-layer tables the oracle updates, by its names (the cache spells two of them ms_*).
# token_slot has no twin (the kernels never trust it: check_multistep_invariants checks it).
TWIN_TABLES = ("slot_tokens", "slot_locs", "lru", "scratch_locs", "ref", "clock")
UNTWINNED = ("token_slot", "host_locs")
_ORACLE_NAME = {"ms_ref": "ref", "ms_clock": "clock"}


def pattern(layer, rows, row_bytes: int, *, xp=np):
    """uint8 ``[len(rows), row_bytes]``: a pattern unique to (layer, row) in every 4-byte word.

    ``layer`` is one layer or one per row; ``xp``: NumPy, or CuPy for the pattern on the GPU."""
    rows = xp.asarray(rows, dtype=xp.uint64).reshape(-1, 1)
    lay = xp.asarray(layer, dtype=xp.uint64).reshape(-1, 1)
    words = xp.arange(row_bytes // 4, dtype=xp.uint64).reshape(1, -1)
    key = (lay * xp.uint64(1_000_003) + rows) * xp.uint64(2_654_435_761)
    w = (key + words * xp.uint64(0x9E3779B97F4A7C15)) >> xp.uint64(17)
    w = (w & xp.uint64(0xFFFFFFFF)).astype(xp.uint32)
    return w.view(xp.uint8).reshape(rows.shape[0], row_bytes)


def lru_state(R: int, H: int, P: int, rng, *, fill: float = 0.7, max_token: int = 10**6):
    """Random but valid single-step state: unique tokens per request, random LRU order."""
    slot_tokens = np.full((R, H + P), -1, np.int32)
    lru = np.empty((R, H), np.int16)
    for r in range(R):
        n = int(H * fill)
        toks = rng.choice(max_token, size=n, replace=False).astype(np.int32)
        slots = rng.choice(H, size=n, replace=False)
        slot_tokens[r, slots] = toks
        lru[r] = rng.permutation(H).astype(np.int16)
    slot_locs = np.arange(R * (H + P), dtype=np.int32).reshape(R, H + P)
    return slot_tokens, slot_locs, lru


def twin_tables(snapshot: dict) -> dict:
    """The oracle's copy of a layer's tables (a :meth:`Twin.snapshot`); raises if a table has
    no twin, so a table added to the cache is added to the oracle too."""
    unknown = sorted(set(snapshot) - set(TWIN_TABLES) - set(UNTWINNED))
    if unknown:
        raise AssertionError(f"per-layer table(s) {unknown} have no NumPy twin: model them in "
                             f"hisparse_cupy.reference and list them in testing.twin.TWIN_TABLES")
    return {k: v.copy() for k, v in snapshot.items() if k in TWIN_TABLES}


class Twin:
    """Device state, the host rows of its tokens and its NumPy twin (see the module docstring).

    Attributes: ``n_layers, R, H, P, K, S`` (max steps), ``max_len, row_bytes``; ``c`` (the
    cache, or None); ``pool`` (HostKVPool), ``device`` (uint8 ``[n_layers, D, row_bytes]``),
    ``plan`` (the MissPlan calls record into); ``host_locs`` and ``np`` (per layer, the tables
    by the oracle's names): the twin; ``lens`` (int64 ``[R]``, each request's length; None for
    :meth:`single`, whose calls draw lengths); ``dtypes``: the (req, seq_lens) dtypes
    :meth:`call` gives a stand-alone call; ``resident``: :meth:`verify` checks the bytes of
    every resident hot slot too.
    """

    def __init__(self, rng, stream=None):
        """The cache twin: lengths in ``[H + 40, MAX_LEN - 1)``, 80 % of each hot set warm."""
        import cupy

        from ..cache import HotBufferCache

        self._sizes(rng, n_layers=L, R=R, H=H, P=P, K=K, S=S_MAX, max_len=MAX_LEN, row_bytes=ROW)
        self.c = c = HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                                    hot_size=H, top_k=K, extra_page=P, max_steps=S_MAX)
        self.pool, self.plan, self.device = c.pool, c.plan, c.device
        # every request's own rows, where admission and release put them (layer 0's, before any)
        self.layout = {k: cupy.asnumpy(v[0]) for k, v in c.tables.named().items()
                       if k in ("slot_locs", "scratch_locs")}
        for layer in range(L):
            c.pool.layer(layer)[:] = pattern(layer, np.arange(c.pool.n_rows), ROW)
        self.lens = rng.integers(H + 40, MAX_LEN - 1, size=R)
        for r in range(R):
            warm = rng.choice(int(self.lens[r]) - 1, size=int(H * 0.8), replace=False)
            got = c.admit(int(self.lens[r]), warm_tokens=warm, stream=stream)
            assert got == r
        cupy.cuda.Device().synchronize()
        self.host_locs = cupy.asnumpy(c.host_locs)
        self.np = [twin_tables(self.snapshot(layer)) for layer in range(L)]

    def _sizes(self, rng, *, n_layers, R, H, P, K, S, max_len, row_bytes, dtypes=None):
        self.rng, self.n_layers, self.R, self.H, self.P, self.K, self.S = rng, n_layers, R, H, P, \
            K, S
        self.max_len, self.row_bytes, self.dtypes = max_len, row_bytes, dtypes
        self.c = self._single = self._multi = self.lens = self.nohost = None
        self.positional, self.resident = (), False

    @classmethod
    def single(cls, rng, *, R, K, H, P, row_bytes, max_len, adversarial=True, table=False):
        """One layer's single-step state: tokens of ``[0, max_len)`` in 80 % of each hot set,
        host rows a permutation of the identities (``adversarial``: 1 % of tokens without one,
        0.3 % beyond the pool), device rows shuffled (0xEE where no token is held), a
        MissPlan of 128 rows; ``table``: a token -> slot table of garbage (the first calls
        repair it). Calls take int32 req and int64 lengths."""
        import cupy

        from .._kernels.plan import MissPlan
        from .._kernels.swap import SwapState
        from ..host import HostKVPool

        self = cls.__new__(cls)
        self._sizes(rng, n_layers=1, R=R, H=H, P=P, K=K, S=1, max_len=max_len,
                    row_bytes=row_bytes, dtypes=(np.int32, np.int64))
        n_ids = R * max_len
        perm = rng.permutation(n_ids)
        host_locs = perm.reshape(R, max_len).astype(np.int64)
        if adversarial:
            holes = rng.random((R, max_len)) < 0.01
            host_locs[holes] = -1
            far = rng.random((R, max_len)) < 0.003
            host_locs[far] = n_ids + 5  # outside the pool
        self.host_locs = host_locs
        self.pool = HostKVPool(1, n_ids, row_bytes)
        self.pool.layer(0)[perm] = pattern(0, np.arange(n_ids), row_bytes)
        slot_tokens, slot_locs, lru = lru_state(R, H, P, rng, fill=0.8, max_token=max_len)
        # shuffled device rows, so that slot -> row is not the identity
        slot_locs[:] = rng.permutation(R * (H + P)).astype(np.int32).reshape(R, H + P)
        self.np = [dict(slot_tokens=slot_tokens, slot_locs=slot_locs, lru=lru)]
        token_slot = (cupy.asarray(rng.integers(-2**15, 2**15, size=host_locs.shape,
                                                dtype=np.int16)) if table else None)
        self._single = SwapState.validated(*(cupy.asarray(a) for a in
                                             (host_locs, slot_tokens, slot_locs, lru)),
                                           token_slot=token_slot)
        dev = np.full((1, R * (H + P), row_bytes), 0xEE, np.uint8)
        ids = np.arange(R)[:, None] * max_len + slot_tokens[:, :H]
        held = slot_tokens[:, :H] >= 0
        dev[0, slot_locs[:, :H][held]] = pattern(0, ids[held], row_bytes)
        self.device = cupy.asarray(dev)
        self.plan = MissPlan(128, K)
        return self

    @classmethod
    def multi(cls, rng, *, R=4, H=64, P=8, K=32, S_max=4, C=None, lens=None, row_bytes=64,
              max_batch=None, fill=0.7, nohost=0, workspace=None, positional=()):
        """One layer's multi-step state (``MultiStepState.create``, its layout) for requests of
        ``lens`` (default random in ``[H + 20, 6 H)``): requests of length <= H and those in
        ``positional`` hold tokens 0..H-1, the others ``fill`` of their hot slots (random
        tokens); the extra page holds tokens ``len - 1 + j``; ``nohost`` random tokens of
        each request have no host row; device rows of random bytes where no token is held.
        Calls take int64 req and int32 lengths; :meth:`verify` checks resident slots too."""
        import cupy

        from .._kernels.multistep import MultiStepConfig, MultiStepState
        from .._kernels.plan import MissPlan
        from ..host import HostKVPool

        cfg = MultiStepConfig(R, H, P, K, max_steps=S_max, scratch=C, max_batch=max_batch)
        if lens is None:
            lens = rng.integers(H + 20, 6 * H, size=R)
        lens = np.asarray(lens, dtype=np.int64)
        n = int(max(lens.max() + S_max + 2, H + P + 1))
        self = cls.__new__(cls)
        self._sizes(rng, n_layers=1, R=R, H=H, P=P, K=K, S=S_max, max_len=n,
                    row_bytes=row_bytes, dtypes=(np.int64, np.int32))
        self.lens, self.positional, self.resident = lens, tuple(positional), True
        slot_locs, scratch_locs, D = cfg.layout()
        self.host_locs = (np.arange(R).reshape(-1, 1) * n + np.arange(n)).astype(np.int64)
        self.nohost = []
        st = np.full((R, H + P), -1, np.int32)
        for r in range(R):
            Lr = int(lens[r])
            bad = rng.choice(Lr - 1, size=min(nohost, Lr - 1), replace=False) if nohost else []
            self.nohost.append(np.asarray(bad, np.int64))
            self.host_locs[r, self.nohost[r]] = -1
            if Lr <= H or r in self.positional:
                st[r, :H] = np.arange(H)
            else:
                self._random_hot(st, r, fill)
            for j in range(min(S_max, P)):
                if Lr - 1 + j >= H:
                    st[r, H + j] = Lr - 1 + j
        self.pool = HostKVPool(1, R * n, row_bytes)
        self.pool.layer(0)[:] = pattern(0, np.arange(R * n), row_bytes)
        poison = rng.integers(0, 256, size=(D, row_bytes), dtype=np.uint8)
        for r in range(R):
            s = np.nonzero(st[r] >= 0)[0]
            poison[slot_locs[r, s]] = self.bytes_of(0, r, st[r, s])
        self.device = cupy.asarray(poison.reshape(1, D, row_bytes))
        self._multi = MultiStepState.create(
            cupy.asarray(self.host_locs), cupy.asarray(st), cupy.asarray(slot_locs),
            cupy.asarray(scratch_locs), hot_size=H, top_k=K, n_device_rows=D, max_steps=S_max,
            max_batch=max_batch, workspace=workspace)
        self.np = [dict(slot_tokens=st, slot_locs=slot_locs.copy(),
                        scratch_locs=scratch_locs.copy(), ref=np.zeros((R, H), np.uint32),
                        clock=np.tile(np.uint32([1, 0]), (R, 1)))]
        self.plan = MissPlan(self._multi.workspace.max_batch, cfg.max_tokens)
        return self

    # ----------------------------------------------------------------- the state
    def state(self, layer: int = 0):
        """The single-step :class:`SwapState` of ``layer``."""
        if self.c is not None:
            return self.c.state(layer)
        if self._single is None:
            raise ValueError("a multi-step twin has no single-step state (swap_state(lru))")
        return self._single

    def multistep_state(self, layer: int = 0):
        """The :class:`MultiStepState` of ``layer``."""
        if self.c is not None:
            return self.c.multistep_state(layer)
        if self._multi is None:
            raise ValueError("a single-step twin has no multi-step state")
        return self._multi

    def device_rows(self, layer: int = 0):
        """uint8 ``[D, row_bytes]``: the rows outputs of ``layer`` index."""
        return self.c.device_rows(layer) if self.c is not None else self.device[layer]

    def op_args(self, layer: int = 0) -> dict:
        """``host_rows``, ``n_host_rows`` and ``device_rows`` of a stand-alone call."""
        return dict(host_rows=self.pool.device_ptr(layer), n_host_rows=self.pool.n_rows,
                    device_rows=self.device_rows(layer))

    def snapshot(self, layer: int) -> dict:
        """Host copies of ``layer``'s tables by the oracle's names: a cache's
        :meth:`~hisparse_cupy._tables.LayerTables.named`, a stand-alone state's arrays."""
        import cupy

        if self.c is not None:
            return {_ORACLE_NAME.get(k, k): cupy.asnumpy(v[layer])
                    for k, v in self.c.tables.named().items()}
        if self._multi is not None:
            return self._multi.to_numpy()
        st = self._single
        tabs = dict(slot_tokens=st.slot_tokens, slot_locs=st.slot_locs, lru=st.lru,
                    token_slot=st.token_slot)
        return {k: cupy.asnumpy(v) for k, v in tabs.items() if v is not None}

    def bytes_of(self, layer, rid, tokens):
        """The bytes of tokens ``tokens`` of request(s) ``rid`` in ``layer``."""
        ids = np.asarray(rid, np.int64) * self.max_len + np.asarray(tokens, np.int64)
        return pattern(layer, ids, self.row_bytes)

    def write_newest(self, req, seq, nr, *, layer: int = 0) -> None:
        """What the model does each step: the newest token's KV into slot H's row, for each of
        the first ``nr`` rows of a request slot in range whose length exceeds H."""
        import cupy

        req, seq = np.asarray(req)[:nr].astype(np.int64), np.asarray(seq)[:nr].astype(np.int64)
        ok = (req >= 0) & (req < self.R) & (seq > self.H)
        if ok.any():
            rows = self.np[layer]["slot_locs"][req[ok], self.H]
            self.device_rows(layer)[cupy.asarray(rows)] = cupy.asarray(
                self.bytes_of(layer, req[ok], seq[ok] - 1))

    def _random_hot(self, st, r, fill):
        H, Lr = self.H, int(self.lens[r])
        allowed = np.setdiff1d(np.arange(Lr - 1), self.nohost[r])
        n = min(int(H * fill), allowed.size)
        st[r, :H] = -1
        st[r, self.rng.choice(H, size=n, replace=False)] = self.rng.choice(allowed, n,
                                                                           replace=False)

    def readmit(self, r: int) -> None:
        """(:meth:`multi`) Give request slot r a fresh hot set (bytes loaded) and re-initialise
        its state; short and positional requests get the positional layout back."""
        import cupy

        st, H = self.np[0]["slot_tokens"], self.H
        if int(self.lens[r]) <= H or r in self.positional:
            st[r, :H] = np.arange(H)
        else:
            self._random_hot(st, r, self.rng.uniform(0.2, 1.0))
        s = np.nonzero(st[r, :H] >= 0)[0]
        rows = self.np[0]["slot_locs"][r, s]
        self.device_rows(0)[cupy.asarray(rows)] = cupy.asarray(self.bytes_of(0, r, st[r, s]))
        ms = self.multistep_state(0)
        ms.slot_tokens[r] = cupy.asarray(st[r])
        ms.reset([r])
        self.np[0]["ref"][r] = 0
        self.np[0]["clock"][r] = [1, 0]

    # ----------------------------------------------------------------- inputs
    def topk(self, req, S=None, miss=0.2):
        """(cache twin) ``[B, K]`` (or ``[B, S, K]``) top-k of held tokens and ``miss`` fresh
        ones of ``[0, len - 1)``, shuffled, 5 % of entries -1."""
        rows = []
        for r in req:
            n = int(self.lens[r]) - 1  # the newest token is not selected here
            held = self.np[0]["slot_tokens"][r, :self.H]
            held = held[(held >= 0) & (held < n)]
            one = []
            for _ in range(S or 1):
                k_miss = int(self.K * miss)
                row = np.concatenate([self.rng.choice(held, self.K - k_miss, replace=False),
                                      self.rng.integers(0, n, k_miss)])
                self.rng.shuffle(row)
                row[self.rng.random(self.K) < 0.05] = -1
                one.append(row)
            rows.append(one if S else one[0])
        return np.asarray(rows, np.int32)

    # ----------------------------------------------------------------- the oracle
    def expect_single(self, layer, topk, req, seq=None, nr=None):
        """The oracle's single-step swap on the twin (``seq`` default: the requests' lengths)."""
        st = self.np[layer]
        seq = self.lens[np.asarray(req)] if seq is None else seq
        return ref.swap_in(topk, req, seq, host_locs=self.host_locs,
                           slot_tokens=st["slot_tokens"], slot_locs=st["slot_locs"],
                           lru=st["lru"], hot_size=self.H, n_host_rows=self.pool.n_rows,
                           num_real=nr)

    def expect_multi(self, layer, topk, req, seq=None, nr=None):
        """The oracle's multi-step swap on the twin, in the miss order the call recorded in
        :attr:`plan` (host rows are identities here: row - r * max_len is the token)."""
        import cupy

        st, topk, req = self.np[layer], np.asarray(topk), np.asarray(req)
        B = topk.shape[0]
        cnt, src = cupy.asnumpy(self.plan.count[:B]), cupy.asnumpy(self.plan.src[:B])
        order = [src[b, : cnt[b]] - int(req[b]) * self.max_len for b in range(B)]
        seq = self.lens[req] if seq is None else seq
        return ref.multistep_swap_in(
            topk, req, np.asarray(seq), host_locs=self.host_locs,
            slot_tokens=st["slot_tokens"], slot_locs=st["slot_locs"],
            scratch_locs=st["scratch_locs"], ref=st["ref"], clock=st["clock"], hot_size=self.H,
            n_host_rows=self.pool.n_rows, num_real=nr, miss_order=order)

    # ----------------------------------------------------------------- calls and checks
    def call(self, topk, req, seq, *, layer: int = 0, num_real=None, out=None, check=False,
             verify=True, newest=False, stream=None):
        """One stand-alone call on ``layer``'s state: ``swap_in`` for a ``[B, K]`` top-k,
        ``multistep_swap_in`` for ``[B, S, K]``; ``out`` (when not given), status and the plan's
        counts hold :data:`POISON` before it. ``topk``: a host array, or a device one passed as
        is (strided views too); ``req`` / ``seq`` go as :attr:`dtypes`; ``num_real``: an int
        (a device scalar for the call); ``newest``: :meth:`write_newest` first. Returns the
        host outputs and the oracle's result (:meth:`check_call`); without ``verify``, the
        device outputs."""
        import cupy

        from .._kernels.multistep import multistep_swap_in
        from .._kernels.swap import swap_in

        if self.c is not None:
            raise TypeError("a cache twin's calls are its steps: t.c.begin_step(...).swap(...)")
        with stream if stream is not None else contextlib.nullcontext():
            if isinstance(topk, cupy.ndarray):  # a device array as given (may be strided)
                d_topk, topk = topk, cupy.asnumpy(topk)
            else:
                topk = np.asarray(topk, np.int32)
                d_topk = cupy.asarray(topk)
            B = topk.shape[0]
            if newest:
                self.write_newest(req, seq, B if num_real is None else num_real, layer=layer)
            d_req = cupy.asarray(np.asarray(req, self.dtypes[0]))
            d_seq = cupy.asarray(np.asarray(seq, self.dtypes[1]))
            nr = None if num_real is None else cupy.asarray([num_real], cupy.int32)
            status = cupy.full((B, ref.N_STATUS), POISON, cupy.int32)
            if out is None:
                out = cupy.full(topk.shape, POISON, cupy.int32)
            self.plan.count[:] = POISON
        kw = dict(self.op_args(layer), plan=self.plan, out=out, status=status, num_real=nr,
                  check=check, stream=stream)
        if topk.ndim == 2:
            got = swap_in(d_topk, d_req, d_seq, self.state(layer), **kw)
        else:
            got = multistep_swap_in(d_topk, d_req, d_seq, self.multistep_state(layer), **kw)
        if not verify:
            return got
        return self.check_call(topk, req, seq, num_real, got, status, layer=layer)

    def check_call(self, topk, req, seq, nr, got, status=None, *, layer: int = 0):
        """The oracle's result of the call that returned ``got`` (by the top-k's rank),
        compared by :meth:`verify` (with :attr:`plan` for a stand-alone twin): returns the
        host outputs and the oracle's result."""
        topk = np.asarray(topk)
        exp = (self.expect_single if topk.ndim == 2 else self.expect_multi)(layer, topk, req,
                                                                             seq, nr)
        plan = self.plan if self.c is None else None
        got = self.verify(layer, topk, req, got, exp, seq=seq, nr=nr, status=status, plan=plan)
        return got, exp

    def verify(self, layer, topk, req, got, exp, *, seq=None, nr=None, status=None, plan=None):
        """Compare a call's outputs ``got`` and ``status`` (default: the cache's) with the
        oracle's ``exp``; with ``plan`` (the MissPlan the call recorded) its counts, sources,
        destinations and, for a multi-step call, the workspace's statistics; then every table
        of ``layer`` with the twin, both policies' invariants where the layer has their tables,
        and the bytes of every row an output points to (a single-step call's LRU-path rows:
        real rows longer than H) and, with :attr:`resident`, of every resident hot slot.
        Returns the host outputs."""
        import cupy

        topk, req = np.asarray(topk), np.asarray(req)
        B, at = topk.shape[0], f"layer {layer}"
        got = cupy.asnumpy(got)
        np.testing.assert_array_equal(got, exp.device_locs, err_msg=f"{at} outputs")
        status = self.c.status[:B] if status is None else status
        np.testing.assert_array_equal(cupy.asnumpy(status), exp.status, err_msg=f"{at} status")
        if plan is not None:
            cnt = cupy.asnumpy(plan.count[:B])
            np.testing.assert_array_equal(cnt, exp.plan_count, err_msg=f"{at} plan count")
            src, dst = cupy.asnumpy(plan.src[:B]), cupy.asnumpy(plan.dst[:B])
            for b in range(B):
                np.testing.assert_array_equal(src[b, : cnt[b]], exp.plan_src[b, : cnt[b]],
                                              err_msg=f"{at} plan row {b} sources")
                np.testing.assert_array_equal(dst[b, : cnt[b]], exp.plan_dst[b, : cnt[b]],
                                              err_msg=f"{at} plan row {b} destinations")
            if topk.ndim == 3:
                stats = self.multistep_state(layer).workspace.stats[:B]
                np.testing.assert_array_equal(cupy.asnumpy(stats), exp.stats,
                                              err_msg=f"{at} stats")
        now, twin = self.snapshot(layer), self.np[layer]
        assert set(now) - set(UNTWINNED) == set(twin), (sorted(now), sorted(twin))
        for k, v in twin.items():
            np.testing.assert_array_equal(now[k], v, err_msg=f"{at} {k}")
        if "lru" in now:
            ref.check_invariants(now["slot_tokens"], now["slot_locs"], now["lru"], self.H)
        if "ref" in now:
            ref.check_multistep_invariants(
                now["slot_tokens"], now["slot_locs"], now["scratch_locs"], now["token_slot"],
                now["ref"], now["clock"], self.H, n_device_rows=self.device.shape[1])
        if topk.ndim == 2:
            seq = self.lens[req] if seq is None else np.asarray(seq)
            real = np.arange(B) < (B if nr is None else nr)
            lru_rows = real & (seq.reshape(B, -1)[:, 0] > self.H)
            idx = np.nonzero((got >= 0) & lru_rows[:, None])
            tokens = topk[idx]
        else:
            idx = np.nonzero(exp.tokens >= 0)
            tokens = exp.tokens[idx]
            assert (got[idx] >= 0).all(), f"{at}: an entry with a token has no row"
        self.check_rows(layer, req[idx[0]], tokens, got[idx], idx, "output rows")
        if self.resident:
            st, sl = twin["slot_tokens"][:, :self.H], twin["slot_locs"][:, :self.H]
            idx = np.nonzero(st >= 0)
            self.check_rows(layer, idx[0], st[idx], sl[idx], idx, "resident slots")
        return got

    def check_rows(self, layer, rid, tokens, rows, idx, what: str) -> None:
        """Assert device rows ``rows`` of ``layer`` hold tokens ``tokens`` of requests ``rid``
        (``idx``: the index arrays the entries came from, for the message)."""
        import cupy

        rows = np.asarray(rows)
        if rows.size == 0:
            return
        held = cupy.asnumpy(self.device_rows(layer)[cupy.asarray(rows)])
        bad = np.nonzero((held != self.bytes_of(layer, rid, tokens)).any(axis=1))[0]
        assert bad.size == 0, (f"layer {layer}: {bad.size} {what} hold wrong bytes, first at "
                               f"{tuple(int(i[bad[0]]) for i in idx)}")
