"""GPU: a HotBufferCache with a device budget (issue 47, ``docs/design.md`` section 10): requests
resident while the budget holds them, sparse beyond; single- and multi-step swaps over mixed
batches, the newest token's rows and backups, growth, write_host, release and reuse, bytes
checked; refusals take nothing."""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_gpu import check_rows, kv_for

pytestmark = pytest.mark.gpu

L, R, H, K, P, MAXLEN, ROW, PAGE = 3, 4, 64, 32, 4, 512, 656, 16


def _block():
    """A sparse request's rows: hot slots, extra page, scratch (max_steps 2)."""
    from hisparse_cupy import HotBufferCache

    return HotBufferCache.rows_needed(max_requests=1, hot_size=H, top_k=K, extra_page=P,
                                      max_steps=2)


def _cache(budget_rows, max_steps=2):
    from hisparse_cupy import HotBufferCache

    return HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW,
                          hot_size=H, top_k=K, extra_page=P, max_steps=max_steps,
                          device_budget=budget_rows, device_page=PAGE)


def _run_steps(rng, cache, ids, lens, steps, lean=None):
    """Decode steps over every admitted request: grow, the newest token's KV written where
    ``newest_rows`` says and backed up, then each layer swapped single- or multi-step with
    the newest token among the selections; every entry's bytes checked."""
    import cupy

    rids = sorted(ids)
    req = cupy.asarray(rids, cupy.int32)
    for t in range(steps):
        n = np.array([lens[r] for r in rids])
        for r in rids:
            cache.grow(r, lens[r] + 1)
        seq = cupy.asarray(n + 1, cupy.int32)
        step = cache.begin_step(req, seq, lean=lean)
        assert step.lean == (cache.residency.lean_step() if lean is None else lean)
        rows = cupy.asnumpy(step.newest_rows())
        assert (rows >= 0).all()
        for layer in range(L):
            for b, r in enumerate(rids):
                cache.device_rows(layer)[int(rows[b])] = cupy.asarray(
                    kv_for(ids[r], int(n[b]), 1)[layer, 0])
        step.backup_newest()
        S = 2 if t % 2 else 1
        for layer in range(L):
            tk = np.stack([np.stack([rng.choice(int(n[b]) + 1, K, replace=False)
                                     for _ in range(S)]) for b in range(len(rids))])
            tk[:, :, 0] = n[:, None]  # the newest token in every step
            tk = tk.astype(np.int32) if S > 1 else tk[:, 0].astype(np.int32)
            out = cupy.asnumpy(step.swap(layer, cupy.asarray(tk)))
            for b, r in enumerate(rids):
                check_rows(cache, layer, ids[r], tk[b].reshape(-1), out[b].reshape(-1))
        step.finish()
        for r in rids:
            lens[r] += 1


@pytest.mark.parametrize("budget,lean", [("all", None), ("all", False), ("mixed", None)])
def test_resident_and_sparse_requests_through_steps(rng, budget, lean):
    from hisparse_cupy.residency import DeviceBudget

    n = [300, 100, 40, 450]
    block = _block()
    if budget == "all":
        rows = DeviceBudget.rows_needed([m + 40 for m in n], page_tokens=PAGE,
                                        block_rows=block)
    else:  # requests 0 and 1 resident, 2 and 3 sparse
        rows = DeviceBudget.rows_needed([n[0] + 40, n[1] + 40], 2, page_tokens=PAGE,
                                        block_rows=block)
    cache = _cache(rows)
    ids, lens = {}, {}
    for i, m in enumerate(n):
        r = cache.admit(m, kv=kv_for(i, 0, m), resident=None if budget == "all" or i < 2
                        else False)
        ids[r], lens[r] = i, m
    states = [cache.residency.budget.state(r) for r in sorted(ids)]
    assert states == (["resident"] * 4 if budget == "all" else
                      ["resident", "resident", "sparse", "sparse"])
    _run_steps(rng, cache, ids, lens, 12, lean)
    # release and reuse: the slot's pages back, a new request on them
    r0 = sorted(ids)[0]
    free = cache.residency.budget.free_pages
    cache.release(r0)
    assert cache.residency.budget.free_pages > free
    del ids[r0], lens[r0]
    r = cache.admit(200, kv=kv_for(9, 0, 200))
    ids[r], lens[r] = 9, 200
    _run_steps(rng, cache, ids, lens, 4, lean)
    cache.close()


def test_write_host_reaches_a_resident_requests_pages(rng):
    """write_host into a resident request's tokens reaches its pages; a prompt given on the
    GPU is copied device -> device into them at admission."""
    import cupy

    cache = _cache(R * (MAXLEN + 96))
    rid = cache.admit(100, kv=cupy.asarray(kv_for(0, 0, 100)))  # on the GPU
    assert cache.residency.budget.state(rid) == "resident"
    for layer in range(L):
        check_rows(cache, layer, 0, np.arange(100), cache.residency.budget.rows(rid)[0:100])
    cache.grow(rid, 140)
    cache.write_host(rid, 100, cupy.asarray(kv_for(0, 100, 40)))
    rows = cache.residency.budget.rows(rid)[100:140]
    for layer in range(L):
        check_rows(cache, layer, 0, np.arange(100, 140), rows)
    cache.close()


def test_refusals_take_nothing():
    from hisparse_cupy import PoolExhausted

    with pytest.raises(ValueError, match="cannot hold one sparse request"):
        _cache(PAGE * 2)
    block_pages = -(-_block() // PAGE)
    cache = _cache(PAGE * (2 * block_pages + 8))
    rid = cache.admit(100, kv=kv_for(0, 0, 100))  # resident: 7 pages
    assert cache.residency.budget.state(rid) == "resident"
    free, active = cache.residency.budget.free_pages, dict(cache.active)
    assert free == 2 * block_pages + 1
    with pytest.raises(PoolExhausted, match="device pages") as e:
        cache.grow(rid, 100 + PAGE * (free + 1))
    assert e.value.kind == "device"
    assert (cache.residency.budget.free_pages, cache.active) == (free, active)
    with pytest.raises(PoolExhausted, match="device pages"):
        cache.admit(PAGE * (free + 1), kv=kv_for(1, 0, PAGE * (free + 1)), resident=True)
    assert (cache.residency.budget.free_pages, cache.active) == (free, active)
    cache.close()


def test_demotion_at_a_step_boundary(rng):
    """A resident request demoted between steps (on another stream, no host synchronization):
    its hot slots hold its newest H tokens (their bytes copied from its pages), its pages
    return to the budget, and the steps after it read every selected token's bytes through
    the sparse path (misses from the host copy the backups kept current)."""
    import cupy

    n = [300, 40]
    cache = _cache(R * (MAXLEN + 2 * _block()))  # room for everyone resident
    ids, lens = {}, {}
    for i, m in enumerate(n):
        r = cache.admit(m, kv=kv_for(i, 0, m))
        ids[r], lens[r] = i, m
    _run_steps(rng, cache, ids, lens, 5)
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(cupy.cuda.get_current_stream().record())
    for r in sorted(ids):
        free = cache.residency.budget.free_pages
        pages = cache.residency.budget.pages_for(cache.residency.budget.tokens(r))
        cache.residency.demote(r, stream=s)
        assert cache.residency.budget.state(r) == "sparse"
        b = cache.residency.budget
        assert b.free_pages == free + pages - b.block_pages
    s.synchronize()
    for r in sorted(ids):  # the hot slots: the newest H tokens, the newest in slot H
        m = lens[r]
        toks = cupy.asnumpy(cache.tables.slot_tokens[0, r])
        locs = cupy.asnumpy(cache.tables.slot_locs[0, r])
        if m > H:  # slots 0..H-1: tokens m-1-H .. m-2; slot H: the newest
            assert (np.sort(toks[:H]) == np.arange(m - 1 - H, m - 1)).all()
            assert toks[H] == m - 1
            tokens, rows = toks[: H + 1], locs[: H + 1]
        else:  # positional: slot p holds token p
            assert (toks[:m] == np.arange(m)).all()
            tokens, rows = np.arange(m), locs[:m]
        for layer in range(L):
            check_rows(cache, layer, ids[r], tokens, rows)
    with pytest.raises(ValueError, match="not resident"):
        cache.residency.demote(sorted(ids)[0])
    _run_steps(rng, cache, ids, lens, 6)
    cache.close()


def test_promotion_switches_at_a_step_boundary(rng):
    """A sparse request promoted: its pages filled from the host on a side stream while steps
    go on; at the first step boundary after the fill (here: waited for) it is resident, the
    tokens written meanwhile copied in, and every byte stays right. A promotion released or
    demoted before its switch gives its pages back once."""
    n = [300, 150]
    cache = _cache(R * (MAXLEN + 2 * _block()))
    ids, lens = {}, {}
    for i, m in enumerate(n):
        r = cache.admit(m, kv=kv_for(i, 0, m), resident=False)
        ids[r], lens[r] = i, m
    assert {cache.residency.budget.state(r) for r in ids} == {"sparse"}
    _run_steps(rng, cache, ids, lens, 3)
    r0, r1 = sorted(ids)
    cache.residency.promote(r0)
    assert cache.residency.budget.state(r0) == "promoting"
    _run_steps(rng, cache, ids, lens, 2)  # steps while it fills (it may switch in them)
    if r0 in cache.residency._arena.promoting:
        cache.residency._arena.promoting[r0][0].synchronize()
    _run_steps(rng, cache, ids, lens, 3)  # the first begin_step switches it
    assert cache.residency.budget.state(r0) == "resident" and r0 not in cache.residency.promoting
    # its block went back: no slot of any layer names a row or a token any more (a later
    # mirror_layer would otherwise move rows its block's next owner holds)
    import cupy

    assert (cupy.asnumpy(cache.tables.slot_locs[:, r0]) == -1).all()
    assert (cupy.asnumpy(cache.tables.slot_tokens[:, r0]) == -1).all()
    free = cache.residency.budget.free_pages
    cache.residency.promote(r1)
    cache.residency.demote(r1)  # cancelled: its pages back, its block kept
    assert cache.residency.budget.state(r1) == "sparse"
    assert cache.residency.budget.free_pages == free
    cache.residency.promote(r1)
    cache.release(r1)
    del ids[r1], lens[r1]
    assert cache.residency.budget.free_pages == free + cache.residency.budget.block_pages
    with pytest.raises(ValueError, match="not sparse"):
        cache.residency.promote(r0)
    _run_steps(rng, cache, ids, lens, 3)
    cache.close()


def test_mirror_skips_slots_without_a_row(rng):
    """mirror_layer(rows=True) with a budget: request slots with no rows (not admitted, or
    resident) have slot rows -1, which the rearrangement must skip. Here the sparse request's
    slot 0 sits on the last device row, and the two layers hold its first two tokens in
    swapped slots: the last row must get the destination layer's bytes of its token, not
    keep its own."""
    import cupy

    cache = _cache(R * (MAXLEN + 96))
    rid = cache.admit(300, kv=kv_for(0, 0, 300), resident=False,
                      warm_tokens=np.arange(200, 200 + H))
    D = cache.residency.n_rows
    t = cache.tables
    locs = cupy.asnumpy(t.slot_locs[0, rid])
    k = np.nonzero(locs == D - 1)[0]
    if k.size:  # the last row is the request's: give slot 0 that row
        locs[[0, k[0]]] = locs[[k[0], 0]]
    else:  # a row no slot uses (scratch or spare): slot 0 takes it
        assert D - 1 not in cupy.asnumpy(t.scratch_locs[0, rid])
        locs[0] = D - 1
    toks = cupy.asnumpy(t.slot_tokens[0, rid])
    assert (toks[:2] >= 0).all()
    swapped = toks.copy()
    swapped[[0, 1]] = toks[[1, 0]]
    for layer, tk in ((0, toks), (1, swapped)):
        t.slot_locs[layer, rid] = cupy.asarray(locs)
        t.slot_tokens[layer, rid] = cupy.asarray(tk)
        if t.token_slot is not None:
            t.token_slot[layer, rid] = -1
        # the device rows hold each slot's token, in this layer's bytes
        cache.device_rows(layer)[cupy.asarray(locs[tk >= 0])] = cupy.asarray(
            kv_for(0, 0, 300)[layer][tk[tk >= 0]])
    cache.mirror_layer(0, 1, rows=True)
    for layer in (0, 1):
        check_rows(cache, layer, 0, toks[toks >= 0], locs[toks >= 0])
    cache.close()


def test_a_promotions_page_table_survives_growth_during_its_fill(rng):
    """Growth while a promotion fills (its side stream held busy here, as a loaded GPU may):
    the page taken by the growth stays in the request's device page table after the switch,
    so the newest token's row is its page row."""
    import cupy

    from _util import spin

    cache = _cache(R * (MAXLEN + 2 * _block()))
    n = 4 * PAGE  # a page boundary: the next token needs a new page
    rid = cache.admit(n, kv=kv_for(0, 0, n), resident=False)
    ids, lens = {rid: 0}, {rid: n}
    side = cache.residency._arena._side = cupy.cuda.Stream(non_blocking=True)
    with side:
        spin(cupy, 200_000_000)  # ~0.1 s
    cache.residency.promote(rid)
    cache.grow(rid, n + 1)  # a new page, while the fill waits
    side.synchronize()
    _run_steps(rng, cache, ids, lens, 3)  # switches at the first begin_step
    assert cache.residency.budget.state(rid) == "resident"
    table = cupy.asnumpy(cache.residency._arena.page_table[rid])
    want = cache.residency.budget.page_table(rid, table.size)
    assert (table == want).all(), (table, want)
    cache.close()


def _lean_rig(rng, n):
    """An all-resident cache over requests of lengths ``n`` (prompts written), its batch."""
    import cupy

    cache = _cache(R * (MAXLEN + 2 * _block()))
    rids = [cache.admit(m, kv=kv_for(i, 0, m)) for i, m in enumerate(n)]
    return cache, cupy.asarray(rids, cupy.int32), cupy.asarray(n, cupy.int32)


def _topk(rng, n):
    return np.stack([rng.choice(m, K, replace=False) for m in n]).astype(np.int32)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_lean_step_through_a_prefetcher_eager_and_captured(rng, prefetch):
    """Every request resident: the step runs lean by default, its full layer's resolve alone,
    and the prefetcher serves the shared layers the full layer's rows with no replay (prefetch
    on or off), bytes checked in every layer, eager and from a graph replayed with new
    top-k; the same top-k through a step begun ``lean=False`` gives the same rows."""
    import cupy

    from hisparse_cupy import Prefetcher

    n = [300, 100, 40]
    cache, req, seq = _lean_rig(rng, n)
    pf = Prefetcher(cache, "FSS", enabled=prefetch)
    s = cupy.cuda.Stream(non_blocking=True)
    tk_dev = cupy.empty((len(n), K), cupy.int32)
    outs = cupy.full((L, len(n), K), -7, cupy.int32)

    def step(lean=None):
        with s:  # the copies into outs too
            st = cache.begin_step(req, seq, prefetcher=pf, lean=lean)
            for layer in range(L):
                outs[layer] = st.swap(layer, tk_dev if layer == 0 else None)
            st.finish()
        return st

    for captured in (False, True):
        tk = _topk(rng, n)
        tk_dev.set(tk, stream=s)
        if captured:
            s.begin_capture()
            st = step()
            graph = s.end_capture()
            tk = _topk(rng, n)
            tk_dev.set(tk, stream=s)
            outs.fill(-7)
            graph.launch(s)
        else:
            st = step()
        assert st.lean
        s.synchronize()
        got = cupy.asnumpy(outs)
        for layer in range(L):
            assert (got[layer] == got[0]).all()
            for b in range(len(n)):
                check_rows(cache, layer, b, tk[b], got[layer, b])
        assert (cupy.asnumpy(cache.plan.count[:len(n)]) == 0).all()
    step(lean=False)
    s.synchronize()
    assert (cupy.asnumpy(outs) == got).all()
    cache.close()


def test_a_lean_graph_refuses_a_request_demoted_after_its_capture(rng):
    """A graph captured lean and replayed after a demotion: the demoted request's row is
    refused (-1 entries, status BADROW_NOT_RESIDENT; nothing planned, no other row touched),
    never served stale rows; raise_on_status names it; ``lean=True`` now raises."""
    import cupy

    from hisparse_cupy import _abi

    n = [300, 100]
    cache, req, seq = _lean_rig(rng, n)
    s = cupy.cuda.Stream(non_blocking=True)
    tk = _topk(rng, n)
    tk_dev = cupy.asarray(tk)
    out = cupy.full((len(n), K), -7, cupy.int32)
    s.begin_capture()
    with s:
        st = cache.begin_step(req, seq)
        out[...] = st.swap(1, tk_dev)
    graph = s.end_capture()
    assert st.lean
    cache.residency.demote(int(req[1]), stream=s)
    s.synchronize()
    before = cupy.asnumpy(cache.device_rows(1))
    graph.launch(s)
    s.synchronize()
    got = cupy.asnumpy(out)
    check_rows(cache, 1, 0, tk[0], got[0])
    assert (got[1] == -1).all()
    status = cupy.asnumpy(cache.status[:2])
    assert status[1, _abi.ST_BADROW] == _abi.BADROW_NOT_RESIDENT and not status[0].any()
    assert int(cache.plan.count[1]) == 0
    assert (cupy.asnumpy(cache.device_rows(1)) == before).all()
    with pytest.raises(ValueError, match="not resident, in a lean step"):
        st.raise_on_status(tk_dev)
    with pytest.raises(ValueError, match=r"lean=True needs every admitted request resident"):
        cache.begin_step(req, seq, stream=s, lean=True)
    st = cache.begin_step(req, seq, stream=s)
    assert not st.lean
    got = cupy.asnumpy(st.swap(1, tk_dev, check=True))
    for b in range(2):
        check_rows(cache, 1, b, tk[b], got[b])
    cache.close()


def test_lean_needs_a_budget_and_a_bool(rng):
    import cupy

    from hisparse_cupy import HotBufferCache

    cache = HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=P)
    r = cache.admit(50, kv=kv_for(0, 0, 50))
    req, seq = cupy.asarray([r], cupy.int32), cupy.asarray([50], cupy.int32)
    assert not cache.begin_step(req, seq).lean
    with pytest.raises(ValueError, match="no device budget"):
        cache.begin_step(req, seq, lean=True)
    with pytest.raises(TypeError, match="lean must be"):
        cache.begin_step(req, seq, lean=1)
    cache.close()


def test_torch_operators_follow_residency_changes(rng):
    """The torch operators over a budget's cache: steps lean while every request is resident,
    a new (not lean) step after a demotion between steps, the promotion switched at the first
    call after ``finish``; every selected token's bytes checked through the operators."""
    torch = pytest.importorskip("torch")
    import cupy

    from hisparse_cupy.torch import TorchCache

    n = [300, 100]
    cache, _, _ = _lean_rig(rng, n)
    tc = TorchCache(cache)
    lens = list(n)
    req = torch.tensor([0, 1], dtype=torch.int32, device="cuda")

    def step():
        seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
        tk = _topk(rng, lens)
        for layer in range(L):
            got = tc.swap(layer, torch.as_tensor(tk, device="cuda"), req, seq)
            torch.cuda.synchronize()
            for b in range(2):
                check_rows(cache, layer, b, tk[b], got[b].cpu().numpy())
        tc.finish()
        return tc.step(req, seq, None)

    assert step().lean
    cupy.cuda.get_current_stream().synchronize()
    cache.residency.demote(1, stream=torch.cuda.current_stream())
    assert not step().lean  # the demoted request's rows through the sparse path
    cache.residency.promote(1, stream=torch.cuda.current_stream())
    cache.residency._arena.promoting[1][0].synchronize()  # the fill landed
    step()  # finish() forgets the step: the next call's begin_step switches the promotion
    assert cache.residency.budget.state(1) == "resident" and not cache.residency._arena.promoting
    assert step().lean
    cache.close()


def test_the_default_policy_makes_room_and_promotes_when_it_returns(rng):
    """make_room demotes the longest idle resident request (bytes checked through steps
    after it), refuses with nothing changed when no demotion makes the room or a token count
    is given (the cache counts them); promote_ready promotes once room returns, keep_free
    respected."""
    from hisparse_cupy import PoolExhausted

    n = [300, 200, 100]
    block = _block()
    from hisparse_cupy.residency import DeviceBudget

    cache = _cache(DeviceBudget.rows_needed([m + 40 for m in n], 1, page_tokens=PAGE,
                                            block_rows=block))
    b = cache.residency.budget
    ids, lens = {}, {}
    for i, m in enumerate(n):
        r = cache.admit(m, kv=kv_for(i, 0, m))
        ids[r], lens[r] = i, m
    assert all(b.state(r) == "resident" for r in ids)
    b.touch([1, 2])  # request 0 idle longest
    free = b.free_pages
    with pytest.raises(TypeError, match="positional argument"):
        cache.residency.make_room(free + 1, {1: lens[1]})
    with pytest.raises(PoolExhausted):
        cache.residency.make_room(10**6)
    assert all(b.state(r) == "resident" for r in ids) and b.free_pages == free
    assert cache.residency.make_room(free + 1) == [0]
    assert b.state(0) == "sparse" and b.free_pages >= free + 1
    _run_steps(rng, cache, ids, lens, 3)  # request 0 through the sparse path
    assert cache.residency.promote_ready(keep_free=b.free_pages) == []  # would eat the reserve
    assert cache.residency.promote_ready() == [0]
    cache.residency._arena.promoting[0][0].synchronize()
    _run_steps(rng, cache, ids, lens, 3)  # its begin_step switches it
    assert b.state(0) == "resident"
    cache.close()


def test_a_cache_without_a_budget_has_a_residency_that_moves_nothing(rng):
    """``cache.residency`` without ``device_budget``: nothing resident, every move refused by
    name, ``admit(resident=True)`` refused with nothing taken (``resident=False`` and None
    admit sparse), ``switch_promoted`` orders its stream and switches nothing, steps never
    lean; the names that moved off the cache point to it."""
    import cupy

    cache = _cache(None)
    res = cache.residency
    assert not res.enabled and res.budget is None and res.n_rows is None
    with pytest.raises(ValueError, match="resident=True needs a device budget"):
        cache.admit(100, kv=kv_for(0, 0, 100), resident=True)
    assert cache.active == {}
    a = cache.admit(100, kv=kv_for(0, 0, 100), resident=False)
    assert a == 0  # the refused admission gave its slot back (the lowest free is taken)
    b = cache.admit(100, kv=kv_for(1, 0, 100))
    assert sorted(cache.active) == [a, b] and res.state(a) == res.state(b) == "sparse"
    for call, args in (("demote", (a,)), ("promote", (a,)), ("make_room", (4,)),
                       ("promote_ready", ())):
        with pytest.raises(ValueError, match=f"{call} needs a device budget"):
            getattr(res, call)(*args)
    s = cupy.cuda.Stream(non_blocking=True)
    assert res.switch_promoted(stream=s) == [] and not res.lean_step()
    with pytest.raises(AttributeError, match=r"moved in 0.2: call cache\.residency\.demote"):
        cache.demote(a)
    _run_steps(rng, cache, {a: 0, b: 1}, {a: 100, b: 100}, 2)  # (bytes checked)
    cache.close()
