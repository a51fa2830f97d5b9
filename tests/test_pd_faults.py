"""Faults that reach a prefill -> decode receiver's connections and its page rule, on the CPU
(DRAM -> DRAM over UCX): offers under a sender's agent name whose metadata does not load over
that sender's connection (cut in half, or an impostor's own), during its READ and while it is
idle; a ticket of the same kind at the sender; a sender restarted under its name; a token that
is not text; message bodies fuzzed at random between legitimate transfers; an unexpected error
in one message; a sender gone during its READ and READs whose state NIXL cannot report;
``close()`` with a READ in progress; what a push ticket lets its holder read.

In each: a READ keeps its pages until NIXL reports it complete (or the engine gives them back),
no byte of it lands in pages handed out again, the sender keeps its connection,
:meth:`KVReceiver.poll` never raises and no arrival is lost (issue 60, items 6-8).
"""

from __future__ import annotations

import base64
import functools
import json
import time
import weakref

import numpy as np
import pytest

from hisparse_cupy.host._pages import PoolExhausted
from hisparse_cupy.pd import _nixl, _protocol

try:
    from hisparse_cupy.pd import KVSender, nixl_api

    nixl_api()
except ImportError as e:
    pytest.skip(f"NIXL is not installed: {e}", allow_module_level=True)

from _pd_peer import host_zeros, make_kv  # noqa: E402
from test_pd import (  # noqa: E402
    _SEEN,
    RB,
    L,
    P,
    _poll,
    _take,
    arrivals,
    failures,
    finish,
    rows_of,
    send,
    ticket_rows,
)
from test_pd_trust import POISON, poisoned, raw_agent  # noqa: E402


@pytest.fixture
def tcp_only(monkeypatch):
    """UCX over TCP for the agents made in the test: a large READ stays in progress a while
    (as in test_pd_trust.py)."""
    monkeypatch.setenv("UCX_TLS", "tcp,self,cuda_copy")


@pytest.fixture
def still(monkeypatch):
    """``still()``: agents made after the call run without NIXL's progress thread, so a
    transfer moves only inside their own calls (a READ posted stays in flight until the test
    makes one, on any machine: with progress threads a fast machine finished a 72 MiB READ
    before a sender's teardown cut it, and the test saw an arrival instead)."""
    api = nixl_api()
    return lambda: monkeypatch.setattr(
        api, "nixl_agent_config",
        functools.partial(api.nixl_agent_config, enable_prog_thread=False))


def impostor(tx):
    """A raw NIXL agent under sender ``tx``'s agent name (NIXL does not authenticate names)."""
    return _nixl.agent(tx.name, "raw")[1]


def bad_metadata(how: str, agent) -> str:
    """Metadata under the impostor's name that does not load over the known sender's
    connection: ``"cut"`` (its first half: NIXL cannot read it) or ``"impostor"`` (the
    impostor's own: other connection details)."""
    md = _nixl.metadata(agent, keys=False)
    if how == "cut":
        raw = base64.b64decode(md)
        return base64.b64encode(raw[: len(raw) // 2]).decode("ascii")
    return md


def offer_from(agent, rx, t, name: str, metadata: str) -> None:
    """A pull's offer for ticket ``t`` (its id and token) from ``agent``, naming ``name``."""
    agent.send_notif(rx.name, _protocol.message(
        "offer", xfer_id=t["xfer_id"], token=t["token"], tag=f"{t['xfer_id']}/99", agent=name,
        mem="DRAM", dev=0, descs=t["descs"], metadata=metadata))


def warm(tx, rx, rb=RB):
    """One small pull from ``tx``, so that ``rx`` knows its connection."""
    send(tx, rx, rx.reserve("warm", 1), make_kv(1, L, 1, rb))
    (a,) = arrivals(rx, 1)
    rx.release(a)


# ------------------------------------------- 6. a READ in flight keeps its connection and pages
def test_an_offer_under_a_reading_senders_name_leaves_its_read_and_pages_alone(tcp_only, still):
    """Sender A's 72 MiB READ in progress (over TCP); two offers for other reservations come
    under A's agent name with metadata that does not load over A's connection (cut in half,
    then an impostor's own): both are refused and nothing else changes. A's connection is not
    dropped (so NIXL still reports its READ's state), A's pages are not handed out (a
    reservation needing them is refused), A's request arrives exact, and no byte of it lands
    in another reservation's pages. (``still`` for the receiver: its READ takes thousands of
    its polls, a few dozen handle the offers.)"""
    rb, n = 4096, 6144
    tx = KVSender()
    fake = impostor(tx)
    still()
    rx, pool, pages = poisoned(n // P + 2, rb, timeout_s=60)
    try:
        warm(tx, rx, rb)
        kv = make_kv(7, L, n, rb)
        ta, tb, tb2 = rx.reserve("a", n), rx.reserve("b", 1), rx.reserve("b2", 1)
        p = tx.send(ta, kv, wait=False)
        end = time.monotonic() + 20
        while "a" not in rx.in_progress:
            _poll(rx)
            assert time.monotonic() < end, "A's READ was not posted"
        fake.add_remote_agent(base64.b64decode(tb["metadata"]))
        offer_from(fake, rx, tb, tx.name, bad_metadata("cut", fake))
        offer_from(fake, rx, tb2, tx.name, bad_metadata("impostor", fake))
        while "b" in rx.in_flight or "b2" in rx.in_flight:
            _poll(rx)
            assert time.monotonic() < end, "the impostor's offers were not handled"
        reading = "a" in rx.in_progress  # (the refusals came while A's READ was running)
        for _ in range(5):
            _poll(rx)
        failed = _take(rx, "failed")
        given_back = "a" not in rx.in_flight and ta["xfer_id"] not in rx.quarantined and \
            not any(x.req_id == "a" for x in _SEEN[rx]["done"])
        try:
            tc = rx.reserve("c", n)  # needs A's pages
        except PoolExhausted:
            tc = None
        if tc is not None:  # (its owner's bytes: the poison again)
            pool[:, ticket_rows(tc, pool)] = POISON
        try:
            sent = finish(rx, p, 30)
        except (RuntimeError, TimeoutError) as e:
            sent = e
        time.sleep(0.2)  # (a READ given up on would land its last bytes now)
        for _ in range(5):
            _poll(rx)
        stray = 0 if tc is None else \
            int((pool[:, ticket_rows(tc, pool)] != POISON).any(axis=(0, 2)).sum())
        assert reading and not given_back and tc is None and stray == 0, (
            f"A's READ in progress after the refusals: {reading}; its pages given back "
            f"{given_back}, handed to another reservation {tc is not None}, {stray} of that "
            f"reservation's rows then written by A's READ; failed: {failed}; A's send: "
            f"{sent!r}")
        assert sorted(r for r, _ in failed) == ["b", "b2"], failed
        assert all("refused" in why and tx.name in why for _, why in failed), failed
        assert not isinstance(sent, Exception), sent
        (a,) = arrivals(rx, 1)
        assert np.array_equal(pool[:, rows_of(a.pages, n)], kv)  # (72 MiB: no diff report)
        rx.release(a)
        assert rx.stats["unconfirmed"] == 0 and not rx.quarantined
        assert pages.free_pages == pages.n_pages
        pages.check()
    finally:
        tx.close()
        rx.close()


# --------------------------------------------------- 7. the sender keeps its connection
@pytest.mark.parametrize("bad", ["cut", "impostor"])
def test_an_offer_under_a_senders_name_does_not_cut_that_sender_off(bad):
    """An offer under idle sender A's agent name with metadata that does not load over A's
    connection (cut in half, or an impostor's own) is refused and A's connection kept: A's 100
    KB notification still arrives (counted as malformed) and A's pull of a request spread over
    some 290 runs of pages (an offer of more than 20 KB) arrives exact."""
    k = 300
    rx, pool, pages = poisoned(2 * k + 2)
    tx = KVSender()
    fake = impostor(tx)
    try:
        warm(tx, rx)
        for i in range(2 * k):  # every other page free: a later request spans many runs
            rx.reserve(f"f{i}", 1)
        for i in range(0, 2 * k, 2):
            rx.cancel(f"f{i}")
        tb = rx.reserve("b", 1)
        fake.add_remote_agent(base64.b64decode(tb["metadata"]))
        offer_from(fake, rx, tb, tx.name, bad_metadata(bad, fake))
        failed = failures(rx)
        assert [r for r, _ in failed] == ["b"], failed
        junk = rx.stats["malformed"]
        tx._agent.send_notif(rx.name, b"done:" + b"x" * 100_000)
        end = time.monotonic() + 5
        while rx.stats["malformed"] == junk and time.monotonic() < end:
            assert rx.poll() == ([], [], [])
        assert rx.stats["malformed"] == junk + 1, "A's 100 KB notification was lost"
        n = (k - 10) * P
        tk = rx.reserve("k", n)
        assert len(tk["runs"]) > 250 and len(json.dumps(tk["descs"])) > 20_000
        kv = make_kv(11, L, n, RB)
        p = tx.send(tk, kv, wait=False, timeout_s=5)
        end = time.monotonic() + 10
        while not p.poll():
            _poll(rx)
            assert time.monotonic() < end, f"A's pull did not end: {dict(rx.stats)}"
        (a,) = arrivals(rx, 1)
        np.testing.assert_array_equal(pool[:, rows_of(a.pages, n)], kv)
        rx.release(a)
        for i in range(1, 2 * k, 2):
            rx.cancel(f"f{i}")
        assert pages.free_pages == pages.n_pages and not rx.quarantined
        pages.check()
    finally:
        tx.close()
        rx.close()


def test_a_ticket_whose_metadata_does_not_load_leaves_the_senders_connection_alone():
    """The sender's side of the same rule: a ticket naming a receiver the sender knows, with
    metadata that does not load over that connection (cut in half), is refused with an error
    naming it, and the sender's pull to that receiver in flight meanwhile still arrives (its
    connection was not dropped), as does the next one."""
    rx, pool, pages = poisoned(16)
    tx = KVSender()
    try:
        warm(tx, rx)
        kv = make_kv(4, L, 40, RB)
        p = tx.send(rx.reserve("a", 40), kv, wait=False)
        t = rx.reserve("b", 8)
        other = raw_agent()
        with pytest.raises(ValueError, match=r"ticket\['metadata'\]"):
            tx.send({**t, "metadata": bad_metadata("cut", other)}, make_kv(5, L, 8, RB))
        finish(rx, p)
        send(tx, rx, t, make_kv(5, L, 8, RB))
        got = {a.req_id: a for a in arrivals(rx, 2)}
        np.testing.assert_array_equal(pool[:, rows_of(got["a"].pages, 40)], kv)
        np.testing.assert_array_equal(pool[:, rows_of(got["b"].pages, 8)],
                                      make_kv(5, L, 8, RB))
        for a in got.values():
            rx.release(a)
        pages.check()
    finally:
        tx.close()
        rx.close()


# --------------------------------------------- 8. poll never raises, one message in isolation
def _granted(rx, req_id, wait_s=10.0):
    """Poll ``rx`` until it has granted ``req_id``'s write."""
    end = time.monotonic() + wait_s
    while rx._live[req_id].writer is None:
        _poll(rx)
        assert time.monotonic() < end, "no grant"


def _written(p, wait_s=10.0):
    """Drive write ``p`` alone (its receiver not polled) until its WRITE is complete: NIXL
    sends its done then, which waits unread in the receiver's agent."""
    end = time.monotonic() + wait_s
    while p._phase in ("asking", "writing"):
        p.advance()
        assert time.monotonic() < end, "the WRITE did not complete"


def test_a_token_that_is_not_text_after_a_done_in_its_batch_loses_nothing():
    """Messages with a known transfer id (a live reservation's, and the one just done) and the
    token "\\ud800" (valid JSON: a lone surrogate) in the same batch of notifications as a
    WRITE's done, after it: poll does not raise, the done is an arrival, each of them is
    counted and ignored, and the other reservation stays live and then arrives."""
    rx, pool, pages = poisoned(16, push=True)
    tx = KVSender(pull=False)
    try:
        kv = make_kv(3, L, 40, RB)
        ta, tb = rx.reserve("a", 40), rx.reserve("b", 10)
        p = tx.send(ta, kv, wait=False)
        _granted(rx, "a")
        _written(p)
        for kind, t in (("withdraw", tb), ("offer", tb), ("done", tb), ("offer", ta)):
            body = json.dumps({"xfer_id": t["xfer_id"], "token": "\ud800", "tag": "x"})
            assert "\\ud800" in body  # (JSON escapes the lone surrogate: valid JSON)
            tx._agent.send_notif(rx.name, kind.encode() + b":" + body.encode())
        time.sleep(0.2)  # (all of them in the agent: one batch, on a machine not too busy)
        got = rx.poll()
        done, end = list(got.done), time.monotonic() + 5
        while (not done or rx.stats["forged"] + rx.stats["late"] < 4) and \
                time.monotonic() < end:
            done += rx.poll().done
        assert [x.req_id for x in done] == ["a"] and got.failed == [], got
        assert rx.stats["forged"] == 3 and rx.stats["late"] == 1, dict(rx.stats)
        assert rx.stats["errors"] == 0 and rx.in_flight == {"b": 10}
        assert finish(rx, p).bytes == kv.nbytes
        kv_b = make_kv(4, L, 10, RB)
        send(tx, rx, tb, kv_b)
        (b,) = arrivals(rx, 1)
        np.testing.assert_array_equal(pool[:, rows_of(done[0].pages, 40)], kv)
        np.testing.assert_array_equal(pool[:, rows_of(b.pages, 10)], kv_b)
        rx.release(done[0])
        rx.release(b)
        assert pages.free_pages == 16
        pages.check()
    finally:
        tx.close()
        rx.close()


def test_same_secret_takes_any_two_values():
    """The token comparison takes whatever a message carries: text with lone surrogates or
    any other character compares, anything else is not the secret."""
    for a, b, same in (("ab", "ab", True), ("\ud800", "\ud800", True), ("\ud800", "ab", False),
                       ("ab", "\udfff", False), ("é", "é", True), ("\ud800x", "\ud800y", False),
                       (None, None, False), (b"ab", "ab", False), (["a"], ["a"], False),
                       (1, 1, False)):
        assert _protocol.same_secret(a, b) is same, (a, b)


def test_an_unexpected_error_in_one_message_is_counted_and_its_batch_goes_on(monkeypatch):
    """A handler that raises (here a stand-in bug in the answer to a late offer) for two
    messages of a batch, before and after a WRITE's done: poll does not raise, both are
    counted in ``stats["errors"]`` (the last one's text in ``last_error``), and the done is an
    arrival."""
    rx, pool, pages = poisoned(16, push=True)
    tx = KVSender(pull=False)
    raw = raw_agent()
    try:
        te = rx.reserve("e", 5)
        rx.cancel("e")
        raw.add_remote_agent(base64.b64decode(te["metadata"]))

        def bug(*a, **k):
            raise RuntimeError("a stand-in bug")

        monkeypatch.setattr(rx, "_late", bug)
        late = _protocol.message("offer", xfer_id=te["xfer_id"], token=te["token"], tag="e/0")
        kv = make_kv(3, L, 40, RB)
        p = tx.send(rx.reserve("a", 40), kv, wait=False)
        _granted(rx, "a")
        raw.send_notif(rx.name, late)
        _written(p)
        tx._agent.send_notif(rx.name, late)  # (after the done, from the same agent)
        time.sleep(0.2)
        got = []
        end = time.monotonic() + 5
        while not got:
            got += _poll(rx).done
            assert time.monotonic() < end
        assert [x.req_id for x in got] == ["a"]
        assert rx.stats["errors"] == 2 and "a stand-in bug" in rx.last_error, dict(rx.stats)
        assert finish(rx, p).bytes == kv.nbytes
        np.testing.assert_array_equal(pool[:, rows_of(got[0].pages, 40)], kv)
        rx.release(got[0])
        pages.check()
    finally:
        tx.close()
        rx.close()


# ----------------------------------------------------------- message bodies fuzzed
_SURROGATES = ["\ud800", "\udfff", "a\ud800b", "\udc80\udc80", "\ud83d"]
_FIELDS = ("tag", "metadata", "descs", "mem", "dev", "sums", "digest", "how", "verify", "why",
           "agent")


def _text(rng, n=None):
    n = int(rng.integers(0, 40)) if n is None else n
    return "".join(chr(int(c)) for c in rng.integers(0, 0x110000, n))


def _value(rng, depth=0) -> str:
    """A random JSON value, as text: huge or odd numbers, text with lone surrogates, long
    strings, nested structures (some deeper than a JSON parser takes)."""
    c = int(rng.integers(0, 13))
    if c == 0:
        return "null"
    if c == 1:
        return str(rng.choice(["true", "false"]))
    if c == 2:
        return str(int(rng.integers(-5, 1 << 40)))
    if c == 3:
        return str(rng.choice(["18446744073709551616", "-1", "1" + "0" * 4000, "-" + "9" * 40,
                               "7" * 5000]))
    if c == 4:
        return str(rng.choice(["1e999", "-1e999", "NaN", "Infinity", "-0.0", "1.5", "4e-320"]))
    if c == 5:
        return json.dumps(_text(rng))
    if c == 6:
        return json.dumps(str(rng.choice(_SURROGATES)))
    if c == 7:
        return json.dumps("x" * int(rng.integers(1000, 100_000)))
    if c == 8 and depth < 3:
        return "[" + ",".join(_value(rng, depth + 1) for _ in range(rng.integers(0, 5))) + "]"
    if c == 9 and depth < 3:
        keys = [json.dumps(str(rng.choice(_FIELDS)) if rng.random() < 0.5 else _text(rng, 3))
                for _ in range(rng.integers(0, 5))]
        return "{" + ",".join(f"{k}:{_value(rng, depth + 1)}" for k in keys) + "}"
    if c == 10:
        d = int(rng.choice([50, 400, 980, 5000]))
        return "[" * d + "0" + "]" * d
    if c == 11:
        return str(rng.choice(["[]", "{}", '""', '"\\u0000"', '[[1, 2], [3]]']))
    return json.dumps(str(int(rng.integers(0, 1 << 62))))


def _mutated(token: str, rng) -> str:
    i = int(rng.integers(len(token)))
    return token[:i] + ("0" if token[i] != "0" else "1") + token[i + 1:]


def _fuzzed(rng, live, victims, ended, conn) -> bytes:
    """One random message body: bytes, another kind, JSON that is not an object, or an object
    of every field with wrong types or values; a live reservation's id only ever with a wrong
    token (a victim's id may carry its right token: those may end the victim)."""
    kind = str(rng.choice(_protocol.TO_RECEIVER + _protocol.TO_SENDER + ("", "offerx", "é")))
    c = rng.random()
    if c < 0.08:
        return bytes(rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8))
    if c < 0.16:
        return kind.encode("utf-8", "surrogatepass") + b":" + bytes(
            rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8))
    if c < 0.24:
        return kind.encode() + b":" + _value(rng).encode()
    if c < 0.3:  # an object in another encoding, or with a byte that is not UTF-8
        body = json.dumps({"xfer_id": str(rng.choice(live or ["x"])), "token": "t"})
        return kind.encode() + b":" + (body.encode("utf-16") if rng.random() < 0.5 else
                                       body.encode()[:-2] + b'\xff"}')
    f = {}
    who = rng.random()
    if who < 0.35 and live:
        t = live[int(rng.integers(len(live)))]
        f["xfer_id"] = json.dumps(t["xfer_id"])
        f["token"] = str(rng.choice([json.dumps(_mutated(t["token"], rng)),
                                     json.dumps(t["token"] + "\ud800"),
                                     json.dumps("\ud800"), json.dumps(t["token"][:-1]),
                                     _value(rng)]))
    elif who < 0.7 and victims:
        t = victims[int(rng.integers(len(victims)))]
        f["xfer_id"] = json.dumps(t["xfer_id"])
        f["token"] = json.dumps(t["token"]) if rng.random() < 0.7 else _value(rng)
    elif who < 0.85 and ended:
        t = ended[int(rng.integers(len(ended)))]
        f["xfer_id"], f["token"] = json.dumps(t["xfer_id"]), json.dumps(t["token"])
    else:
        f["xfer_id"], f["token"] = _value(rng), _value(rng)
    for k in _FIELDS:
        r = rng.random()
        if r < 0.3:
            f[k] = _value(rng)
        elif r < 0.4 and k == "metadata":
            f[k] = json.dumps(conn)  # the raw agent's real connection details
    items = list(f.items())
    rng.shuffle(items)
    return kind.encode() + b":{" + ",".join(f'"{k}":{v}' for k, v in items).encode() + b"}"


@pytest.mark.parametrize("push", [False, True])
def test_fuzzed_message_bodies_never_make_poll_raise_and_lose_nothing(push, rng):
    """Six rounds of two legitimate requests (pulls, or granted WRITEs for a push receiver)
    with 40 fuzzed message bodies from a raw agent before and after their sends (random bytes,
    JSON with lone surrogates, huge numbers, deep nesting, every field of the wrong type,
    known transfer ids with wrong tokens, victims' ids with their tokens, ended ones): poll
    never raises and hits no unexpected error, every legitimate request arrives byte exact,
    no byte outside them changes, and every page comes back."""
    rx, pool, pages = poisoned(64, push=push)
    tx = KVSender()
    raw = raw_agent()
    conn = _nixl.metadata(raw, keys=False)
    ended, sent = [], 0
    try:
        for rnd in range(6):
            live = [rx.reserve(f"r{rnd}.{j}", int(rng.integers(1, 80))) for j in range(2)]
            victims = [rx.reserve(f"v{rnd}.{j}", int(rng.integers(1, 20))) for j in range(2)]
            if rnd == 0:
                raw.add_remote_agent(base64.b64decode(live[0]["metadata"]))
            kvs = {t["req_id"]: make_kv(100 * rnd + j, L, t["n_tokens"], RB)
                   for j, t in enumerate(live)}
            for _ in range(20):
                raw.send_notif(rx.name, _fuzzed(rng, live, victims, ended, conn))
            sends = [tx.send(t, kvs[t["req_id"]], wait=False) for t in live]
            for _ in range(20):
                raw.send_notif(rx.name, _fuzzed(rng, live, victims, ended, conn))
            sent += 40
            for p in sends:
                finish(rx, p)
            got = {a.req_id: a for a in _take(rx, "done")}
            end = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < end:
                got.update((a.req_id, a) for a in _poll(rx).done)
            assert sorted(got) == sorted(kvs), (sorted(got), dict(rx.stats))
            assert not [f for f in _take(rx, "failed") if f[0] in kvs]
            assert _take(rx, "timed_out") == []
            for r, a in got.items():
                rows = rows_of(a.pages, a.n_tokens)
                np.testing.assert_array_equal(pool[:, rows], kvs[r])
                pool[:, rows] = POISON
                rx.release(a)
            for t in victims:
                if t["req_id"] in rx.in_flight:
                    rx.cancel(t["req_id"])
            ended += live + victims
            assert (pool == POISON).all()
        end = time.monotonic() + 5  # (the last fuzzed messages, read)
        while sum(rx.stats[k] for k in ("malformed", "unknown", "forged", "refused", "late",
                                        "duplicate")) < sent // 2 and time.monotonic() < end:
            rx.poll()
        assert rx.stats["errors"] == 0, (dict(rx.stats), rx.last_error)
        assert rx.stats["malformed"] > 0 and rx.stats["forged"] > 0, dict(rx.stats)
        assert not rx.in_flight and not rx.quarantined and pages.free_pages == 64
        pages.check()
    finally:
        tx.close()
        rx.close()


# ------------------------------------------------------- READs whose state NIXL cannot report
@pytest.mark.parametrize(("when", "how"), [("live", "NOT_FOUND"), ("quarantined", "ERR"),
                                         ("quarantined", "NOT_FOUND")])
def test_a_read_whose_state_cannot_be_read_keeps_its_pages(monkeypatch, how, when):
    """NIXL reports a READ as failed ("ERR") or raises (NIXL_ERR_NOT_FOUND, as it does once a
    peer's connection is gone), while the reservation is live or after it was cancelled with
    its READ in progress: the reservation fails (live) and its pages stay quarantined, counted
    in ``stats["unconfirmed"]``, never handed out, through polls and ``close()`` (which returns
    them), until the engine gives them back with ``release_quarantined`` (after close, too).
    (A live READ that NIXL reports "ERR": the killed sender's, below.)"""
    rx, pool, pages = poisoned(8)
    tx = KVSender()
    state = {"now": None}
    real = rx._agent.check_xfer_state

    def check(h):
        if state["now"] is None:
            return real(h)
        if state["now"] == "NOT_FOUND":
            raise RuntimeError("NIXL_ERR_NOT_FOUND")
        return state["now"]

    monkeypatch.setattr(rx._agent, "check_xfer_state", check)
    try:
        t = rx.reserve("a", 5 * P)
        state["now"] = "PROC"
        tx.send(t, make_kv(2, L, 5 * P, RB), wait=False)
        end = time.monotonic() + 10
        while "a" not in rx.in_progress:
            _poll(rx)
            assert time.monotonic() < end
        if when == "quarantined":
            rx.cancel("a")
            assert list(rx.quarantined) == [t["xfer_id"]]
        state["now"] = how
        for _ in range(5):
            _poll(rx)
        failed = _take(rx, "failed")
        if when == "live":
            assert [r for r, _ in failed] == ["a"] and "READ failed" in failed[0][1], failed
        assert rx.quarantined == {t["xfer_id"]: ("a", 5)}
        assert rx.stats["unconfirmed"] == 1 and pages.free_pages == 3
        with pytest.raises(PoolExhausted):
            rx.reserve("b", 4 * P)
        t0 = time.monotonic()
        assert rx.close(timeout_s=10) == {t["xfer_id"]: ("a", 5)}
        assert time.monotonic() - t0 < 2  # (nothing to wait for: its state stays unknown)
        assert pages.free_pages == 3
        rx.release_quarantined(t["xfer_id"])
        assert pages.free_pages == 8 and not rx.quarantined
        pages.check()
    finally:
        tx.close()
        rx.close()


def test_a_sender_gone_during_its_read_leaves_the_pages_quarantined(tcp_only, still):
    """A pulling sender (a raw agent) whose agent ends while the receiver's 72 MiB READ of its
    kv is in progress over TCP, as a killed process's would: NIXL reports the READ failed
    (NIXL_ERR_REMOTE_DISCONNECT), so the reservation fails, but its pages stay quarantined
    (the READ's end is not confirmed: ``stats["unconfirmed"]``), never handed out, until the
    engine, knowing the sender is gone, gives them back. (``still``: no call between the
    READ's posting and the sender's end, so it is in flight then.)"""
    still()
    rb, n = 4096, 6144
    rx, pool, pages = poisoned(n // P, rb, timeout_s=60)
    kv = host_zeros((L, n, rb))
    kv[:] = 7
    sender = raw_agent()
    reg = sender.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM")
    try:
        t = rx.reserve("a", n)
        sender.add_remote_agent(base64.b64decode(t["metadata"]))
        local = (kv.ctypes.data + np.arange(L)[:, None] * (n * rb) +
                 np.asarray(t["runs"])[:, 0] * rb).ravel().astype(np.uint64)
        descs = np.stack([local, np.asarray(t["descs"], np.uint64)[:, 1]], -1)
        sender.send_notif(rx.name, _protocol.message(
            "offer", xfer_id=t["xfer_id"], token=t["token"], tag="a/0", agent=sender.name,
            mem="DRAM", dev=0, descs=descs.tolist(), metadata=_nixl.metadata(sender, reg)))
        end = time.monotonic() + 20
        while "a" not in rx.in_progress:  # (the sender's calls send its offer)
            sender.get_new_notifs()
            _poll(rx)
            assert time.monotonic() < end, "the READ was not posted"
        gone = weakref.ref(sender)
        del sender, reg  # (the agent ends: its connections close, as a process's death does)
        assert gone() is None
        failed = failures(rx, 10)
        assert [r for r, _ in failed] == ["a"] and "READ failed" in failed[0][1], failed
        assert rx.quarantined == {t["xfer_id"]: ("a", n // P)}
        assert rx.stats["unconfirmed"] == 1 and pages.free_pages == 0
        with pytest.raises(PoolExhausted):
            rx.reserve("b", 1)
        for _ in range(5):
            assert rx.poll() == ([], [], []) and pages.free_pages == 0
        rx.release_quarantined(t["xfer_id"])
        assert pages.free_pages == n // P and not rx.quarantined
        pages.check()
    finally:
        rx.close()


# ------------------------------------------------------------------- close with a READ
def test_close_waits_for_a_read_in_progress_and_then_gives_its_pages_back(tcp_only, still):
    """``close()`` with a 72 MiB READ in progress (over TCP, ``still``): given no time it
    returns that transfer (its pages stay out of the free list and listed in ``quarantined``:
    the READ may still land); the sender is told; a second ``close()`` waits for the READ's
    end and gives its pages back, once; the receiver takes no other call afterwards."""
    rb, n = 4096, 6144
    tx = KVSender()  # (its progress thread serves the READ once the receiver's calls move it)
    still()
    rx, pool, pages = poisoned(n // P, rb)
    try:
        kv = make_kv(9, L, n, rb)
        t = rx.reserve("a", n)
        p = tx.send(t, kv, wait=False)
        end = time.monotonic() + 20
        while "a" not in rx.in_progress:
            _poll(rx)
            assert time.monotonic() < end
        left = rx.close(timeout_s=0)
        assert left == {t["xfer_id"]: ("a", n // P)} == rx.quarantined
        assert pages.free_pages == 0
        with pytest.raises(RuntimeError, match="closed"):
            rx.reserve("b", 1)
        with pytest.raises(RuntimeError, match="closed"):
            rx.poll()
        with pytest.raises(RuntimeError, match="the receiver closed"):
            p.wait(timeout_s=10)
        assert rx.close(timeout_s=30) == {} and not rx.quarantined
        assert pages.free_pages == n // P and rx.stats["unconfirmed"] == 0
        pages.check()
        with pytest.raises(ValueError, match="timeout_s must be a finite number"):
            rx.close(timeout_s=-1)
        with pytest.raises(TypeError, match="timeout_s must be a number of seconds, got str"):
            rx.close(timeout_s="1")
    finally:
        tx.close()
        rx.close()


def test_a_sender_restarted_under_its_name_is_taken_once_the_engine_forgets_the_old_one(
        monkeypatch):
    """A sender's agent name is bound to the first connection the receiver loads for it: a new
    sender under the same name (a prefill process restarted with a fixed name) has its offers
    refused and the old connection kept, until the engine calls ``forget_sender`` (refused
    while a transfer under that name is in progress, ``KeyError`` for a name it has no
    connection for); then the new sender's pull arrives exact."""
    rx, pool, pages = poisoned(16)
    old = KVSender()
    new = None
    try:
        warm(old, rx)
        name = old.name
        old.close()
        new = KVSender(name=name)
        new.send(rx.reserve("a", 20), make_kv(2, L, 20, RB), wait=False)
        failed = failures(rx)
        assert [r for r, _ in failed] == ["a"], failed
        assert "does not load over the connection" in failed[0][1], failed
        assert "forget_sender" in failed[0][1]
        with pytest.raises(KeyError, match="no connection to a sender named 'nobody'"):
            rx.forget_sender("nobody")
        rx.forget_sender(name)
        real = rx._agent.check_xfer_state
        monkeypatch.setattr(rx._agent, "check_xfer_state", lambda h: "PROC")
        kv = make_kv(3, L, 20, RB)
        p = new.send(rx.reserve("b", 20), kv, wait=False)
        end = time.monotonic() + 10
        while "b" not in rx.in_progress:
            _poll(rx)
            assert time.monotonic() < end
        with pytest.raises(ValueError, match=r"in progress or quarantined \(req_ids \['b'\]\)"):
            rx.forget_sender(name)
        monkeypatch.setattr(rx._agent, "check_xfer_state", real)
        finish(rx, p)
        (b,) = arrivals(rx, 1)
        np.testing.assert_array_equal(pool[:, rows_of(b.pages, 20)], kv)
        rx.release(b)
        assert pages.free_pages == 16
        pages.check()
    finally:
        if new is not None:
            new.close()
        rx.close()


def test_a_push_tickets_metadata_lets_its_holder_read_any_row_of_the_pool():
    """What the trust boundary says of push tickets, shown: a raw agent holding one reads
    another request's rows (arrived, not yet admitted) with a NIXL READ of its own, and the
    receiver hears nothing of it."""
    rx, pool, pages = poisoned(16, push=True)
    tx = KVSender()
    raw = raw_agent()
    dst = host_zeros((L * 10 * RB,))  # (pages of its own: see _pd_peer.host_zeros)
    reg = raw.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    try:
        kv = make_kv(12, L, 10, RB)
        send(tx, rx, rx.reserve("other", 10), kv)
        (a,) = arrivals(rx, 1)
        t = rx.reserve("mine", 1)
        name = raw.add_remote_agent(base64.b64decode(t["metadata"]))
        row = a.pages[0] * P  # the other request's first page: rows 0-9 of each layer
        src = np.array([[pool[layer, row].ctypes.data, 10 * RB] for layer in range(L)],
                       np.uint64)
        local = np.stack([dst.ctypes.data + np.arange(L, dtype=np.uint64) * (10 * RB),
                          np.full(L, 10 * RB, np.uint64)], -1)
        h = raw.initialize_xfer("READ", _nixl.xfer_descs(raw, local, 0, "DRAM"),
                                _nixl.xfer_descs(raw, src, 0, "DRAM"), name, b"")
        raw.transfer(h)
        end = time.monotonic() + 10
        while raw.check_xfer_state(h) == "PROC":
            assert time.monotonic() < end
        raw.release_xfer_handle(h)
        assert np.array_equal(dst.reshape(L, 10, RB), kv)
        assert rx.poll() == ([], [], []) and rx.in_flight == {"mine": 1}
        rx.release(a)
    finally:
        raw.deregister_memory(reg)
        tx.close()
        rx.close()


def test_a_reservation_whose_fence_raises_takes_nothing():
    """``KVReceiver(fence=)`` runs after the pages are taken, before the ticket leaves; a
    fence that raises (the engine's CUDA error) gives the pages back: nothing reserved,
    nothing held, and the next reservation gets them."""
    from test_pd import receiver

    calls = [0]

    def fence():
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("the engine's fence failed")

    rx, pool, pages = receiver(16, fence=fence)
    try:
        free = pages.free_pages
        with pytest.raises(RuntimeError, match="fence failed"):
            rx.reserve("a", 40)
        assert pages.free_pages == free and not rx.in_flight and not pages.held.any()
        t = rx.reserve("a", 40)  # the same request again: reserved now
        assert t["n_tokens"] == 40 and pages.free_pages == free - pages.pages_for(40)
        rx.cancel("a")
        assert pages.free_pages == free
        pages.check()
    finally:
        rx.close()


def test_a_batch_nixl_cannot_hand_over_is_counted_and_named(monkeypatch):
    """NIXL's binding decodes each sender's agent name as it hands a batch of notifications
    over; a peer whose name is not UTF-8 makes it raise (the batch is lost below the package).
    ``poll`` does not raise: the batch is counted in ``errors`` and named in ``last_error``."""
    from test_pd import receiver

    rx, pool, pages = receiver(16)
    try:
        def lost():
            raise UnicodeDecodeError("utf-8", b"\xffevil", 0, 1, "invalid start byte")

        monkeypatch.setattr(rx._agent, "get_new_notifs", lost)
        errors = rx.stats["errors"]
        got = rx.poll()
        assert not got.done and not got.timed_out and not got.failed
        assert rx.stats["errors"] == errors + 1
        assert rx.last_error.startswith("get_new_notifs: UnicodeDecodeError")
    finally:
        rx.close()
