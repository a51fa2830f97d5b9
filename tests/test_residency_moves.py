"""CPU: the cache's residency rules that need no GPU (``cache.residency``,
``residency/_residency.py``): whether a step runs lean, and the default policy's orchestration
(``make_room``, ``promote_ready``, ``shed``) over a :class:`DeviceBudget`, the moves themselves
recorded instead of queued; a cache without a budget; the names that moved off the cache."""

from __future__ import annotations

import pytest

from hisparse_cupy.host import PoolExhausted
from hisparse_cupy.residency import DeviceBudget, Residency
from hisparse_cupy.residency._residency import _Budgeted


class Moves(_Budgeted):
    """A budgeted residency over a budget alone: demote and promote carried out on the
    budget (no arena, no device)."""

    def __init__(self, budget: DeviceBudget):
        Residency.__init__(self, 8)
        self.budget = budget
        self.done: list[tuple[str, int]] = []

    def demote(self, rid, *, stream=None):
        self.budget.demote(rid)
        self.done.append(("demote", rid))

    def promote(self, rid, *, stream=None):
        self.budget.promote(rid)
        self.done.append(("promote", rid))


def _budget():
    b = DeviceBudget(64, 4, block_rows=8)  # blocks of 2 pages
    for rid, n in ((0, 40), (1, 80), (2, 40)):
        assert b.admit(rid, n) == "resident"  # 10, 20, 10 pages: 24 free
    b.touch([1, 2])  # 0 idle longest
    return b


def test_without_a_budget_nothing_is_resident_and_every_move_refuses():
    r = Residency(4)
    assert not r.enabled and r.budget is None and r.n_rows is None
    assert r.lean_step() is False and r.lean_step(False) is False
    with pytest.raises(ValueError, match="no device budget"):
        r.lean_step(True)
    assert r.switch_promoted() == [] and r.promoting == [] and r.state(3) == "sparse"
    ordered = []  # bound to a cache: switch_promoted still orders the stream it is given
    r.bind(tables=None, device=None, pool=None, host=None, order=ordered.append)
    assert r.switch_promoted("s") == [] and ordered == ["s"]
    with pytest.raises(ValueError, match="rid"):
        r.state(4)
    for call, args in (("demote", (0,)), ("promote", (0,)), ("make_room", (8,)),
                       ("promote_ready", ()), ("shed", ())):
        with pytest.raises(ValueError, match=rf"{call} needs a device budget"):
            getattr(r, call)(*args)
    # the cache's calls: nothing to do, and resident=True refused by name
    assert r.fields() == {} and r.newest_fields() == {} and not r.is_resident(0)
    assert r.on_admit(0, 10, None, None) is None and r.on_admit(0, 10, False, None) is None
    assert r.on_admit(0, 10, 0, None) is None  # falsy: sparse (DeviceBudget.admit reads so)
    with pytest.raises(ValueError, match="resident=True needs a device budget"):
        r.on_admit(0, 10, True, None)
    r.on_grow(0, 20, None, check=True)
    r.on_release(0, None)
    r.on_step(None)  # (no capture query: nothing to switch)


def test_the_moves_left_the_cache_with_a_pointer_to_where_they_went():
    """0.1.x engines called ``cache.demote`` etc. and read ``cache.arena``: each is an
    ``AttributeError`` naming ``cache.residency``; any other missing name stays the usual
    error."""
    pytest.importorskip("cupy", reason="the cache module imports CuPy (no GPU needed)")
    from hisparse_cupy import HotBufferCache
    c = HotBufferCache.__new__(HotBufferCache)  # (no GPU: the names only)
    for name in ("demote", "promote", "switch_promoted", "make_room", "promote_ready",
                 "lean_step", "arena"):
        with pytest.raises(AttributeError, match=rf"HotBufferCache.{name} moved in 0.2: .*"
                                                 rf"cache\.residency"):
            getattr(c, name)
    with pytest.raises(AttributeError, match="has no attribute 'bogus'"):
        c.bogus  # noqa: B018


def test_lean_follows_the_budgets_states():
    b = _budget()
    m = Moves(b)
    assert m.lean_step() and m.lean_step(True) and not m.lean_step(False)
    with pytest.raises(TypeError, match="lean must be None, True or False"):
        m.lean_step(1)
    b.demote(2)
    assert not m.lean_step() and b.sparse() == [2]
    with pytest.raises(ValueError, match=r"request slots \[2\] are not resident"):
        m.lean_step(True)
    b.promote(2)  # promoting: not resident yet
    assert not m.lean_step()
    b.finish_promotion(2)
    assert m.lean_step()


def test_make_room_demotes_whom_room_for_names_or_nothing():
    b = _budget()
    m = Moves(b)
    assert m.make_room(20) == [] and m.done == []  # free already
    with pytest.raises(PoolExhausted) as e:
        m.make_room(10**4)
    assert e.value.free == b.free_pages and "would free 34 more" in str(e.value)  # 40 - 3 blocks
    assert m.done == [] and all(b.state(r) == "resident" for r in (0, 1, 2))
    assert m.make_room(30, keep=[1]) == [0]  # 0 idle longest: +8
    assert m.done == [("demote", 0)] and b.free_pages >= 30
    b.check()


def test_shed_demotes_down_to_the_high_watermark():
    b = _budget()  # 40 of 64 pages in use: 0 idle longest
    m = Moves(b)
    assert m.shed() == [] and m.done == []  # no band: never
    b.watermarks = (0.25, 0.5)  # 32 pages in use at most
    assert m.shed() == [0]  # 0 idle longest: 40 - 10 + 2 = 32
    assert m.shed() == [] and b.free_pages == 32
    b.watermarks = (0.25, 0.3)  # 19 at most: 2 (+8) alone is all it may demote beside 1 kept
    assert m.shed(keep=[1]) == [2] and b.free_pages == 40
    assert m.done == [("demote", 0), ("demote", 2)]
    assert m.promote_ready() == []  # 24 in use: not under the low watermark (16)
    b.check()


@pytest.mark.parametrize("call", ["demote", "promote", "make_room", "promote_ready", "shed"])
def test_a_token_count_is_refused(call):
    """0.1.x took the written tokens' count (``demote(rid, n)``, ``make_room(pages,
    written)``...): the cache counts them on the device now (issue 60), so a count given is a
    ``TypeError`` (every argument after the first is keyword-only), and nothing moves."""
    b = _budget()
    m = Moves(b)
    args = {"demote": (0, 40), "promote": (0, 40), "make_room": (30, {0: 40}),
            "promote_ready": ({0: 40},), "shed": ({0: 40},)}[call]
    with pytest.raises(TypeError, match="positional argument"):
        getattr(_Budgeted, call)(m, *args)
    assert m.done == [] and all(b.state(r) == "resident" for r in (0, 1, 2))


def test_promote_ready_keeps_what_it_is_told_to():
    b = _budget()
    m = Moves(b)
    for r in (0, 2):
        b.demote(r)
    free = b.free_pages
    assert m.promote_ready(keep_free=free) == []  # each would eat the reserve
    with pytest.raises(ValueError, match="keep_free"):
        m.promote_ready(keep_free=-1)
    got = m.promote_ready(keep_free=free - 10)  # room for one of 10 pages
    assert len(got) == 1 and b.state(got[0]) == "promoting"
    assert got == [2]  # touched after 0: most recently used first
    assert m.done == [("promote", 2)] and b.free_pages >= free - 10
    b.check()
