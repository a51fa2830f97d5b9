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

    def demote(self, rid, n_tokens, *, stream=None):
        self.arena.budget.demote(rid)
        self.done.append(("demote", rid, n_tokens))

    def promote(self, rid, n_tokens, *, stream=None):
        self.arena.budget.promote(rid)
        self.done.append(("promote", rid, n_tokens))


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
    written = {0: 39, 1: 79, 2: 40}
    assert m.make_room(20, written) == [] and m.done == []  # free already
    with pytest.raises(ValueError, match="written has no token count for request slot 0"):
        m.make_room(30, {1: 79})
    with pytest.raises(ValueError, match=r"written\[0\]"):
        m.make_room(30, {0: 41, 1: 79})  # more than it holds
    with pytest.raises(PoolExhausted):
        m.make_room(10**4, written)
    assert m.done == [] and all(b.state(r) == "resident" for r in (0, 1, 2))
    assert m.make_room(30, written, keep=[1]) == [0]  # 0 idle longest: +8
    assert m.done == [("demote", 0, 39)] and b.free_pages >= 30
    b.check()


def test_promote_ready_keeps_what_it_is_told_to():
    b = _budget()
    m = Moves(b)
    for r in (0, 2):
        b.demote(r)
    written = {0: 40, 2: 40}
    free = b.free_pages
    assert m.promote_ready(written, keep_free=free) == []  # each would eat the reserve
    assert m.promote_ready({}, keep_free=0) == []  # no count: not promoted
    with pytest.raises(ValueError, match="keep_free"):
        m.promote_ready(written, keep_free=-1)
    got = m.promote_ready(written, keep_free=free - 10)  # room for one of 10 pages
    assert len(got) == 1 and b.state(got[0]) == "promoting"
    assert m.done == [("promote", got[0], 40)] and b.free_pages >= free - 10
    b.check()
