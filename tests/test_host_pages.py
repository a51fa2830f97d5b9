"""The host pool's pages (``hisparse_cupy.host._pages``): rows, prefix sharing, engine-held pages,
bad input, and a randomized run of 100k operations against a model of the page counts and of
every row's contents (a page two holders share is never written)."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy.host._pages import HostPages, PoolExhausted


def test_rows_follow_the_pages():
    hp = HostPages(10, 4)
    assert (hp.n_rows, hp.free_pages, hp.pages_for(9)) == (40, 10, 3)
    assert hp.admit(7, 9) == []
    pg = hp.pages(7)
    t = np.arange(9)
    np.testing.assert_array_equal(hp.rows(7), np.asarray(pg)[t // 4] * 4 + t % 4)
    np.testing.assert_array_equal(hp.rows(7, 5, 8), hp.rows(7)[5:8])
    for a in range(10):  # every range, empty ones and page edges too
        for b in range(a, 10):
            np.testing.assert_array_equal(hp.rows(7, a, b), hp.rows(7)[a:b])
    tab = hp.table(7, 12)
    assert (tab[:9] == hp.rows(7)).all() and (tab[9:] == -1).all()
    assert hp.grow(7, 12) == [] and hp.tokens(7) == 12  # the third page holds them
    assert len(hp.grow(7, 13)) == 1 and hp.free_pages == 6
    hp.release(7)
    assert hp.free_pages == 10 and 7 not in hp
    hp.check()


def test_a_prefix_shares_whole_pages_and_copies_the_partial_one():
    hp = HostPages(16, 4)
    hp.admit(0, 10)
    copies = hp.admit(1, 12, prefix=(0, 6))  # page 0 shared, page 1 (tokens 4-5) copied
    parent, child = hp.pages(0), hp.pages(1)
    assert child[0] == parent[0] and child[1] != parent[1]
    assert copies == [(parent[1] * 4, child[1] * 4, 2)]
    assert hp.refs[parent[0]] == 2 and hp.own_from(1) == 4 and hp.own_from(0) == 4
    hp.check()
    hp.release(0)  # the parent first: the shared page stays for the child
    assert hp.refs[child[0]] == 1 and hp.free_pages == 16 - 3
    hp.check()
    hp.admit(2, 8, prefix=(1, 8))  # whole pages only: nothing to copy
    assert hp.pages(2) == child[:2] and hp.own_from(1) == 8
    hp.release(1)
    hp.release(2)
    assert hp.free_pages == 16
    hp.check()


def test_pages_given_back_come_out_again_as_the_runs_they_were():
    """Pages freed (a request released, or the engine's put back) are handed out again in
    the order they were held: a run of consecutive pages stays one run (a transfer or copy per
    run, not one per page), round after round."""
    from hisparse_cupy.host._pages import consecutive_runs

    hp = HostPages(3 * 32, 4)
    for _ in range(3):
        held = [hp.take(32) for _ in range(3)]
        assert [len(consecutive_runs(np.asarray(h, np.int64))[0]) for h in held] == [1, 1, 1]
        assert sorted(sum(held, [])) == list(range(96))
        for h in held:
            hp.put(h)
    for rid in range(3):
        hp.admit(rid, 4 * 32)
        first = hp.pages(rid)[0]
        assert hp.pages(rid) == list(range(first, first + 32))
    was = hp.pages(1)
    hp.release(1)
    hp.admit(5, 4 * 32)
    assert hp.pages(5) == was
    hp.check()


def test_engine_held_pages():
    hp = HostPages(8, 4)
    mine = hp.take(2)
    assert hp.free_pages == 6 and (hp.refs[mine] == 1).all()
    hp.admit(3, 10, pages=mine)  # tokens 0-7 in the engine's pages, 8-9 in a new one
    assert hp.pages(3)[:2] == mine and hp.own_from(3) == 8 and (hp.refs[mine] == 2).all()
    hp.put(mine)
    hp.check()
    with pytest.raises(ValueError, match="not held by the engine"):  # put twice: the request
        hp.put(mine[:1])  # still has it
    hp.release(3)
    assert hp.free_pages == 8
    hp.check()


def test_bad_input_names_the_argument_and_changes_nothing():
    hp = HostPages(6, 4)
    hp.admit(0, 10)
    held = hp.take(1)
    before = (hp.refs.copy(), hp.free_pages, hp.pages(0))
    bad = [
        (lambda: hp.admit(0, 4), ValueError, "rid 0 is already admitted"),
        (lambda: hp.admit(1, 0), ValueError, "n_tokens"),
        (lambda: hp.admit(1, 20), PoolExhausted, "needs 5 free host pages, 2 are free"),
        (lambda: hp.admit(1, 8, prefix=(5, 2)), KeyError, "prefix's parent 5 is not admitted"),
        (lambda: hp.admit(1, 8, prefix=(0, 11)), ValueError, "prefix tokens"),
        (lambda: hp.admit(1, 4, prefix=(0, 6)), ValueError, "longer than n_tokens"),
        (lambda: hp.admit(1, 8, prefix=0), TypeError, "prefix must be"),
        (lambda: hp.admit(1, 8, prefix=(0, 4), pages=held), ValueError, "not both"),
        (lambda: hp.admit(1, 3, pages=held), ValueError, "give whole pages only"),
        (lambda: hp.admit(1, 8, pages=[held[0], held[0]]), ValueError, "a page twice"),
        (lambda: hp.admit(1, 8, pages=[5 if held[0] != 5 else 4]), ValueError, "is not held"),
        (lambda: hp.admit(1, 8, pages=[99]), ValueError, "page 99 is not held"),
        # a request's own page is not the engine's to share or to put
        (lambda: hp.admit(1, 4, pages=[hp.pages(0)[1]]), ValueError, "not held by the engine"),
        (lambda: hp.put([hp.pages(0)[0]]), ValueError, "not held by the engine"),
        (lambda: hp.grow(0, 9), ValueError, "n_tokens"),
        (lambda: hp.grow(0, 40), PoolExhausted, "growing to 40 tokens"),
        (lambda: hp.grow(4, 12), KeyError, "rid 4 is not admitted"),
        (lambda: hp.release(4), KeyError, "rid 4"),
        (lambda: hp.take(3), PoolExhausted, r"take\(3\)"),
        (lambda: hp.put([held[0], held[0]]), ValueError, "a page twice"),
        (lambda: hp.rows(0, 5, 11), ValueError, "stop"),
        (lambda: hp.table(0, 9), ValueError, "max_len"),
    ]
    for call, exc, match in bad:
        with pytest.raises(exc, match=match):
            call()
        assert (hp.refs == before[0]).all() and hp.free_pages == before[1], match
        assert hp.pages(0) == before[2] and 1 not in hp, match
    hp.check()
    with pytest.raises(ValueError, match="page_tokens"):
        HostPages(4, 0)


@pytest.mark.slow
def test_random_operations_against_a_model():
    """100k admit / grow / fork / release / take / put operations on a small pool (often
    exhausted). The model keeps abstract pages and their holders: the free count, each
    request's pages and whether a call must run out of pages are its predictions. Every row
    holds the identity of what was written there: a request's rows must hold its tokens' (its
    own, or its ancestors' for a prefix, or the engine's), and a write into a page with another
    holder fails the test."""
    rng = np.random.default_rng(7)
    for P, n_pages, ops in ((4, 48, 60_000), (16, 24, 40_000)):
        _drive(rng, P, n_pages, ops)


def _drive(rng, P: int, n_pages: int, ops: int) -> None:
    hp = HostPages(n_pages, P)
    content = np.full(hp.n_rows, -1, np.int64)  # the identity each row holds
    ids = iter(range(1, 10**9))
    holders: dict[int, int] = {}  # model page key -> holders
    where: dict[int, int] = {}  # model page key -> its page
    keys: dict[int, list[int]] = {}  # request -> its model page keys
    want: dict[int, np.ndarray] = {}  # request -> identity of each of its tokens
    engine: list[tuple[int, np.ndarray]] = []  # engine holds: (key, identities of P rows)
    stats = dict.fromkeys(("admit", "fork", "pages", "grow", "exhausted"), 0)

    def free() -> int:
        return n_pages - sum(1 for v in holders.values() if v > 0)

    def new_keys(n: int) -> list[int]:
        out = [next(ids) for _ in range(n)]
        for k in out:
            holders[k] = 1
        return out

    def bind(rid: int) -> None:  # map the model's new keys to the allocator's pages
        for k, g in zip(keys[rid], hp.pages(rid), strict=True):
            assert where.setdefault(k, g) == g, (rid, k)

    def write(rid: int, start: int, stop: int) -> None:
        rows = hp.rows(rid, start, stop)
        assert (hp.refs[rows // P] == 1).all(), "a write into a page another holder has"
        content[rows] = want[rid][start:stop]

    def drop(ks) -> None:
        for k in ks:
            holders[k] -= 1
            if holders[k] == 0:
                del holders[k], where[k]

    for op in range(ops):
        live = list(keys)
        r = rng.random()
        if r < 0.35 or not live:  # admit: fresh, a prefix of a live request, engine pages
            rid = int(rng.integers(0, 4 * n_pages))
            if rid in keys:
                continue
            n = int(rng.integers(1, 6 * P))
            kind = rng.choice(["admit", "fork", "pages"]) if live else "admit"
            if kind == "fork":
                par = int(rng.choice(live))
                p = int(rng.integers(1, hp.tokens(par) + 1))
                n = max(n, p)
                shared = keys[par][: p // P]
                need = hp.pages_for(n) - len(shared)
                if need > free():
                    with pytest.raises(PoolExhausted):
                        hp.admit(rid, n, prefix=(par, p))
                    stats["exhausted"] += 1
                    continue
                copies = hp.admit(rid, n, prefix=(par, p))
                for k in shared:
                    holders[k] += 1
                keys[rid] = shared + new_keys(need)
                ident = np.concatenate([want[par][:p], rid * 10**6 + np.arange(p, n)])
                want[rid] = ident
                for src, dst, cnt in copies:  # the caller's copy of the partial page
                    assert (hp.refs[dst // P] == 1) and cnt == p % P
                    content[dst:dst + cnt] = content[src:src + cnt]
                write(rid, p, n)
            elif kind == "pages" and engine:
                m = int(rng.integers(1, len(engine) + 1))
                held = engine[:m]
                n = max(n, m * P)
                need = hp.pages_for(n) - m
                if need > free():
                    with pytest.raises(PoolExhausted):
                        hp.admit(rid, n, pages=[where[k] for k, _ in held])
                    stats["exhausted"] += 1
                    continue
                hp.admit(rid, n, pages=[where[k] for k, _ in held])
                for k, _ in held:
                    holders[k] += 1
                keys[rid] = [k for k, _ in held] + new_keys(need)
                want[rid] = np.concatenate([c for _, c in held] +
                                           [rid * 10**6 + np.arange(m * P, n)])
                write(rid, m * P, n)
            else:
                kind = "admit"
                need = hp.pages_for(n)
                if need > free():
                    with pytest.raises(PoolExhausted):
                        hp.admit(rid, n)
                    stats["exhausted"] += 1
                    continue
                assert hp.admit(rid, n) == []
                keys[rid] = new_keys(need)
                want[rid] = rid * 10**6 + np.arange(n)
                write(rid, 0, n)
            stats[kind] += 1
            bind(rid)
        elif r < 0.6:  # grow by a few tokens (a decode step or a chunk of prefill)
            rid = int(rng.choice(live))
            n0 = hp.tokens(rid)
            n = n0 + int(rng.integers(0, 2 * P))
            need = hp.pages_for(n) - len(keys[rid])
            if need > free():
                with pytest.raises(PoolExhausted):
                    hp.grow(rid, n)
                stats["exhausted"] += 1
                continue
            assert len(hp.grow(rid, n)) == max(0, need)
            keys[rid] += new_keys(max(0, need))
            want[rid] = np.concatenate([want[rid], rid * 10**6 + np.arange(n0, n)])
            write(rid, n0, n)
            bind(rid)
            stats["grow"] += 1
        elif r < 0.85:  # release
            rid = int(rng.choice(live))
            hp.release(rid)
            drop(keys.pop(rid))
            del want[rid]
        elif r < 0.93:  # the engine takes a page and fills it
            if not free():
                with pytest.raises(PoolExhausted):
                    hp.take(1)
                continue
            (g,) = hp.take(1)
            (k,) = new_keys(1)
            where[k] = g
            ident = -(next(ids) * 10**3 + np.arange(P)) - 2
            content[g * P:(g + 1) * P] = ident
            engine.append((k, ident))
        elif engine:  # the engine drops a page
            k, _ = engine.pop(int(rng.integers(len(engine))))
            hp.put([where[k]])
            drop([k])
        assert hp.free_pages == free(), op
        if keys:  # one request's rows read back what it holds
            rid = int(rng.choice(list(keys)))
            assert hp.pages(rid) == [where[k] for k in keys[rid]], (op, rid)
            np.testing.assert_array_equal(content[hp.rows(rid)], want[rid], err_msg=str(op))
        if op % 1000 == 0:
            hp.check()
    hp.check()
    for rid in list(keys):
        hp.release(rid)
    hp.put([where[k] for k, _ in engine])
    assert hp.free_pages == n_pages and not hp.refs.any()
    # the run went everywhere: forks, engine pages, growth, and pools run dry
    assert min(stats.values()) > 500, stats


def test_a_mixed_batch_takes_at_most_a_page_per_request_more_than_its_tokens():
    """Issue target: 64 requests of 1k-128k tokens (GLM-5.2: 78 layers, 656-byte rows)."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1024, 128 * 1024 + 1, 64)
    row = 78 * 656
    need = HostPages.host_bytes_needed(lens, page_tokens=64, n_layers=78, row_bytes=656)
    assert lens.sum() * row <= need <= (lens.sum() + 64 * 63) * row
    hp = HostPages(int((-(-lens // 64)).sum()), 64)  # exactly that many pages: every one fits
    for r, n in enumerate(lens):
        hp.admit(r, int(n))
    assert hp.free_pages == 0 and hp.n_rows * row == need
    with pytest.raises(PoolExhausted):
        hp.grow(0, int(-(-lens[0] // 64) * 64 + 1))
    with pytest.raises(ValueError, match="lengths must be"):
        HostPages.host_bytes_needed([-1], page_tokens=64, n_layers=1, row_bytes=1)


def test_the_fingerprint_is_equal_after_the_same_calls_and_differs_otherwise():
    """Two allocators fed the same random calls agree at every step (what tensor-parallel
    ranks over one shared pool check); one different call (another page order, one more
    token) changes it."""
    rng = np.random.default_rng(5)
    a, b = HostPages(40, 4), HostPages(40, 4)
    assert a.fingerprint() == b.fingerprint()
    live = []
    for _ in range(300):
        op = rng.integers(4)
        if op == 0 and len(live) < 8 and a.free_pages >= 6:
            r = int(rng.integers(1 << 20))
            if r not in live:
                n = int(rng.integers(1, 20))
                for x in (a, b):
                    x.admit(r, n)
                live.append(r)
        elif op == 1 and live:
            r = live[int(rng.integers(len(live)))]
            n = a.tokens(r) + int(rng.integers(0, 6))
            if a.pages_for(n) - len(a.pages(r)) <= a.free_pages:
                for x in (a, b):
                    x.grow(r, n)
        elif op == 2 and live:
            r = live.pop(int(rng.integers(len(live))))
            for x in (a, b):
                x.release(r)
        elif op == 3 and a.free_pages >= 2:
            got = [x.take(2) for x in (a, b)]
            for x, g in zip((a, b), got, strict=True):
                x.put(g[::-1])
        assert a.fingerprint() == b.fingerprint()
    c = HostPages(40, 4)
    c.put(c.take(3)[::-1])  # the same pages free, handed out in another order
    assert c.fingerprint() != HostPages(40, 4).fingerprint()
    d, e = HostPages(40, 4), HostPages(40, 4)
    d.admit(0, 5)
    e.admit(0, 6)  # the same pages, one more token
    assert d.pages(0) == e.pages(0) and d.fingerprint() != e.fingerprint()


def test_pool_exhausted_pickles_with_its_fields():
    """PoolExhausted crosses a process boundary (a worker pool's result) with its message and
    fields."""
    import pickle

    from hisparse_cupy import PoolExhausted

    e = pickle.loads(pickle.dumps(PoolExhausted("admit(rid 3)", 7, 2, "device")))
    assert isinstance(e, PoolExhausted)
    assert (e.what, e.needed, e.free, e.kind) == ("admit(rid 3)", 7, 2, "device")
    assert str(e) == "admit(rid 3) needs 7 free device pages, 2 are free"


class Fence:
    """A stand-in for a CUDA event: ``done`` once ``synchronize``d (or set)."""

    def __init__(self, name):
        self.name, self.done, self.waited = name, False, 0

    def synchronize(self):
        self.waited += 1
        self.done = True

    def __repr__(self):
        return self.name


def test_pages_given_back_carry_their_fences_to_whoever_takes_them():
    """Issue 60's one rule for page reuse (``docs/design.md`` section 10): a page given back
    (release, put) carries the fence of the last work on it, shared pages gather every
    holder's, and every path that takes pages (admit, grow, take) hands the fences of exactly
    the pages it took to ``wait=`` (or, by default, waits on the host) before they are used;
    a fence already done is dropped, a page taken again carries nothing."""
    from hisparse_cupy.host import HostPages

    hp = HostPages(8, 4)
    hp.admit(0, 8)  # pages 0, 1
    hp.admit(1, 4, prefix=(0, 4))  # shares page 0
    a, b = Fence("a"), Fence("b")
    hp.release(0, fence=a)  # page 1 free; page 0 still 1's, carrying a
    assert hp.fences(range(8)) == [a] and hp.fences([0]) == [a] and hp.fences([1]) == [a]
    hp.release(1, fence=b)  # page 0 free too, carrying a and b
    assert set(map(repr, hp.fences([0]))) == {"a", "b"} and hp.fences([1]) == [a]
    got = []
    hp.admit(2, 4, wait=got.extend)  # pops page 0 (pushed last: first out)
    assert hp.pages(2) == [0] and set(map(repr, got)) == {"a", "b"}
    assert hp.fences([0]) == [] and a.waited == b.waited == 0  # handed over, not waited
    b.done = True  # b's work done: page 1 still carries a
    got = []
    hp.grow(2, 8, wait=got.extend)
    assert hp.pages(2) == [0, 1] and got == [a]
    held = hp.take(2)  # the engine takes pages: nothing fenced, nothing waited
    c = Fence("c")
    hp.put(held, fence=c)
    assert hp.fences(held) == [c]
    again = hp.take(2)  # the default: waits on the host for c
    assert sorted(again) == sorted(held) and c.waited == 1 and hp.fences(range(8)) == []
    hp.put(again)
    hp.check()


def test_a_fence_done_is_dropped_and_groups_do_not_pile_up():
    """Many releases of short requests: fences done are dropped at the next give-back of the
    same pages, and the allocator keeps a bounded number of fence groups."""
    from hisparse_cupy.host import HostPages

    hp = HostPages(16, 2)
    for i in range(500):
        f = Fence(str(i))
        hp.admit(i, 5, wait=lambda fs: [x.synchronize() for x in fs])
        hp.release(i, fence=f)
        assert hp.fences(range(16)) == [f] or all(x.done for x in hp.fences(range(16)))
    assert len(hp._groups) <= 64 + 2 * 16
    hp.check()


def test_a_fence_that_fails_its_wait_takes_nothing():
    """``take`` (and ``admit``, ``grow``) wait for the fences of the pages they pop; a wait
    that raises (a CUDA error, the engine's ``wait=``) leaves the pages free, in their order,
    still carrying their fences: nothing taken, as a refusal promises."""
    from hisparse_cupy.host import HostPages

    class Failing(Fence):
        def synchronize(self):
            raise RuntimeError("CUDA error")

    hp = HostPages(8, 4)
    held = hp.take(3)
    bad = Failing("bad")
    hp.put(held, fence=bad)
    before = hp.free_pages
    with pytest.raises(RuntimeError, match="CUDA error"):
        hp.take(3)
    assert hp.free_pages == before and hp.fences(held) == [bad]

    def refuse(fences):
        raise RuntimeError("the engine's wait failed")

    with pytest.raises(RuntimeError, match="wait failed"):
        hp.admit(0, 12, wait=refuse)
    assert hp.free_pages == before and hp.fences(held) == [bad] and 0 not in hp
    bad.done = True
    assert sorted(hp.take(3)) == sorted(held)  # the same pages, first out as before
    hp.check()
