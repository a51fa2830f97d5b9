"""The device budget (``hisparse_cupy.residency``): pages of resident requests, blocks of sparse
ones, promotion and demotion, the default policy, bad input, and a randomized run against a
model of the page counts and of which request holds every device row."""

from __future__ import annotations

import numpy as np
import pytest

from hisparse_cupy.host import PoolExhausted
from hisparse_cupy.residency import DeviceBudget


def _snapshot(b: DeviceBudget):
    rids = sorted(r for r in range(64) if r in b)
    return (b.free_pages, [(r, b.state(r), b.tokens(r)) for r in rids])


def test_admission_picks_resident_while_it_fits_then_sparse():
    b = DeviceBudget(20, 4, block_rows=10)  # a block is 3 pages
    assert (b.n_rows, b.block_pages) == (80, 3)
    assert b.admit(0, 30) == "resident" and b.free_pages == 12  # 8 pages
    assert b.admit(1, 40) == "resident" and b.free_pages == 2  # 10 pages
    assert b.admit(2, 5) == "resident" and b.free_pages == 0  # 2 pages: the last ones
    b.release(1)
    assert b.admit(3, 400) == "sparse" and b.free_pages == 7  # 100 pages do not fit
    b.check()
    t = np.arange(30)
    pg = np.asarray(b.page_table(0, 10)[:8], np.int64)
    np.testing.assert_array_equal(b.rows(0), pg[t // 4] * 4 + t % 4)
    np.testing.assert_array_equal(b.rows(0, 3, 9), b.rows(0)[3:9])
    assert (b.page_table(0, 10)[8:] == -1).all()


def test_a_sparse_request_holds_a_block_of_whole_pages():
    b = DeviceBudget(10, 4, block_rows=10)
    assert b.admit(3, 500) == "sparse"  # 125 pages do not fit
    rows = b.block(3)
    assert rows.size == 10 and len(set(rows.tolist())) == 10 and b.free_pages == 7
    with pytest.raises(ValueError, match="rid 3 is sparse"):
        b.rows(3)
    assert (b.page_table(3, 4) == -1).all()
    b.grow(3, 900)  # a sparse request grows without pages
    assert b.free_pages == 7 and b.tokens(3) == 900
    b.release(3)
    assert b.free_pages == 10 and 3 not in b
    b.check()


def test_demotion_and_promotion_round_trip():
    b = DeviceBudget(32, 4, block_rows=12)  # block: 3 pages
    b.admit(0, 40)  # 10 pages
    b.admit(1, 20)  # 5 pages
    free = b.free_pages
    block, freed = b.demote(0)
    assert b.state(0) == "sparse" and len(freed) == 10 and block.size == 12
    assert b.free_pages == free + 10 - 3
    assert not set(block.tolist()) & {g * 4 + i for g in freed for i in range(4)}
    b.check()
    b.grow(0, 44)  # the steps go on while it is sparse
    rows = b.promote(0)
    assert b.state(0) == "promoting" and rows.size == 44
    assert not set(rows.tolist()) & set(block.tolist())  # the block stays while it fills
    b.check()
    b.grow(0, 46)  # a promoting request grows its pages
    assert b.rows(0).size == 46
    back = b.finish_promotion(0)
    assert b.state(0) == "resident" and len(back) == 3
    b.check()
    b.demote(0)
    b.promote(0)
    b.cancel_promotion(0)
    assert b.state(0) == "sparse"
    b.check()


def test_bad_input_and_exhaustion_change_nothing():
    with pytest.raises(ValueError, match="cannot hold one sparse request"):
        DeviceBudget(2, 4, block_rows=12)
    with pytest.raises(ValueError, match="block_rows"):
        DeviceBudget(8, 4, block_rows=0)
    b = DeviceBudget(8, 4, block_rows=8)  # block: 2 pages
    b.admit(0, 16)  # 4 pages
    b.admit(1, 100, resident=False)  # sparse: 2 pages; 2 free
    cases = [
        (lambda: b.admit(0, 4), ValueError, "already admitted"),
        (lambda: b.admit(2, 0), ValueError, "n_tokens"),
        (lambda: b.admit(2, 40, resident=True), PoolExhausted, "needs 10 free device pages"),
        (lambda: b.grow(0, 30), PoolExhausted, "free device pages"),
        (lambda: b.grow(0, 3), ValueError, "n_tokens"),
        (lambda: b.grow(9, 3), KeyError, "rid 9 is not admitted"),
        (lambda: b.demote(1), ValueError, "rid 1 is sparse, not resident"),
        (lambda: b.promote(0), ValueError, "rid 0 is resident, not sparse"),
        (lambda: b.promote(1), PoolExhausted, "needs 25 free device pages"),
        (lambda: b.finish_promotion(1), ValueError, "not promoting"),
        (lambda: b.cancel_promotion(0), ValueError, "not promoting"),
        (lambda: b.release(5), KeyError, "rid 5"),
        (lambda: b.room_for(-1), ValueError, "pages"),
        (lambda: b.room_for(6), PoolExhausted, "room for 6 pages"),
        (lambda: b.page_table(0, 3), ValueError, "holds 4 pages"),
    ]
    for call, exc, msg in cases:
        before = _snapshot(b)
        with pytest.raises(exc, match=msg) as e:
            call()
        if exc is PoolExhausted:
            assert e.value.kind == "device"
        assert _snapshot(b) == before, msg
        b.check()
    b.admit(2, 4)  # one page: resident
    b.admit(3, 4)  # the last page
    with pytest.raises(PoolExhausted, match="admit of rid 4 .sparse. needs 2"):
        b.admit(4, 400)  # neither fits
    b.check()


def test_room_for_demotes_the_longest_idle_then_the_largest():
    b = DeviceBudget(64, 4, block_rows=8)  # block: 2 pages
    for rid, n in ((0, 40), (1, 80), (2, 40), (3, 4)):
        b.admit(rid, n)  # 10, 20, 10, 1 pages: 23 free
    b.touch([0, 3])
    b.touch([0])  # idle longest: 1 (admitted first), 2, then 3, then 0
    assert b.room_for(20) == []
    assert b.room_for(30) == [1]  # +18 (20 pages for a block of 2)
    assert b.room_for(45) == [1, 2]  # +18 +8
    assert b.room_for(38, keep=[1]) == [2, 0]  # 3 is shorter than a block: skipped
    with pytest.raises(PoolExhausted, match="room for 38 pages"):
        b.room_for(38, keep=[1, 2])
    for r in b.room_for(45):
        b.demote(r)
    assert b.free_pages >= 45
    b.check()
    b.release(0)
    assert b.promotable() == [2, 1]  # most recently used first, both fit
    b.check()


def test_a_cooldown_keeps_moved_requests_where_they_went():
    """``cooldown`` steps of hysteresis: a demoted request (or a cancelled promotion) is not
    promotable until that many touches passed; a promoted one is named by room_for only after
    every other resident; 0 (the default) changes nothing; bad values are refused by name; the
    engine's own moves are never refused."""
    b = DeviceBudget(64, 4, block_rows=8)  # block: 2 pages
    for rid, n in ((0, 40), (1, 80), (2, 40)):
        b.admit(rid, n)  # 10, 20, 10 pages: 24 free
    assert b.cooldown == 0
    for bad in (-1, 1.5, "2"):
        with pytest.raises((TypeError, ValueError), match="cooldown"):
            b.cooldown = bad
    b.cooldown = 3
    b.demote(1)  # +18 free: 42
    assert b.promotable() == []  # cooling: demoted 0 steps ago
    b.touch([0, 2])
    b.touch([0, 2])
    assert b.promotable() == []  # 2 steps
    b.touch([0, 2])
    assert b.promotable() == [1]  # 3 steps: free to come back
    b.promote(1)  # (an engine's own move: never refused)
    b.cancel_promotion(1)
    assert b.promotable() == [] and b.state(1) == "sparse"  # a cancel cools down too
    for _ in range(3):
        b.touch([0, 1, 2])
    b.promote(1)
    b.finish_promotion(1)
    b.touch([1])
    b.touch([0, 2])  # 1 idle longest, but 2 steps since its promotion: named last
    assert b.room_for(b.free_pages + 30) == [0, 2, 1]  # +8 +8, then 1 (+18) only when needed
    assert b.room_for(b.free_pages + 8) == [0]
    b.touch([0, 2])  # 3 steps since the promotion: 1, the longest idle, first again
    assert b.room_for(b.free_pages + 8) == [1]
    b.cooldown = 0
    b.demote(0)
    assert 0 in b.promotable()  # no cooldown: at once, as before
    b.release(0)
    b.check()


def test_watermarks_band_the_policy_moves():
    """``watermarks = (low, high)``: promotable names nothing at or above low and takes
    requests only while the pages in use stay at or under high; excess names the residents to
    demote down to high (room_for's order, none cooling down, never one kept; best effort when
    no set reaches it; empty without a free block); (1.0, 1.0), the default, changes nothing;
    bad values are refused by name, leaving the band as it was."""
    b = DeviceBudget(100, 4, block_rows=8)  # block: 2 pages
    assert b.watermarks == (1.0, 1.0) and b.excess() == []
    for bad, err in (((0.6, 0.5), ValueError), ((-0.1, 0.5), ValueError),
                     ((0.2, 1.5), ValueError), ((float("nan"), 0.5), ValueError),
                     (0.5, TypeError), ((0.1, 0.2, 0.3), TypeError), ((True, 0.5), TypeError),
                     (("0.1", 0.5), TypeError)):
        with pytest.raises(err, match="watermarks"):
            b.watermarks = bad
    assert b.watermarks == (1.0, 1.0)
    for rid in range(4):
        b.admit(rid, 80, resident=False)  # 4 blocks: 8 pages in use
    b.touch([3])
    b.touch([2])  # most recently used: 2, 3, then 0, 1
    b.watermarks = (0.25, 0.5)
    assert b.watermarks == (0.25, 0.5)
    assert b.promotable() == [2, 3]  # 20 pages each: in use 8 -> 26 -> 44 <= 50; 0 would be 62
    for r in (2, 3):
        b.promote(r)
        b.finish_promotion(r)  # in use: 40 + 4 = 44
    assert b.promotable() == []  # 44 >= 25: at or above low, nothing
    assert b.excess() == []  # 44 <= 50
    b.grow(2, 120)  # 30 pages: in use 54 > 50
    assert b.excess() == [3]  # 3 idles longest (touched before 2): 54 - 20 + 2 = 36 <= 50
    assert b.excess(keep=[3]) == [2]
    b.touch([3])
    assert b.excess() == [2]  # now 2 idles longest
    for _ in range(5):
        b.touch([2, 3])  # both used now: the one holding more pages first
    b.cooldown = 5  # (2 and 3 were promoted 6 steps ago: not cooling)
    b.promote(0)
    b.finish_promotion(0)  # 0: promoted 0 steps ago; in use 54 + 20 - 2 = 72
    assert b.excess() == [2]  # 72 - 28 = 44 <= 50; 0 (cooling, idle longest) not named
    b.watermarks = (0.0, 0.1)  # no set reaches 10 pages in use: each non-cooling one that frees
    assert b.excess() == [2, 3]
    b.cooldown = 0
    assert b.excess() == [0, 2, 3]  # 0 idle longest: 28 + 18 + 28 + 18 = 92 pages free >= 90
    b.watermarks = (1.0, 1.0)
    assert b.excess() == [] and b.promotable() == [1]  # no band: 1 fits (28 free), as before
    b.check()


def test_the_low_watermark_is_a_share_not_rounded():
    """promotable names nothing while the pages in use are ``low * n_pages`` or more, that
    product unrounded: 5 pages in use of 10 are under 0.55 but not under 0.5."""
    b = DeviceBudget(10, 4, block_rows=4)  # block: 1 page
    b.admit(0, 16, resident=True)  # 4 pages
    b.admit(1, 4, resident=False)  # its block: 5 in use
    b.watermarks = (0.55, 1.0)
    assert b.promotable() == [1]
    b.watermarks = (0.5, 1.0)
    assert b.promotable() == []
    b.watermarks = (0.55, 0.55)  # promoting 1 takes its page before its block returns: 6 > 5.5
    assert b.promotable() == []


def test_excess_needs_a_free_block():
    """The first demotion takes its block before its pages return: with fewer free pages than
    a block, excess names nothing, however far over the high watermark."""
    b = DeviceBudget(10, 4, block_rows=8)  # block: 2 pages
    b.admit(0, 40)  # 10 pages: none free
    b.watermarks = (0.0, 0.5)
    assert b.free_pages == 0 and b.excess() == []
    b.release(0)
    b.admit(0, 32)  # 8 pages, 2 free
    assert b.excess() == [0]  # 8 - 2 = 6 freed: 2 in use <= 5


def test_room_for_refuses_when_the_first_demotion_has_no_block():
    """A demotion takes its block before its pages return: with fewer free pages than a
    block, no demotion can start, and room_for says so rather than name victims."""
    b = DeviceBudget(10, 4, block_rows=8)  # block: 2 pages
    b.admit(0, 32)  # 8 pages
    b.admit(1, 5)  # 2 pages: none free
    assert b.free_pages == 0 and b.room_for(0) == []
    with pytest.raises(PoolExhausted, match="a demotion first takes a block of 2"):
        b.room_for(1)
    assert b.state(0) == b.state(1) == "resident" and b.free_pages == 0
    b.release(1)  # 2 free: the block fits, demoting 0 frees 8 - 2
    assert b.room_for(8) == [0]


def test_rows_needed_is_what_a_budget_takes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        P, block = int(rng.integers(1, 9)), int(rng.integers(1, 40))
        lens = rng.integers(1, 200, int(rng.integers(0, 6)))
        n_sparse = int(rng.integers(0, 4))
        rows = DeviceBudget.rows_needed(lens, n_sparse, page_tokens=P, block_rows=block)
        b = DeviceBudget(max(1, rows // P), P, block_rows=block) if rows else None
        if b is None:
            assert lens.size == 0 and n_sparse == 0
            continue
        for i, n in enumerate(lens):
            assert b.admit(i, int(n), resident=True) == "resident"
        for j in range(n_sparse):
            assert b.admit(100 + j, 1000, resident=False) == "sparse"
        assert b.free_pages == 0
        b.check()
    with pytest.raises(ValueError, match="resident_lengths"):
        DeviceBudget.rows_needed([0], page_tokens=4, block_rows=8)


MOVES = [(0.55, "demote", "sparse"), (0.65, "promote", "promoting"),
         (0.72, "finish_promotion", "resident"), (0.76, "cancel_promotion", "sparse")]


@pytest.mark.slow
def test_randomized_against_a_model():
    """50k operations at random (admit in any state, grow, demote, promote, finish, cancel,
    release, the policy's picks carried out, its cooldown and watermarks changed): after each
    the budget's invariants hold, the free pages equal the model's count, the requests not
    resident are the model's (a lean step's rule), no device row is held by two requests, the
    policy's promotions start under the low watermark and stay under the high one, and its
    demotions reach the high one or name nothing more."""
    rng = np.random.default_rng(47)
    n_pages, P, block_rows = 96, 4, 14
    b = DeviceBudget(n_pages, P, block_rows)
    model: dict[int, list] = {}  # rid -> [state, tokens]
    bp = -(-block_rows // P)

    def expected_free():
        used = 0
        for st, n in model.values():
            used += (-(-n // P)) if st != "sparse" else 0
            used += bp if st != "resident" else 0
        return n_pages - used

    for i in range(50_000):
        op = rng.random()
        live = list(model)
        rid = int(rng.choice(live)) if live and rng.random() < 0.9 else int(rng.integers(16))
        try:
            if op < 0.2 and rid not in model:
                n = int(rng.integers(1, 120))
                want = [None, True, False][int(rng.integers(3))]
                model[rid] = [b.admit(rid, n, resident=want), n]
            elif op < 0.45 and rid in model:
                n = model[rid][1] + int(rng.integers(0, 9))
                b.grow(rid, n)
                model[rid][1] = n
            elif op < 0.76 and rid in model:  # a move between states
                name, after = next(m[1:] for m in MOVES if op < m[0])
                getattr(b, name)(rid)
                model[rid][0] = after
            elif op < 0.84 and rid in model:
                b.release(rid)
                del model[rid]
            elif op < 0.9 and live:
                b.touch(rng.choice(live, int(rng.integers(1, len(live) + 1)), replace=False))
                if rng.random() < 0.02:  # the policy's hysteresis, changed mid-run
                    b.cooldown = int(rng.integers(0, 6))
                if rng.random() < 0.02:
                    low = float(rng.random())
                    b.watermarks = (low, low + float(rng.random()) * (1 - low))
            elif op < 0.93:
                for r in b.room_for(int(rng.integers(0, 40))):
                    b.demote(r)
                    model[r][0] = "sparse"
            elif op < 0.95:
                high = int(b.watermarks[1] * n_pages + 1e-9)
                free0, victims = b.free_pages, b.excess()
                gains = [b.pages_for(model[r][1]) - bp for r in victims]
                assert all(g > 0 for g in gains) and (free0 >= bp or not victims), i
                if victims:  # each one needed: without the last, still over the band
                    assert n_pages - free0 - sum(gains[:-1]) > high, i
                for r in victims:
                    b.demote(r)
                    model[r][0] = "sparse"
                if b.cooldown == 0 and free0 >= bp:  # none cooling: at or under the band,
                    # or no resident left whose demotion frees a page
                    assert n_pages - b.free_pages <= high or all(
                        st != "resident" or b.pages_for(n) <= bp
                        for st, n in model.values()), i
            else:
                in_use = n_pages - b.free_pages
                low, high = b.watermarks[0] * n_pages, int(b.watermarks[1] * n_pages + 1e-9)
                for r in b.promotable():
                    assert in_use < low, i
                    b.promote(r)
                    model[r][0] = "promoting"
                    assert n_pages - b.free_pages <= high, i
        except (PoolExhausted, ValueError, KeyError):
            pass
        assert b.free_pages == expected_free(), i
        moving = sorted(r for r, (st, _) in model.items() if st != "resident")
        assert b.sparse() == moving and b.all_resident() == (not moving), i
        if i % 97 == 0:
            b.check()
            rows = []
            for r, (st, n) in model.items():
                assert b.state(r) == st and b.tokens(r) == n
                if st != "sparse":
                    rows += b.rows(r).tolist()
                if st != "resident":
                    rows += b.block(r).tolist()
            assert len(rows) == len(set(rows)), i
            assert all(0 <= x < b.n_rows for x in rows)
    b.check()


def test_the_demos_resident_plan_leaves_a_block_for_every_other_request():
    """The demo's admission plan under a device budget: the first k requests resident (pages
    for every token the run grows to), the rest sparse, k the largest that leaves a block for
    each of the others; greedy admission would starve the last requests of blocks."""
    from types import SimpleNamespace

    from hisparse_cupy.demo._loop import Rig

    P, block, B, max_len = 64, 4224, 8, 8242
    per = DeviceBudget.rows_needed([max_len], page_tokens=P, block_rows=block)
    blk = DeviceBudget.rows_needed([], 1, page_tokens=P, block_rows=block)
    for rows, k in ((B * per, B), (4 * per + 4 * blk, 4), (4 * per + 4 * blk - 1, 3),
                    (B * blk, 0)):
        budget = DeviceBudget(rows // P, P, block)
        rig = SimpleNamespace(cfg=SimpleNamespace(batch=B, max_len=max_len),
                              cache=SimpleNamespace(residency=SimpleNamespace(budget=budget)))
        plan = Rig.resident_plan(rig)
        assert plan == [True] * k + [False] * (B - k), (rows, plan)
        for i, r in enumerate(plan):  # and the admissions it plans all fit
            budget.admit(i, max_len, resident=r)
    rig.cache.residency.budget = None
    assert Rig.resident_plan(rig) == [None] * B


def test_max_resident_against_every_split(rng):
    """DeviceBudget.max_resident: the largest k whose first k requests resident and the rest
    sparse fit, by brute force over every k (short requests take fewer pages than a block, so
    the rows needed do not grow with k), -1 when none fits; bad input named."""
    P, block = 16, 100  # a block: 7 pages
    for _ in range(300):
        n = rng.integers(1, 400, int(rng.integers(0, 9)))
        rows = int(rng.integers(0, 3000))
        want = max((k for k in range(n.size + 1) if DeviceBudget.rows_needed(
            n[:k], n.size - k, page_tokens=P, block_rows=block) <= rows), default=-1)
        assert DeviceBudget.max_resident(n, rows, page_tokens=P, block_rows=block) == want
    assert DeviceBudget.max_resident([], 0, page_tokens=P, block_rows=block) == 0
    with pytest.raises(ValueError, match="lengths"):
        DeviceBudget.max_resident([5, 0], 100, page_tokens=P, block_rows=block)
    with pytest.raises(ValueError, match="n_rows"):
        DeviceBudget.max_resident([5], -1, page_tokens=P, block_rows=block)


def test_every_move_gives_pages_back_with_its_fence_and_takes_them_with_theirs():
    """Issue 60: each path of the budget that gives pages back (release, demotion, a cancelled
    promotion, a finished promotion's block) attaches its fence, and each path that takes
    pages (admission, growth, a demotion's block, a promotion) hands the fences of the pages
    it takes to its ``wait``: the next user of a page always waits for its last one."""
    from test_host_pages import Fence

    b = DeviceBudget(16, 4, block_rows=8)  # blocks of 2 pages
    took = []
    wait = took.extend
    assert b.admit(0, 16, wait=wait) == "resident"  # 4 pages
    fr = Fence("release")
    b.release(0, fence=fr)
    assert b.admit(1, 8, wait=wait) == "resident" and took == [fr]  # its 2 pages were 0's
    took.clear()
    fd = Fence("demote")
    b.demote(1, fence=fd, wait=wait)  # a block: 0's other pages (fenced by fr)
    assert took == [fr]
    took.clear()
    fc = Fence("fill")
    b.promote(1, wait=wait)  # 1's old pages back (fd)
    assert took == [fd]
    took.clear()
    b.cancel_promotion(1, fence=fc)
    b.promote(1, wait=wait)
    assert took == [fc]
    took.clear()
    ff = Fence("switch")
    block = b.finish_promotion(1, fence=ff)
    b.grow(1, 16, wait=wait)  # 2 more pages: the block's
    assert took == [ff] and sorted(b._pages.pages(1)[2:]) == sorted(block)
    b.check()
