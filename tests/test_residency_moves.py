"""CPU: the cache's residency rules that need no GPU (``residency/_moves.py``): whether a step
runs lean, and the default policy's orchestration (``make_room``, ``promote_ready``) over a
:class:`DeviceBudget`, the moves themselves recorded instead of queued."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hisparse_cupy.host import PoolExhausted
from hisparse_cupy.residency import DeviceBudget
from hisparse_cupy.residency._moves import ResidencyMoves


class Moves(ResidencyMoves):
    """ResidencyMoves over a budget alone: demote and promote carried out on the budget."""

    def __init__(self, budget: DeviceBudget | None):
        self.arena = None if budget is None else SimpleNamespace(budget=budget)
        self.done: list[tuple[str, int, int]] = []

    def _arena(self, what: str):
        if self.arena is None:
            raise ValueError(f"{what} needs a device budget")
        return self.arena

    def demote(self, rid, *, stream=None):
        self.arena.budget.demote(rid)
        self.done.append(("demote", rid))

    def promote(self, rid, *, stream=None):
        self.arena.budget.promote(rid)
        self.done.append(("promote", rid))


def _budget():
    b = DeviceBudget(64, 4, block_rows=8)  # blocks of 2 pages
    for rid, n in ((0, 40), (1, 80), (2, 40)):
        assert b.admit(rid, n) == "resident"  # 10, 20, 10 pages: 24 free
    b.touch([1, 2])  # 0 idle longest
    return b


def test_lean_follows_the_budgets_states():
    assert Moves(None).lean_step() is False
    with pytest.raises(ValueError, match="no device budget"):
        Moves(None).lean_step(True)
    assert Moves(None).lean_step(False) is False
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


@pytest.mark.parametrize("call", ["demote", "promote", "make_room", "promote_ready"])
def test_a_token_count_is_refused_by_name(call):
    """0.1.x took the written tokens' count (``demote(rid, n)``, ``make_room(pages,
    written)``...): the cache counts them on the device now (issue 60), so a count given is a
    ``TypeError`` that says so, and nothing moves."""
    b = _budget()
    m = Moves(b)
    args = {"demote": (0, 40), "promote": (0, 40), "make_room": (30, {0: 40}),
            "promote_ready": ({0: 40},)}[call]
    with pytest.raises(TypeError, match=f"{call} takes no token count"):
        getattr(ResidencyMoves, call)(m, *args)
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
