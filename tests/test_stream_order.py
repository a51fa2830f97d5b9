"""Rule 1 of ``hisparse_cupy._order`` (calls in the order the host makes them), with stand-in
streams and events: no GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hisparse_cupy import _order


class Event:
    def __init__(self, **_):
        self.on = None

    def record(self, stream):
        assert not stream.capturing, "an event recorded on a capturing stream joins its graph"
        self.on = stream.name


class Stream:
    def __init__(self, name, ptr):
        self.name, self.ptr, self.capturing, self.waited = name, ptr, False, []

    def is_capturing(self):
        self.queries = getattr(self, "queries", 0) + 1
        return self.capturing

    def wait_event(self, ev):
        assert not self.capturing, "a capture may not wait for work outside it"
        self.waited.append(ev.on)


SYNCS = []  # device synchronizations, by thread name


@pytest.fixture
def order(monkeypatch):
    import threading

    SYNCS.clear()
    runtime = SimpleNamespace(
        deviceSynchronize=lambda: SYNCS.append(threading.current_thread().name))
    monkeypatch.setattr(_order, "cupy", SimpleNamespace(cuda=SimpleNamespace(
        Event=Event, runtime=runtime)))
    return _order.StreamOrder()


def test_a_change_of_stream_waits_for_the_previous_calls_stream(order):
    a, b = Stream("A", 1), Stream("B", 2)
    order.enter(a)
    order.enter(a)
    assert a.waited == [] and a.queries == 1  # one stream throughout: no event, one query
    order.enter(b)
    order.enter(a)
    assert b.waited == ["A"] and a.waited == ["B"]


def test_a_call_inside_a_capture_leaves_the_order_to_the_eager_calls(order):
    """An eager step on B, an admission on A, a step captured on B (no wait: a capture may
    not depend on outside work), then ``cache.order(B)`` before the replay: B waits for A.
    Were the capture counted as the last call, the replay would not follow the admission."""
    a, b = Stream("A", 1), Stream("B", 2)
    order.enter(b)  # the warm-up step
    order.enter(a)  # admit(..., stream=A)
    b.capturing = True
    order.enter(b)  # begin_step and the swaps, captured
    order.enter(b)
    b.capturing = False
    order.enter(b)  # cache.order(B) before graph.replay(B)
    assert b.waited == ["A"]


def test_a_call_while_the_previous_stream_captures_records_nothing_there(order):
    a, b = Stream("A", 1), Stream("B", 2)
    order.enter(b)
    b.capturing = True  # the engine captures on B with no cache call in it yet
    order.enter(a)  # a call on A meanwhile: nothing is recorded on B
    assert a.waited == []
    b.capturing = False
    order.enter(b)
    assert b.waited == ["A"]


def test_the_per_thread_default_stream_of_another_thread_is_waited_for(order):
    """Handle 2 (``cudaStreamPerThread``) is a different stream in each thread: the last call
    made on it in one thread cannot be recorded, nor waited for by an event, from another (an
    event recorded on handle 2 there records the caller's own). The next call from another
    thread waits for the device on the host instead, and the cache goes on; one thread on it
    throughout, or explicit streams, are ordered by events as ever."""
    import threading

    ptds, other = Stream("ptds", 2), Stream("B", 7)
    order.enter(ptds)
    order.enter(ptds)  # the same thread: nothing to order
    order.enter(other)
    assert other.waited == ["ptds"] and SYNCS == []
    order.enter(ptds)  # back on this thread's per-thread stream: waits for B's work
    assert ptds.waited == ["B"]
    mine = Stream("C", 9)

    def call():
        order.enter(mine)

    t = threading.Thread(target=call, name="other")
    t.start()
    t.join()
    assert SYNCS == ["other"] and mine.waited == []  # the device waited for, no event
    d = Stream("D", 11)
    order.enter(d)  # back here: C (explicit) is ordered by an event again
    assert d.waited == ["C"] and SYNCS == ["other"]
