"""Pages of the host pool: token -> host row maps that grow with a request and share prefixes.

A host pool of ``n_pages * page_tokens`` rows per layer is cut into pages: page ``g`` holds rows
``[g * P, (g + 1) * P)`` of every layer (``P = page_tokens``), so a page carries P tokens of all
layers. A request's token ``t`` lives in row ``pages[t // P] * P + t % P``, where ``pages`` is
the request's page list: the kernels read that row through the request's ``host_locs`` entry,
whatever it is, so a paged pool changes no swap.

:class:`HostPages` is the host side of that map, NumPy only (an engine's scheduler can run it
anywhere):

- :meth:`admit` gives a request the pages for its first ``n`` tokens, new ones, or the first
  ``p`` tokens' pages of a live request (``prefix=(parent, p)``: shared, reference-counted;
  a partial last page is copied into a page of the child's own, never shared), or pages an
  engine holds (``pages=[...]``, from :meth:`take`: its own prefix tree's pages);
- :meth:`grow` takes the pages a request needs for more tokens (before the step that writes
  them: a captured step then only writes table entries);
- :meth:`release` and :meth:`put` drop references; a page is free again when none is left.

**Fences** (``docs/design.md`` section 10, "Page reuse"): work queued on a GPU stream, or a
transfer in flight, may still read or write a page when the host gives it back. So a page
given back carries the *fences* of that work (``release(..., fence=)``, ``put(..., fence=)``:
an object with ``done`` and ``synchronize()``, such as a CuPy event, or a tuple of them), and a
page taken waits for them first: :meth:`admit`, :meth:`grow` and :meth:`take` hand the fences
of the pages they take to ``wait=`` (a callable; a cache makes the stream that will write the
pages wait for them), or by default block the host until they are done (the CPU or another
process writes what :meth:`take` gives). A fence already done is dropped. This is the one rule
every path that reuses pages follows.

A page another request (or the engine) also holds is never written: a request writes only its
tokens at or past :meth:`own_from`, which are in its own pages. Every call checks its arguments
and the pool before changing anything: a pool too small raises :class:`PoolExhausted` with
nothing taken (the engine can then preempt a request).
"""

from __future__ import annotations

import hashlib

import numpy as np

from .. import _checks
from .._checks import ArrayLike

__all__ = ["HostPages", "PoolExhausted", "consecutive_runs"]


def consecutive_runs(values) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, stops)``: the index ranges of ``values`` (ints) over which each one is the
    previous plus one (pages or rows that lie one after the other)."""
    v = np.asarray(values, np.int64).reshape(-1)
    cut = np.flatnonzero(np.diff(v) != 1) + 1
    return np.r_[0, cut], np.r_[cut, v.size]


class PoolExhausted(RuntimeError):
    """Not enough free pages; ``needed`` and ``free`` say how many, ``kind`` of which pool
    (``"host"``, or ``"device"`` for a cache's device budget). Nothing was taken."""

    def __init__(self, what: str, needed: int, free: int, kind: str = "host"):
        super().__init__(f"{what} needs {needed} free {kind} pages, {free} are free")
        self.what, self.needed, self.free, self.kind = what, needed, free, kind

    def __reduce__(self):  # pickles (e.g. out of a worker process) with its fields
        return type(self), (self.what, self.needed, self.free, self.kind)


class HostPages:
    """The pages of a host pool of ``n_pages * page_tokens`` rows (per layer).

    Parameters
    ----------
    n_pages : int
        Pages in the pool.
    page_tokens : int
        Tokens per page (``P``).

    Requests are keyed by any int (the cache's request slots). :meth:`check` verifies every
    invariant (tests call it).
    """

    kind = "host"  # which pool the pages are (the errors say it)

    def __init__(self, n_pages: int, page_tokens: int):
        self.n_pages = _checks.integer("n_pages", n_pages, 1, 2**40)
        self.page_tokens = _checks.integer("page_tokens", page_tokens, 1, 2**20)
        self.refs = np.zeros(self.n_pages, np.int64)  # requests and engine holds per page
        self.held = np.zeros(self.n_pages, np.int64)  # the engine's holds per page
        self._free = list(range(self.n_pages - 1, -1, -1))  # a stack: low pages first
        self._pages: dict[int, list[int]] = {}  # request -> its page list
        self._tokens: dict[int, int] = {}  # request -> tokens it has rows for
        self._own: dict[int, int] = {}  # request -> first token it may write
        self._fenced = np.full(self.n_pages, -1, np.int64)  # page -> its fences' group
        self._groups: dict[int, tuple] = {}  # group -> fences (see the module docstring)
        self._next_group = 0

    # ------------------------------------------------------------------ sizes
    @property
    def n_rows(self) -> int:
        """Host rows per layer the pages cover."""
        return self.n_pages * self.page_tokens

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        """Pages that ``n_tokens`` tokens of one request take."""
        return -(-int(n_tokens) // self.page_tokens)

    @staticmethod
    def host_bytes_needed(lengths: ArrayLike, *, page_tokens: int, n_layers: int,
                          row_bytes: int) -> int:
        """Host bytes a paged pool needs for requests of ``lengths`` tokens (none shared):
        at most one page per request more than the tokens held (the slot layout reserves
        ``max_len`` rows for every request slot)."""
        P = _checks.integer("page_tokens", page_tokens, 1)
        n = np.asarray(lengths, np.int64).reshape(-1)
        if (n < 0).any():
            raise ValueError("lengths must be >= 0")
        pages = int((-(-n // P)).sum())
        return pages * P * _checks.integer("n_layers", n_layers, 1) * \
            _checks.integer("row_bytes", row_bytes, 1)

    def __contains__(self, rid) -> bool:
        return rid in self._pages

    def tokens(self, rid: int) -> int:
        """Tokens ``rid`` has rows for."""
        return self._tokens[self._live(rid)]

    def pages(self, rid: int) -> list[int]:
        """``rid``'s page list (a copy)."""
        return list(self._pages[self._live(rid)])

    def own_from(self, rid: int) -> int:
        """The token from which ``rid``'s pages are its own (they were when the last fork or
        engine page made this bound; it does not move back when a sharer leaves): it may
        write tokens at and past it (its newest tokens), never before."""
        return self._own[self._live(rid)]

    # ------------------------------------------------------------------ rows
    def rows(self, rid: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """int64 host rows of ``rid``'s tokens ``[start, stop)`` (default: every token)."""
        n = self.tokens(rid)
        stop = n if stop is None else _checks.integer("stop", stop, 0, n)
        start = _checks.integer("start", start, 0, stop)
        P = self.page_tokens
        first = start // P  # only the pages the range touches, each a run of P rows
        pg = np.asarray(self._pages[rid][first: -(-stop // P)], np.int64)
        rows = (pg[:, None] * P + np.arange(P, dtype=np.int64)).reshape(-1)
        return rows[start - first * P: stop - first * P]

    def table(self, rid: int, max_len: int) -> np.ndarray:
        """``rid``'s ``host_locs`` row: int64 ``[max_len]``, its rows, then -1."""
        n = self.tokens(rid)
        max_len = _checks.integer("max_len", max_len, n)
        out = np.full(max_len, -1, np.int64)
        out[:n] = self.rows(rid)
        return out

    # ------------------------------------------------------------------ requests
    def admit(self, rid: int, n_tokens: int, *, prefix: tuple[int, int] | None = None,
              pages: ArrayLike | None = None, wait=None) -> list[tuple[int, int, int]]:
        """Pages for request ``rid``'s first ``n_tokens`` tokens.

        ``prefix=(parent, p)``: its first ``p`` tokens are the live request ``parent``'s
        (``1 <= p <= parent's tokens``, ``p <= n_tokens``): the parent's whole pages below
        ``p`` are shared; a partial page at ``p`` is a new page of ``rid``'s, to fill from the
        parent's. ``p`` must not exceed the tokens the parent has *written* (:meth:`grow`
        takes rows before the step that writes them): the parent may not write into the
        shared pages afterwards (its :meth:`own_from` moves to their end). ``pages``: page ids
        the engine holds (:meth:`take`), filled, for ``rid``'s first ``len(pages)`` whole pages
        (``len(pages) * page_tokens <= n_tokens``), shared with the engine. Not both.
        ``wait``: gets the fences of the new pages (module docstring; default: wait on the
        host).

        Returns the copies the caller must make before the request's rows are read, as
        ``(src_row, dst_row, count)`` in every layer (at most one: the partial page of a
        prefix). Raises :class:`PoolExhausted` (nothing taken) or ``ValueError`` /
        ``KeyError`` naming the argument.
        """
        rid = int(rid)
        if rid in self._pages:
            raise ValueError(f"rid {rid} is already admitted")
        n = _checks.integer("n_tokens", n_tokens, 1)
        P = self.page_tokens
        if prefix is not None and pages is not None:
            raise ValueError("give prefix or pages, not both")
        shared: list[int] = []
        copy = []
        own = 0
        if prefix is not None:
            if not isinstance(prefix, (tuple, list)) or len(prefix) != 2:
                raise TypeError(f"prefix must be (parent rid, tokens), got {prefix!r}")
            parent = self._live(int(prefix[0]), "prefix's parent")
            p = _checks.integer("prefix tokens", prefix[1], 1, self._tokens[parent])
            if p > n:
                raise ValueError(f"prefix of {p} tokens is longer than n_tokens {n}")
            shared = self._pages[parent][: p // P]
            own = (p // P) * P
            if p % P:  # the partial page: copied, never shared
                copy = [(self._pages[parent][p // P] * P, None, p % P)]
        elif pages is not None:
            shared = [int(g) for g in np.asarray(pages, np.int64).reshape(-1)]
            if len(shared) * P > n:
                raise ValueError(f"pages holds {len(shared)} pages of {P} tokens, more than "
                                 f"n_tokens {n} fill (give whole pages only)")
            if len(set(shared)) != len(shared):
                raise ValueError("pages holds a page twice")
            for g in shared:
                if not 0 <= g < self.n_pages or self.held[g] < 1:
                    raise ValueError(f"pages: page {g} is not held by the engine (take() it "
                                     f"first)")
            own = len(shared) * P
        need = self.pages_for(n) - len(shared)
        if need > len(self._free):
            raise PoolExhausted(f"admit of {n} tokens", need, len(self._free), self.kind)
        new = self._pop(need, wait)
        for g in shared:
            self.refs[g] += 1
        self.refs[new] = 1
        self._pages[rid] = list(shared) + new
        self._tokens[rid] = n
        self._own[rid] = own
        if prefix is not None:  # the parent's pages below `own` are shared from now on
            self._own[parent] = max(self._own[parent], own)
        return [(src, new[0] * P, cnt) for src, _, cnt in copy]

    def grow(self, rid: int, n_tokens: int, *, wait=None) -> list[int]:
        """Pages for ``rid``'s tokens up to ``n_tokens`` (at least its tokens now); returns the
        pages taken (their fences handed to ``wait``, as :meth:`admit`). Raises
        :class:`PoolExhausted` with nothing taken."""
        rid = self._live(rid)
        n = _checks.integer("n_tokens", n_tokens, self._tokens[rid])
        need = self.pages_for(n) - len(self._pages[rid])
        if need > len(self._free):
            raise PoolExhausted(f"rid {rid} growing to {n} tokens", need, len(self._free),
                                self.kind)
        new = self._pop(max(0, need), wait)
        self.refs[new] = 1
        self._pages[rid] += new
        self._tokens[rid] = n
        return new

    def release(self, rid: int, *, fence=None) -> None:
        """Drop ``rid``'s pages (a page another request or the engine holds stays); each of
        them carries ``fence`` from now on (module docstring)."""
        rid = self._live(rid)
        self._drop(self._pages.pop(rid), fence)
        del self._tokens[rid], self._own[rid]

    # ------------------------------------------------------------------ engine-held pages
    def take(self, n: int, *, wait=None) -> list[int]:
        """``n`` free pages held by the engine (its prefix tree's), for :meth:`admit`'s
        ``pages``; :meth:`put` gives them back. A page may be a released request's: by
        default this blocks until the work its fences name is done, so the CPU or another
        process may write the pages at once; ``wait`` takes the fences instead (e.g. a stream
        that will write them waits)."""
        n = _checks.integer("n", n, 0)
        if n > len(self._free):
            raise PoolExhausted(f"take({n})", n, len(self._free), self.kind)
        got = self._pop(n, wait)
        self.refs[got] = 1
        self.held[got] = 1
        return got

    def put(self, pages: ArrayLike, *, fence=None) -> None:
        """Drop the engine's hold on ``pages`` (each one the engine holds, once each); they
        carry ``fence`` from now on (the work the engine may still have on them)."""
        got = [int(g) for g in np.asarray(pages, np.int64).reshape(-1)]
        if len(set(got)) != len(got):
            raise ValueError("pages holds a page twice")
        for g in got:
            if not 0 <= g < self.n_pages or self.held[g] < 1:
                raise ValueError(f"pages: page {g} is not held by the engine")
        self.held[got] -= 1
        self._drop(got, fence)

    def fingerprint(self) -> str:
        """A digest of the whole allocation state (the free pages in the order they will be
        handed out, the engine's holds, every request's pages, tokens and first own token):
        equal for two allocators that went through the same calls. Tensor-parallel ranks
        over one shared pool, whose schedulers make the same calls, compare it to check that
        they agree on every page (``examples/tp_decode.py``)."""
        h = hashlib.blake2b(np.asarray(self._free, np.int64).tobytes(), digest_size=16)
        h.update(self.held.tobytes())
        for rid in sorted(self._pages):
            h.update(np.array([rid, self._tokens[rid], self._own[rid], len(self._pages[rid])]
                              + self._pages[rid], np.int64).tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ internals
    def _live(self, rid, what: str = "rid") -> int:
        rid = int(rid)
        if rid not in self._pages:
            raise KeyError(f"{what} {rid} is not admitted (or was released)")
        return rid

    def fences(self, pages: ArrayLike) -> list:
        """The fences ``pages`` carry that are not done yet (module docstring)."""
        pg = np.asarray(pages, np.int64).reshape(-1)
        out: dict[int, object] = {}
        for g in np.unique(self._fenced[pg]).tolist():
            for f in self._groups.get(g, ()):
                if id(f) not in out and not f.done:
                    out[id(f)] = f
        return list(out.values())

    def _pop(self, n: int, wait) -> list[int]:
        """``n`` pages off the free list, their fences handed to ``wait`` (default: waited
        for on the host) and cleared. A wait that raises puts them back, in their order and
        still fenced: nothing taken (the callers change nothing before this)."""
        got = [self._free.pop() for _ in range(n)]
        if got and self._groups:
            fences = self.fences(got)
            if fences:
                try:
                    if wait is None:
                        for f in fences:
                            f.synchronize()
                    else:
                        wait(fences)
                except BaseException:
                    self._free.extend(reversed(got))
                    raise
            self._fenced[got] = -1
        return got

    def _fence(self, pg: np.ndarray, fence) -> None:
        """``fence`` (one, a tuple, or None) joins the fences pages ``pg`` carry; the ones
        done are dropped."""
        if fence is None or not pg.size:
            return
        new = fence if isinstance(fence, tuple) else (fence,)
        old = self._fenced[pg]
        for g in np.unique(old).tolist():
            kept = tuple(f for f in self._groups.get(g, ()) if not f.done)
            self._groups[self._next_group] = kept + new
            self._fenced[pg[old == g]] = self._next_group
            self._next_group += 1
        if len(self._groups) > 64 + 2 * len(self._pages):  # groups no page names any more
            live = set(np.unique(self._fenced).tolist())
            self._groups = {g: f for g, f in self._groups.items() if g in live}

    def _drop(self, pages: list[int], fence=None) -> None:
        pg = np.asarray(pages, np.int64).reshape(-1)
        self._fence(pg, fence)
        np.subtract.at(self.refs, pg, 1)  # (vectorized: a 128k-token request has 2048 pages)
        freed = pg[self.refs[pg] == 0]
        _, first = np.unique(freed, return_index=True)  # a page listed twice is freed once
        # pushed so that they pop in the order given: a request's runs of consecutive pages
        # come back as runs (a transfer or copy per run, not per page: benchmarks/NOTES.md)
        self._free.extend(freed[np.sort(first)][::-1].tolist())

    def check(self) -> None:
        """Raise ``AssertionError`` unless every invariant holds: each page's count equals the
        requests holding it plus the engine's holds (a free page 0, on the free list once); a
        request's pages cover its tokens; its pages from :meth:`own_from` on are its alone."""
        held = np.zeros(self.n_pages, np.int64)
        for rid, pg in self._pages.items():
            assert len(pg) == self.pages_for(self._tokens[rid]), rid
            assert len(set(pg)) == len(pg), rid
            held[pg] += 1
            for g in pg[self._own[rid] // self.page_tokens:]:
                assert self.refs[g] == 1, (rid, g)
        assert (self.held >= 0).all() and (self.refs == held + self.held).all()
        free = np.asarray(self._free, np.int64)
        assert len(set(self._free)) == free.size
        assert (self.refs[free] == 0).all() and int((self.refs == 0).sum()) == free.size
