"""GPU: a paged host pool (``HotBufferCache(page_tokens=...)``) under admissions, forks that
share prefixes, engine-held pages, growth across page boundaries (eager and inside a captured
graph) and release churn.

A model gives every token of every request an identity whose byte pattern is the token's KV
(``pattern(layer, identity)``); a fork's prefix has its parent's identities. After every step
each swap's output rows must hold the selected tokens' bytes, and every live request's host
rows (``host_locs``) its tokens' bytes: a backup that wrote a shared page, a page given to two
requests or a row lost on growth shows as a wrong byte.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from hisparse_cupy.testing.twin import pattern

pytestmark = pytest.mark.gpu

L, R, MAX_LEN, ROW, H, K, EXTRA, PAGE = 3, 6, 512, 64, 64, 16, 16, 16


def _cache(pool_rows=R * 160):
    from hisparse_cupy import HotBufferCache

    return HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                          hot_size=H, top_k=K, extra_page=EXTRA, page_tokens=PAGE,
                          pool_rows=pool_rows)


class Model:
    """Each live request's token identities and lengths, and new identities on demand."""

    def __init__(self, rng):
        self.rng, self.next = rng, 1
        self.ids: dict[int, np.ndarray] = {}  # every token's rows written (a fork may cover)

    def new(self, n):
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out

    def kv(self, ids, on_gpu):
        import cupy

        a = np.stack([pattern(layer, ids, ROW) for layer in range(L)])
        return cupy.asarray(a) if on_gpu else a


def _check_host(c, m, stream):
    """Every live request's host rows hold its tokens' bytes; host_locs names those rows."""
    import cupy

    stream.synchronize()
    locs = cupy.asnumpy(c.host_locs)
    for rid, ids in m.ids.items():
        rows = c.host.rows(rid, 0, len(ids))
        np.testing.assert_array_equal(locs[rid, :len(ids)], rows, err_msg=f"rid {rid}")
        for layer in range(L):
            got = c.pool.numpy[layer, rows]
            assert (got == pattern(layer, ids, ROW)).all(), (rid, layer)
    c.pages.check()


def _step(c, m, batch, stream, rng, *, grow=True):
    """One decode step of ``batch``: grow, the newest token's KV written and backed up, then a
    swap per layer whose output rows are checked byte for byte."""
    import cupy

    from hisparse_cupy.host._pages import PoolExhausted

    live = []
    for rid in batch:
        n = len(m.ids[rid]) + (1 if grow else 0)
        try:
            c.grow(rid, n, stream=stream)
        except PoolExhausted as e:
            assert e.needed > e.free
            continue
        if grow:
            m.ids[rid] = np.r_[m.ids[rid], m.new(1)]
        live.append(rid)
    if not live:
        return 0
    req = cupy.asarray(np.asarray(live, np.int32))
    lens = cupy.asarray(np.asarray([len(m.ids[r]) for r in live], np.int64))
    with stream:
        step = c.begin_step(req, lens, stream=stream)
        rows = step.newest_rows()
        newest = np.asarray([m.ids[r][-1] for r in live])
        for layer in range(L):
            c.device[layer][rows] = cupy.asarray(pattern(layer, newest, ROW))
        step.backup_newest()
        for layer in range(L):
            topk = np.stack([rng.choice(len(m.ids[r]), K, replace=False) for r in live])
            out = cupy.asnumpy(step.swap(layer, cupy.asarray(topk.astype(np.int32)),
                                         check=True))
            got = cupy.asnumpy(c.device_rows(layer)[cupy.asarray(out)])
            want = np.stack([pattern(layer, m.ids[r][topk[i]], ROW) for i, r in enumerate(live)])
            assert (got == want).all(), f"layer {layer}"
    return len(live)


@pytest.mark.parametrize("copies", ["copy engines", "copy kernel"])
def test_paged_pool_bytes_through_forks_growth_engine_pages_and_churn(rng, stream, copies,
                                                                     monkeypatch):
    from hisparse_cupy._kernels import rows as movers
    from hisparse_cupy.host._pages import PoolExhausted

    # KV from GPU arrays by 2-D copies per run of rows, or by the copy kernel
    monkeypatch.setattr(movers, "MIN_RUN_BYTES", 0 if copies == "copy engines" else 1 << 62)

    c, m = _cache(), Model(rng)
    held: list[list[int]] = []  # the engine's page holds (its prefix tree)
    steps = 0
    for it in range(160):
        op = rng.random()
        free = [r for r in range(R) if r not in m.ids]
        if free and op < 0.35:
            kind = rng.choice(["new", "fork", "engine"] if m.ids else ["new"])
            n = int(rng.integers(K + 4, 200))
            before, taken = c.pages.free_pages, 0
            try:
                if kind == "fork":
                    parent = int(rng.choice(list(m.ids)))
                    p = int(rng.integers(1, len(m.ids[parent]) + 1))  # every token written
                    n = max(n, p)
                    ids = np.r_[m.ids[parent][:p], m.new(n - p)]
                    rid = c.admit(n, m.kv(ids[p:], rng.random() < 0.5), prefix=(parent, p),
                                  stream=stream)
                elif kind == "engine":
                    k = int(rng.integers(1, n // PAGE + 1))
                    pages = c.pages.take(k)
                    taken = k
                    ids = m.new(n)
                    rows = (np.asarray(pages)[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
                    stream.synchronize()  # the engine writes its pages after their last reader
                    for layer in range(L):
                        c.pool.numpy[layer, rows] = pattern(layer, ids[: k * PAGE], ROW)
                    held.append(pages)
                    rid = c.admit(n, m.kv(ids[k * PAGE:], rng.random() < 0.5), pages=pages,
                                  stream=stream)
                else:
                    ids = m.new(n)
                    warm = (rng.choice(n - 1, int(rng.integers(0, H)), replace=False)
                            if n > H else None)
                    rid = c.admit(n, m.kv(ids, rng.random() < 0.5), warm, stream=stream)
            except PoolExhausted:
                assert c.pages.free_pages == before - taken
                continue
            m.ids[rid] = ids
        elif m.ids and op < 0.45:
            rid = int(rng.choice(list(m.ids)))
            c.release(rid, stream=stream)
            del m.ids[rid]
        elif held and op < 0.5:
            c.pages.put(held.pop(int(rng.integers(len(held)))))
        elif m.ids and op < 0.52:  # grown ahead of its steps: a fork past its tokens is refused
            rid = int(rng.choice(list(m.ids)))
            n = len(m.ids[rid])
            try:
                c.grow(rid, min(MAX_LEN, n + int(rng.integers(1, 2 * PAGE))), stream=stream)
            except PoolExhausted:
                continue
            if free and n + 2 <= MAX_LEN:
                with pytest.raises(ValueError, match="has not written"):
                    c.admit(n + 2, m.kv(m.new(1), True), prefix=(rid, n + 1), stream=stream)
        elif m.ids and op < 0.55:  # a few own rows rewritten (the copy kernel's path)
            rid = int(rng.choice(list(m.ids)))
            lo = c.pages.own_from(rid)
            if lo < len(m.ids[rid]):
                t0 = int(rng.integers(lo, len(m.ids[rid])))
                ids = m.ids[rid][t0: t0 + int(rng.integers(1, 4))]
                c.write_host(rid, t0, m.kv(ids, rng.random() < 0.7), stream=stream)
        elif m.ids:
            live = list(m.ids)
            batch = rng.permutation(live)[: int(rng.integers(1, len(live) + 1))]
            steps += _step(c, m, [int(r) for r in batch], stream, rng)
        if it % 10 == 0:
            _check_host(c, m, stream)
    _check_host(c, m, stream)
    assert steps > 100
    c.close()


def test_a_fork_never_writes_the_pages_it_shares(rng, stream):
    """A child forked at a page boundary, stepped at its own length with new bytes for its
    newest token: the backup skips the shared row, the parent's bytes stay."""
    import cupy

    c, m = _cache(), Model(rng)
    ids = m.new(96)
    parent = c.admit(96, m.kv(ids, False), stream=stream)
    m.ids[parent] = ids
    child = c.admit(96, prefix=(parent, 96), stream=stream)  # every page shared
    assert c.pages.own_from(child) == 96 and c.pages.own_from(parent) == 96
    with stream:
        step = c.begin_step(cupy.asarray([child], cupy.int32), cupy.asarray([96], cupy.int32),
                            stream=stream)
        rows = step.newest_rows()
        for layer in range(L):
            c.device[layer][rows] = cupy.asarray(pattern(layer, [10**6], ROW))
        step.backup_newest()
    with pytest.raises(ValueError, match="lie in host pages it shares"):
        c.write_host(child, 95, m.kv(m.new(1), True), stream=stream)
    _check_host(c, m, stream)  # the parent's rows: its own bytes
    c.release(parent, stream=stream)  # the parent leaves first: the child keeps the pages
    m.ids = {child: ids}
    _check_host(c, m, stream)
    c.close()


def test_a_fork_covers_only_the_tokens_its_parent_wrote(rng, stream):
    """An engine that grows ahead of its steps (pages for tokens not written yet): a fork past
    the parent's written tokens is refused by name, whatever the pages say, and a fork up to
    them (a step's backup included) shares exactly the bytes written; the parent's later tokens
    keep reaching its own host rows. (Before, the bound was the tokens with pages at the last
    grow: after a second grow the fork of 32 was taken, the page became shared, the parent's
    later backups were skipped and the child read rows never written.)"""
    import cupy

    def step_parent(k):
        for _ in range(k):
            m.ids[parent] = np.r_[m.ids[parent], m.new(1)]
            n = len(m.ids[parent])
            with stream:
                step = c.begin_step(cupy.asarray([parent], cupy.int32),
                                    cupy.asarray([n], cupy.int32), stream=stream)
                rows = step.newest_rows()
                for layer in range(L):
                    c.device[layer][rows] = cupy.asarray(pattern(layer, m.ids[parent][-1:], ROW))
                step.backup_newest()

    c, m = _cache(), Model(rng)
    ids = m.new(10)
    parent = c.admit(10, m.kv(ids, True), stream=stream)  # one page: tokens 0..15
    m.ids[parent] = ids
    c.grow(parent, 40, stream=stream)  # ahead: pages for tokens up to 40, none written
    step_parent(3)  # tokens 10, 11, 12
    c.grow(parent, 41, stream=stream)  # the engine grows again, still ahead
    refused = {}
    for p in (32, 16, 14):  # past token 12: the parent has not written them
        new = m.new(4)
        try:
            child = c.admit(p + 4, m.kv(new, True), prefix=(parent, p), stream=stream)
        except ValueError as e:
            refused[p] = str(e)
        else:  # taken: the child holds the parent's tokens 0..p-1 (as the engine believes)
            m.ids[child] = np.r_[m.ids[parent][:p], new]
    step_parent(5)  # the parent's tokens 13..17
    _check_host(c, m, stream)  # every live request's host rows hold its tokens' bytes
    for p in (32, 16, 14):
        assert re.match(rf"prefix of {p} tokens: request slot {parent} has not written token "
                        r"13 ", refused.get(p, "taken")), (p, refused.get(p))
    assert sorted(c.active) == [parent]
    child_ids = np.r_[m.ids[parent][:13], m.new(7)]
    child = c.admit(20, m.kv(child_ids[13:], True), prefix=(parent, 13), stream=stream)
    m.ids[child] = child_ids
    _check_host(c, m, stream)  # the child's 13 tokens: the parent's, a step's backup included
    step_parent(5)
    _check_host(c, m, stream)
    c.close()


def test_growth_across_pages_inside_a_captured_graph(rng, stream):
    """One step captured once; before each replay the engine grows its requests on the host
    (a page taken every PAGE tokens) and sets the step's lengths: every replay's swaps return
    the right bytes and every backup lands in the request's pages."""
    import cupy

    c, m = _cache(), Model(rng)
    B = 3
    for _ in range(B):
        ids = m.new(int(rng.integers(40, 60)))
        rid = c.admit(len(ids), m.kv(ids, True), stream=stream)
        m.ids[rid] = ids
    with stream:
        g_req = cupy.arange(B, dtype=cupy.int32)
        g_len = cupy.zeros(B, cupy.int64)
        g_topk = [cupy.zeros((B, K), cupy.int32) for _ in range(L)]
        g_kv = cupy.zeros((L, B, ROW), cupy.uint8)  # the newest tokens' KV, set per replay
        g_len.set(np.asarray([len(m.ids[r]) for r in range(B)], np.int64), stream=stream)
        # the warm-up step writes (and backs up) the newest tokens again: their own bytes
        new = np.asarray([m.ids[r][-1] for r in range(B)])
        g_kv.set(np.stack([pattern(layer, new, ROW) for layer in range(L)]), stream=stream)
        for layer in range(L):
            g_topk[layer].set(np.stack([rng.choice(len(m.ids[r]), K, replace=False)
                                        for r in range(B)]).astype(np.int32), stream=stream)
        step = c.begin_step(g_req, g_len, stream=stream)
        outs = [cupy.empty((B, K), cupy.int32) for _ in range(L)]
        for capture in (False, True):  # a warm-up loads every kernel, then the same calls
            if capture:
                stream.synchronize()
                stream.begin_capture()
            rows = step.newest_rows()
            for layer in range(L):
                c.device[layer][rows] = g_kv[layer]
            step.backup_newest()
            for layer in range(L):
                step.swap(layer, g_topk[layer], out=outs[layer])
        g = stream.end_capture()
    pages_before = {r: len(c.pages.pages(r)) for r in range(B)}
    for _ in range(40):
        for r in range(B):
            c.grow(r, len(m.ids[r]) + 1, stream=stream)
            m.ids[r] = np.r_[m.ids[r], m.new(1)]
        topks = [np.stack([rng.choice(len(m.ids[r]), K, replace=False) for r in range(B)])
                 for _ in range(L)]
        with stream:
            g_len.set(np.asarray([len(m.ids[r]) for r in range(B)], np.int64), stream=stream)
            new = np.asarray([m.ids[r][-1] for r in range(B)])
            g_kv.set(np.stack([pattern(layer, new, ROW) for layer in range(L)]), stream=stream)
            for layer in range(L):
                g_topk[layer].set(topks[layer].astype(np.int32), stream=stream)
            g.launch(stream)
        stream.synchronize()
        for layer in range(L):
            got = cupy.asnumpy(c.device_rows(layer)[outs[layer]])
            want = np.stack([pattern(layer, m.ids[r][topks[layer][r]], ROW) for r in range(B)])
            assert (got == want).all(), layer
    assert all(len(c.pages.pages(r)) >= pages_before[r] + 2 for r in range(B))
    _check_host(c, m, stream)
    c.close()


def test_paged_errors_name_the_argument(stream):
    from hisparse_cupy import HotBufferCache
    from hisparse_cupy.host._pages import PoolExhausted

    c = _cache(pool_rows=8 * PAGE)
    kv = np.zeros((L, 100, ROW), np.uint8)
    rid = c.admit(40, kv[:, :40], stream=stream)  # 3 pages of 8
    for call, exc, match in [
        (lambda: c.admit(100, kv, stream=stream), PoolExhausted,
         "needs 7 free host pages, 5 are free"),
        (lambda: c.admit(20, stream=stream), ValueError, "kv must hold the 20 rows"),
        (lambda: c.admit(20, kv[:, :10], prefix=(rid, 41), stream=stream), ValueError,
         "prefix of 41 tokens"),
        (lambda: c.admit(20, kv[:, :10], prefix=(5, 10), stream=stream), KeyError,
         "prefix's parent 5"),
        (lambda: c.admit(20, kv[:, :9], prefix=(rid, 10), stream=stream), ValueError,
         "kv must hold the 10 rows"),
        (lambda: c.admit(20, kv[:, :20], prefix=(rid, 4), pages=[0], stream=stream),
         ValueError, "not both"),
        (lambda: c.grow(rid, 40 + 6 * PAGE, stream=stream), PoolExhausted, "growing"),
        (lambda: c.grow(rid, MAX_LEN + 1, stream=stream), ValueError, "n_tokens"),
        (lambda: c.write_host(rid, 40, kv[:, :1], stream=stream), ValueError, "grow"),
        (lambda: c.grow(3, 50), ValueError, "request slot 3 is not admitted"),
    ]:
        with pytest.raises(exc, match=match):
            call()
        assert c.pages.free_pages == 5 and sorted(c.active) == [rid]
    import cupy

    step = c.begin_step(cupy.asarray([rid], cupy.int32), cupy.asarray([41], cupy.int32),
                        stream=stream)  # token 40 has no page yet: check=True names it
    with pytest.raises(ValueError, match="seq_len 41 past its host pages"):
        step.swap(0, cupy.zeros((1, K), cupy.int32), check=True)
    c.host.table[rid, 1] += 1  # a table that disagrees with the host's pages
    step = c.begin_step(cupy.asarray([rid], cupy.int32), cupy.asarray([40], cupy.int32),
                        stream=stream)
    with pytest.raises(ValueError, match="device page table disagrees"):
        step.swap(0, cupy.zeros((1, K), cupy.int32), check=True)
    c.host.table[rid, 1] -= 1
    c.grow(rid, 30, stream=stream)  # fewer tokens than it has rows for: nothing to do
    assert c.pages.tokens(rid) == 40 and c.pages.free_pages == 5
    c.pages.check()
    c.close()
    for kw, exc, match in [(dict(pool_rows=10), ValueError, "pool_rows applies to a paged"),
                           (dict(page_tokens=0), ValueError, "page_tokens")]:
        with pytest.raises(exc, match=match):
            HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                           hot_size=H, top_k=K, **kw)
    from hisparse_cupy import HostKVPool

    with HostKVPool(L, 100, ROW) as pool:
        with pytest.raises(ValueError, match="not a whole number of pages of page_tokens=16"):
            HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                           hot_size=H, top_k=K, page_tokens=PAGE, pool=pool)
    s = HotBufferCache(n_layers=L, max_requests=R, max_len=MAX_LEN, row_bytes=ROW,
                       hot_size=H, top_k=K)
    with pytest.raises(ValueError, match="prefix and pages need a paged host pool"):
        s.admit(20, kv[:, :20], prefix=(0, 4), stream=stream)
    assert s.active == {}
    s.close()


def test_the_default_pool_holds_every_slot_at_max_len(stream):
    """With no pool_rows, two slots of max_len 64 in pages of 3 both grow to 64 tokens (22
    pages each; the step fuzz found a pool of 128 rows, 43 pages, one page short)."""
    from hisparse_cupy import HotBufferCache

    c = HotBufferCache(n_layers=2, max_requests=2, max_len=64, row_bytes=32, hot_size=16,
                       top_k=4, extra_page=2, page_tokens=3)
    try:
        assert c.pages.n_pages == 44
        kv = np.ones((2, 20, 32), np.uint8)
        rids = [c.admit(20, kv, stream=stream) for _ in range(2)]
        for rid in rids:
            c.grow(rid, 64, stream=stream)
        assert c.pages.free_pages == 0
        stream.synchronize()
    finally:
        c.close()
