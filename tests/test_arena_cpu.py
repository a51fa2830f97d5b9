"""CPU: residency's device-side arithmetic (``residency/_arena.py``, issue 60), run with NumPy in
place of CuPy: a demotion builds its hot slots and its copy from the device's count of written
tokens (never a count the host passes), a promotion's fill copies that count's rows, and the
switch copies every later token whose host row is written. The copies are carried out on a
NumPy "device" (a row per token's bytes), so the bytes each slot and page ends with are checked
against what an admission of the written tokens would hold. The GPU runs the same code in
``tests/test_page_reuse_gpu.py`` and ``tests/test_resident_cache_gpu.py``."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cupy", reason="the arena imports CuPy (installed in CI, no GPU needed)")

H, P, C, PAGE, MAXLEN, R = 16, 2, 0, 4, 96, 3
W = H + P


class Stream:
    """A stream that runs everything at once (NumPy): a context, events that are done."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record(self):
        return SimpleNamespace(done=True)

    def wait_event(self, ev):
        pass


class Tables:
    """The slot tables of one layer the arena writes (place, reset, slot tokens)."""

    def __init__(self):
        self.hot_size = H
        self.slot_tokens = np.full((1, R, W), -1, np.int32)
        self.slot_layout = np.full((R, W), -1, np.int32)

    def place(self, rid, rows, stream):
        self.slot_layout[rid] = -1 if rows is None else np.asarray(rows)[:W]

    def reset(self, rid, stream):
        self.slot_tokens[:, rid] = -1

    def init_multistep(self, rid, stream):
        pass


@pytest.fixture
def arena(monkeypatch):
    """A DeviceArena over NumPy: its copies applied to ``dev`` (token ids as row bytes)."""
    from hisparse_cupy.residency import _arena

    shim = SimpleNamespace(zeros=np.zeros, full=np.full, arange=np.arange, where=np.where,
                           minimum=np.minimum, asarray=np.asarray, int32=np.int32,
                           int64=np.int64, uint8=np.uint8)
    monkeypatch.setattr(_arena, "cupy", shim)

    class NoFences:
        fence = staticmethod(contextlib.contextmanager(lambda stream: (yield None)))
        waiter = staticmethod(lambda stream: None)

    monkeypatch.setattr(_arena, "StreamOrder", NoFences)
    a = _arena.DeviceArena(max_requests=R, max_len=MAXLEN, n_rows=64 * PAGE, page_tokens=PAGE,
                           block_rows=W)
    a.dev = np.full(64 * PAGE, -9, np.int64)  # each device row: the token id it holds
    a.host = np.arange(10_000, dtype=np.int64)  # host row h holds id h

    def copy_rows(src, dst, count, *, src_rows, dst_rows, limit):
        s, d = np.asarray(src).reshape(-1), np.asarray(dst).reshape(-1)
        n = int(np.asarray(count).reshape(-1)[0])
        for i in range(min(n, s.size)):
            if 0 <= s[i] < src_rows.size and 0 <= d[i] < limit:
                dst_rows[d[i]] = src_rows[s[i]]

    monkeypatch.setattr(_arena, "array_rows", lambda x: x)
    monkeypatch.setattr(_arena, "copy_rows", lambda s, d, c, *, src, dst, **kw: copy_rows(
        s, d, c, src_rows=a.dev, dst_rows=a.dev, limit=a.dev.size))
    monkeypatch.setattr(_arena, "load_rows", lambda pool, rows, device, dev_rows, stream,
                        count=None: copy_rows(rows, dev_rows,
                                              [len(rows)] if count is None else count,
                                              src_rows=a.host, dst_rows=a.dev,
                                              limit=a.dev.size))
    return a


def _page_rows(a, rid):
    """Device rows of every page ``rid`` holds, in token order."""
    pg = np.asarray(a.budget.pages(rid), np.int64)
    return (pg[:, None] * PAGE + np.arange(PAGE)).reshape(-1)


def _resident(a, rid, n, pages_for, rng):
    """``rid`` admitted resident with ``n`` tokens written and pages for ``pages_for``
    (grown ahead): its page rows hold token ids ``1000 * rid + t``."""
    assert a.admit(rid, n, True, contextlib.nullcontext()) is None
    if pages_for > n:
        a.grow(rid, pages_for, contextlib.nullcontext())
    rows = a.budget.rows(rid)
    a.dev[rows] = 1000 * rid + np.arange(rows.size)
    return rows


@pytest.mark.parametrize("n, ahead", [(5, 0), (10, 9), (16, 3), (17, 0), (40, 7), (90, 2)])
def test_a_demotion_holds_what_an_admission_of_the_written_tokens_would(arena, n, ahead):
    """The device's count ``n`` (admission, then steps' newest tokens: here set as the
    newest-row kernel sets it) decides the layout: positional while ``n <= H`` (slot t holds
    token t, every token with a page copied), else the newest H tokens in slots 0..H-1 and the
    newest in slot H, each slot's row holding its token's bytes; the pages go back."""
    rng = np.random.default_rng(n)
    a, t = arena, Tables()
    _resident(a, 1, max(1, n - 3), n + ahead, rng)
    a.written[1] = n  # three steps since admission (the newest-row kernel's count)
    free = a.budget.free_pages
    a.demote(1, t, np.zeros((1, 1, 8), np.uint8), contextlib.nullcontext())  # (its shape)
    assert a.budget.state(1) == "sparse" and a.resident[1] == 0 and (a.page_table[1] == -1).all()
    assert a.budget.free_pages == free + a.budget.pages_for(n + ahead) - a.budget.block_pages
    toks, rows = t.slot_tokens[0, 1], t.slot_layout[1]
    if n <= H:
        assert (toks[:H] == np.arange(H)).all() and toks[H] == -1
        held = np.arange(min(H, n + ahead))  # every token with a page
    else:
        assert (toks[:H] == np.arange(n - 1 - H, n - 1)).all() and toks[H] == n - 1
        held = np.arange(n - 1 - H, n)
    slot = held if n <= H else np.arange(H + 1)  # positional: slot t holds token t
    assert (a.dev[rows[slot]] == 1000 + held).all()


def test_a_promotion_fills_the_written_tokens_and_the_switch_the_later_ones(arena):
    """Promotion: the fill copies the count written when it began (30, not the 33 tokens the
    request has pages for); three steps later (tokens 30..32's host rows written, a draft at
    34 too) the switch copies every token past the fill's count whose host row is written,
    and the page table is written."""
    a, t = arena, Tables()
    assert a.admit(2, 30, False, contextlib.nullcontext()) is not None
    a.budget.grow(2, 36)
    host_locs = np.full((R, MAXLEN), -1, np.int64)
    host_locs[2, :30] = 2000 + np.arange(30)
    a.written[2] = 30
    a._side = Stream()
    a.promote(2, None, lambda rid, lo, hi: host_locs[rid, lo:hi].clip(0), None, Stream())
    rows = a.budget.rows(2)
    assert (a.dev[rows[:30]] == 2000 + np.arange(30)).all()
    assert (a.dev[rows[30:]] == -9).all()  # not written when the fill began
    host_locs[2, 30:33] = 2000 + np.arange(30, 33)  # the steps' backups
    host_locs[2, 34] = 2034  # a draft written with write_host
    a.written[2] = 33
    done = a.switch(host_locs, None, None, t, Stream())
    assert done == [2] and a.budget.state(2) == "resident" and a.resident[2] == 1
    want = np.where(host_locs[2, :36] >= 0, host_locs[2, :36], -9)
    assert (a.dev[rows] == want).all()
    assert (a.page_table[2, : len(a.budget._pages.pages(2))] >= 0).all()


@pytest.mark.parametrize("resident", [False, True])
def test_a_write_past_the_budgets_tokens_is_refused_before_anything_changes(arena, resident):
    """Under a device budget ``write_host`` reaches tokens the budget counts (the engine grows
    a request first, as a paged pool requires): past them a resident request's pages have no
    rows for the new tokens (its load would fail after the host store ran), and a sparse
    request's promotion would fill its pages only up to the count, leaving tokens written
    past it stale in its last page. Refused by name, with the count."""
    from hisparse_cupy.residency._residency import _Budgeted

    res = _Budgeted(arena)
    arena.admit(1, 20, resident, Stream())
    res.check_write(1, 0, 20)  # within: nothing said
    with pytest.raises(ValueError, match=r"tokens 20\.\.22 of request slot 1: the device "
                                         r"budget counts 20 \(grow\(\) it first\)"):
        res.check_write(1, 20, 22)
    arena.budget.grow(1, 22)
    res.check_write(1, 20, 22)
    from hisparse_cupy.residency._residency import Residency

    Residency(R).check_write(1, 20, 99)  # without a budget: nothing to check


def _promoted(a, rid, n, written):
    """``rid`` admitted sparse with ``n`` tokens, ``written`` of them backed up to the host
    (host row of token t: ``1000 * rid + t``), then promoted (its fill run): the host map."""
    assert a.admit(rid, n, False, contextlib.nullcontext()) is not None
    host_locs = np.full((R, MAXLEN), -1, np.int64)
    host_locs[rid, :written] = 1000 * rid + np.arange(written)
    a.written[rid] = written
    a._side = Stream()
    a.promote(rid, None, lambda r, lo, hi: host_locs[r, lo:hi].clip(0), None, Stream())
    return host_locs


def test_a_promotion_of_a_request_run_past_its_grow_loads_every_token_its_pages_hold(arena):
    """An engine that ran two steps without ``grow`` (the slot layout needs none for its host
    rows): the budget counts 10 tokens, the device has 12 written, both backed up to the host.
    The promotion takes pages for 10 (tokens 0..11: page 2 is 8..11) and its fill loads 10;
    the switch loads 10 and 11 too, where they lie in page 2, instead of leaving the rows the
    page held before (another request's) to be served."""
    a, t = arena, Tables()
    host_locs = _promoted(a, 1, 10, 12)
    assert a.switch(host_locs, None, None, t, Stream()) == [1]
    rows = _page_rows(a, 1)
    assert rows.size == 12
    assert (a.dev[rows] == 1000 + np.arange(12)).all()


def test_a_resident_grow_loads_the_host_rows_its_new_pages_tokens_already_have(arena, rng):
    """A resident request grown late (its steps past the last page backed their tokens up to
    the host only: no page to write in): the new pages get those rows at the grow, and a grow
    before the tokens are written (the engine's usual order) loads nothing."""
    a = arena
    rows = _resident(a, 0, 8, 8, rng)  # pages 0..7
    host_locs = np.full((R, MAXLEN), -1, np.int64)
    host_locs[0, 8:10] = 500 + np.arange(2)  # tokens 8, 9: backed up, no page held them
    a.grow(0, 12, Stream(), host_locs=host_locs, pool=None, device=None)
    new = _page_rows(a, 0)[8:12]
    assert (a.dev[new[:2]] == 500 + np.arange(2)).all() and (a.dev[new[2:]] == -9).all()
    a.grow(0, 16, Stream(), host_locs=host_locs, pool=None, device=None)  # nothing written
    assert (a.dev[_page_rows(a, 0)[12:16]] == -9).all()
    assert (a.dev[rows] == np.arange(8)).all()  # the pages it had: untouched


def test_a_rewrite_while_promoting_reaches_the_pages_at_the_switch(arena):
    """``write_host`` of a token below the fill's count while the request promotes (the fill,
    on a side stream, may have read its old host row): the switch loads it again, as a
    resident request's pages (``on_write``) or a sparse one's hot slots (dropped) would serve
    the new bytes."""
    from hisparse_cupy.residency._residency import _Budgeted

    a, t = arena, Tables()
    res = _Budgeted(a)
    host_locs = _promoted(a, 1, 10, 10)
    a.host[host_locs[1, 3]] = 77777  # write_host(1, 3, new kv): the host row rewritten
    res.on_write(1, 3, host_locs[1, 3:4], Stream())
    assert a.switch(host_locs, None, None, t, Stream()) == [1]
    rows = _page_rows(a, 1)
    assert a.dev[rows[3]] == 77777
    assert (a.dev[rows[:10]] == a.host[host_locs[1, :10]]).all()
