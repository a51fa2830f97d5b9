"""GPU: no wrong byte from a state change (issue 60, ``docs/design.md`` section 10, "Page
reuse"). Each test is one reproduction an engine can reach: calls on different streams with no
synchronization between them but the library's own events, a stream held busy so that the
late work visibly lands late, and every byte read back.

1. a demotion's freed pages taken by another request's growth on another stream;
2. a cancelled promotion's fill still in flight when its pages are taken;
3. the token count a demotion or promotion works from (the cache's own, not a wrong one);
4. a token that was never written, of a resident request or of a sparse one below H (the
   positional layout): -1 and NOHOST, as the LRU path past H;
5. prefill KV given on the GPU, freed by the caller right after the call and its memory
   reused on the stream it was allocated on, before the admission's copy ran.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_gpu import check_rows, kv_for
from test_resident_cache_gpu import PAGE, K, L, R, _block, _cache

from hisparse_cupy import _abi

pytestmark = pytest.mark.gpu

BUSY = 200_000_000  # spin cycles (~0.1 s): the held stream's work lands after everything else


def _streams(n=2):
    import cupy

    return [cupy.cuda.Stream(non_blocking=True) for _ in range(n)]


def _late(monkeypatch, name, *, after=False):
    """A loaded GPU, made repeatable: the residency module's ``name`` (its copy launch) queues
    a spin of ~0.1 s on its stream before (or ``after``) its copy, so the copy (or the event
    recorded after it) lands after work other streams queue later. The spin does not block the
    host (a spin queued before the call would: the call's small host -> device copies may wait
    for their stream)."""
    import cupy

    from hisparse_cupy.residency import _arena

    from _util import spin

    real = getattr(_arena, name)

    def slow(*args, **kw):
        stream = kw.get("stream", args[-1] if args else None)
        if not after:
            with stream:
                spin(cupy, BUSY)
        real(*args, **kw)
        if after:
            with stream:
                spin(cupy, BUSY)

    monkeypatch.setattr(_arena, name, slow)


def _newest(cache, rid, uid, n, stream):
    """One step of request ``rid`` alone on ``stream``: its token ``n - 1`` (instance
    ``uid``'s bytes) written where ``newest_rows`` says, backed up. Returns the row."""
    import cupy

    with stream:
        step = cache.begin_step(cupy.asarray([rid], cupy.int32), cupy.asarray([n], cupy.int32),
                                stream=stream)
        rows = step.newest_rows()
        kv = cupy.asarray(kv_for(uid, n - 1, 1))
        for layer in range(L):
            cache.device_rows(layer)[rows] = kv[layer]
        step.backup_newest()
        step.finish()
    return rows


def test_a_demotions_freed_pages_reused_on_another_stream(monkeypatch):
    """Case 1: x resident, demoted on stream A (its copy lands late, as on a loaded GPU); y,
    resident, grown on stream B takes x's first freed page and writes its token there. x's
    demoted hot slots must hold x's bytes: B must not write the page before A's copy read
    it."""
    import cupy

    cache = _cache(R * (512 + 2 * _block()))
    x = cache.admit(40, kv=kv_for(0, 0, 40))  # 3 pages, positional once demoted (40 <= H)
    y = cache.admit(3 * PAGE, kv=kv_for(1, 0, 3 * PAGE))  # exactly 3 pages
    assert cache.residency.budget.state(x) == cache.residency.budget.state(y) == "resident"
    _newest(cache, y, 1, 3 * PAGE, cupy.cuda.get_current_stream())  # (kernels compiled)
    cupy.cuda.Device().synchronize()
    first = cache.residency.budget.rows(x)[0]  # x's token 0
    a, b = _streams()
    _late(monkeypatch, "copy_rows")
    cache.residency.demote(x, stream=a)
    cache.grow(y, 3 * PAGE + 1, stream=b)  # a 4th page: x's first, freed
    assert cache.residency.budget.rows(y)[3 * PAGE] == first
    _newest(cache, y, 1, 3 * PAGE + 1, b)
    cupy.cuda.Device().synchronize()
    locs = cupy.asnumpy(cache.tables.slot_locs[0, x, :40])
    for layer in range(L):
        check_rows(cache, layer, 0, np.arange(40), locs)
        check_rows(cache, layer, 1, [3 * PAGE], cache.residency.budget.rows(y)[3 * PAGE:])
    cache.close()


def test_a_cancelled_promotions_fill_never_lands_in_a_reused_page():
    """Case 2: x sparse, promoted on stream A while its fill's side stream is held busy;
    demoted (the promotion cancelled) on A; y, resident, grown on stream B takes one of the
    pages the fill would write and writes its token there. The late fill must not overwrite
    it."""
    import cupy

    from _util import spin

    cache = _cache(R * (512 + 2 * _block()))
    x = cache.admit(100, kv=kv_for(0, 0, 100), resident=False)
    y = cache.admit(3 * PAGE, kv=kv_for(1, 0, 3 * PAGE))
    _newest(cache, y, 1, 3 * PAGE, cupy.cuda.get_current_stream())  # (kernels compiled)
    cupy.cuda.Device().synchronize()
    a, b = _streams()
    side = cache.residency._arena._side = cupy.cuda.Stream(non_blocking=True)
    with side:  # (the fill's side stream is the library's: no call of the test's queues there)
        spin(cupy, BUSY)
    cache.residency.promote(x, stream=a)
    taken = cache.residency.budget.rows(x)[0]
    cache.residency.demote(x, stream=a)  # cancelled: its pages back
    assert cache.residency.budget.state(x) == "sparse"
    cache.grow(y, 3 * PAGE + 1, stream=b)
    assert cache.residency.budget.rows(y)[3 * PAGE] == taken
    _newest(cache, y, 1, 3 * PAGE + 1, b)
    cupy.cuda.Device().synchronize()
    for layer in range(L):
        check_rows(cache, layer, 1, np.arange(3 * PAGE + 1), cache.residency.budget.rows(y))
    cache.close()


def _swap_bytes(cache, rid, uid, n, tokens):
    """A single-step swap of ``rid`` at length ``n`` selecting ``tokens`` (and the newest):
    the rows' bytes checked for every layer; returns the rows and the row's status."""
    import cupy

    tk = np.full((1, K), -1, np.int32)
    tk[0, : len(tokens)] = tokens
    req = cupy.asarray([rid], cupy.int32)
    step = cache.begin_step(req, cupy.asarray([n], cupy.int32))
    out = [cupy.asnumpy(step.swap(layer, cupy.asarray(tk))) for layer in range(L)]
    status = cupy.asnumpy(cache.status[0])
    step.finish()
    for layer in range(L):
        got = out[layer][0, : len(tokens)]
        ok = got >= 0
        check_rows(cache, layer, uid, np.asarray(tokens)[ok], got[ok])
    return out[0][0, : len(tokens)], status


def test_a_demotion_works_from_the_tokens_written():
    """Case 3: a resident request with 30 tokens written (admitted with 28, two steps): a
    count is refused (the cache keeps its own on the device: before, ``demote(rid, 5)`` was
    taken and tokens 5, 6, 7 came back with wrong bytes and status 0), and the demotion's hot
    slots hold every written token: the next step's swap of 5, 6, 7, 29 returns their bytes."""
    import cupy

    cache = _cache(R * (512 + 2 * _block()))
    rid = cache.admit(28, kv=kv_for(0, 0, 28))
    for n in (29, 30):
        cache.grow(rid, n)
        _newest(cache, rid, 0, n, cupy.cuda.get_current_stream())
    cache.grow(rid, 31)
    with pytest.raises(TypeError, match="positional argument"):
        cache.residency.demote(rid, 5)
    assert cache.residency.budget.state(rid) == "resident"
    cache.residency.demote(rid)
    _newest(cache, rid, 0, 31, __import__("cupy").cuda.get_current_stream())
    rows, status = _swap_bytes(cache, rid, 0, 31, [5, 6, 7, 29, 30])
    assert (rows >= 0).all() and status[_abi.ST_NOHOST] == 0
    cache.close()


def test_a_promotion_works_from_the_tokens_written(monkeypatch):
    """Case 3, promotion: a sparse request with 30 tokens written and pages for 33 (grown
    ahead), promoted (before: ``promote(rid, 33)`` was taken); its fill reads the host rows at
    once but ends late (as a long fill on a loaded GPU), so its next three steps write tokens
    30..32 while it is promoting (sparse: host rows and slots). After the switch their pages
    must hold their bytes."""
    import cupy

    cache = _cache(R * (512 + 2 * _block()))
    rid = cache.admit(30, kv=kv_for(0, 0, 30), resident=False)
    cache.grow(rid, 33)
    _late(monkeypatch, "load_rows", after=True)
    with pytest.raises(TypeError, match="positional argument"):
        cache.residency.promote(rid, 33)
    cache.residency.promote(rid)
    main = cupy.cuda.get_current_stream()
    for n in (31, 32, 33):
        _newest(cache, rid, 0, n, main)
    assert cache.residency.budget.state(rid) == "promoting"  # its fill has not ended
    cupy.cuda.Device().synchronize()
    cache.grow(rid, 34)
    _newest(cache, rid, 0, 34, main)  # switches it
    assert cache.residency.budget.state(rid) == "resident"
    rows, status = _swap_bytes(cache, rid, 0, 34, [29, 30, 31, 32, 33])
    assert (rows >= 0).all() and status[_abi.ST_NOHOST] == 0
    cache.close()


def test_a_resident_requests_unwritten_token_is_nohost_as_sparse():
    """Case 4: two requests of 100 tokens (past H), one resident, one sparse, each grown to
    110 and stepped at length 110 (tokens 100..108 never written). A swap selecting tokens 105
    and 106 gives -1 and counts NOHOST twice on both; token 10 and the newest (109) are
    served."""
    import cupy

    cache = _cache(R * (512 + 2 * _block()))
    got = {}
    for uid, resident in ((0, True), (1, False)):
        rid = cache.admit(100, kv=kv_for(uid, 0, 100), resident=resident)
        cache.grow(rid, 110)
        _newest(cache, rid, uid, 110, cupy.cuda.get_current_stream())
        got[resident] = _swap_bytes(cache, rid, uid, 110, [10, 105, 106, 109])
    for resident, (rows, status) in got.items():
        assert (rows[[0, 3]] >= 0).all(), resident
        assert (rows[[1, 2]] == -1).all(), (resident, rows)
        assert status[_abi.ST_NOHOST] == 2, (resident, status)
    cache.close()


def test_a_positional_requests_unwritten_token_is_nohost():
    """Case 4 below H: a sparse request of 40 tokens (the positional layout, H = 64) in a slot
    another request used before, grown to 50 and stepped at length 50 (tokens 40..48 never
    written). A swap selecting tokens 45 and 46 gives -1 and counts NOHOST twice, where it
    served the slots' old rows with status 0 before; token 10 and the newest (49) are
    served, their bytes checked."""
    import cupy

    cache = _cache(R * (512 + 2 * _block()))
    s = cupy.cuda.get_current_stream()
    old = cache.admit(60, kv=kv_for(7, 0, 60), resident=False)  # the slot's rows, written
    cache.release(old)
    rid = cache.admit(40, kv=kv_for(0, 0, 40), resident=False)
    cache.grow(rid, 50)
    _newest(cache, rid, 0, 50, s)
    rows, status = _swap_bytes(cache, rid, 0, 50, [10, 45, 46, 49])
    assert (rows[[0, 3]] >= 0).all() and (rows[[1, 2]] == -1).all(), rows
    assert status[_abi.ST_NOHOST] == 2, status
    cache.close()


def test_a_positional_rows_tokens_past_max_len_are_range():
    """A cache whose hot size exceeds max_len (64 slots, max_len 32): a positional row stepped
    at length 40 > max_len. Tokens 35 and 36 (past max_len, below the length) are -1 and count
    RANGE; the never-written check reads no host row there (the last request slot's would lie
    past the host map). Token 10 is served."""
    import cupy

    from hisparse_cupy import HotBufferCache

    ml, rows = 32, 656
    cache = HotBufferCache(n_layers=2, max_requests=2, max_len=ml, row_bytes=rows, hot_size=64,
                           top_k=8, extra_page=4)
    kv = np.random.default_rng(5).integers(0, 256, (2, 20, rows), dtype=np.uint8)
    cache.admit(20, kv=kv)
    rid = cache.admit(20, kv=kv)  # the last request slot
    tk = cupy.asarray(np.array([[10, 35, 36, -1, -1, -1, -1, -1]], np.int32))
    step = cache.begin_step(cupy.asarray([rid], cupy.int32), cupy.asarray([40], cupy.int32))
    for layer in range(2):
        got = cupy.asnumpy(step.swap(layer, tk))[0]
        assert got[0] >= 0 and (got[1:3] == -1).all(), got
        assert (cupy.asnumpy(cache.device_rows(layer)[int(got[0])]) == kv[layer, 10]).all()
        status = cupy.asnumpy(cache.status[0])
        assert status[_abi.ST_RANGE] == 2 and status[_abi.ST_NOHOST] == 0, status
    step.finish()
    cache.close()


@pytest.mark.parametrize("resident", [False, True])
def test_prefill_kv_freed_by_the_caller_after_the_call(resident):
    """Case 5: the prompt's KV on the GPU, allocated on stream X; the admission queued on
    stream S, held busy; the caller drops its KV right after the call and X's next
    allocation (zeros, written at once) reuses its memory. The request's rows must hold the
    prompt (a positional sparse request: its block; a resident one: its pages). The same for
    ``write_host`` of a resident request's next tokens."""
    import cupy

    from _util import spin

    cache = _cache(R * (512 + 2 * _block()))
    x, s = _streams()
    cupy.cuda.Device().synchronize()
    n = 48
    with x:
        kv = cupy.asarray(kv_for(0, 0, n))
    x.synchronize()
    with s:
        spin(cupy, BUSY)
    rid = cache.admit(n, kv=kv, resident=resident, stream=s)
    del kv
    with x:
        junk = cupy.zeros((L, n, cache.row_bytes), cupy.uint8)  # the freed memory, reused
    if resident:
        cache.grow(rid, n + 8, stream=s)
        with x:
            more = cupy.asarray(kv_for(0, n, 8))
        x.synchronize()
        with s:
            spin(cupy, BUSY)
        cache.write_host(rid, n, more, stream=s)
        del more
        with x:
            junk2 = cupy.zeros((L, 8, cache.row_bytes), cupy.uint8)
    cupy.cuda.Device().synchronize()
    del junk
    if resident:
        del junk2
        rows, tokens = cache.residency.budget.rows(rid), np.arange(n + 8)
    else:
        rows, tokens = cupy.asnumpy(cache.tables.slot_locs[0, rid, :n]), np.arange(n)
    for layer in range(L):
        check_rows(cache, layer, 0, tokens, rows)
    cache.close()
