"""Where a :class:`~hisparse_cupy.HotBufferCache`'s request slots keep their tokens in the host
pool (the row moves between the pool and GPU memory are ``_kernels/rows.py``'s).

Two layouts, one device table (:class:`CacheRows`):

- the slot layout (``page_tokens=None``, the default): request slot ``r``'s token ``t`` is host
  row ``r * max_len + t``, reserved whatever the request's length (one page of ``max_len``
  rows per slot, page ``r``);
- paged (``page_tokens=P``): the pool's ``n_rows // P`` pages are handed out by a
  :class:`~hisparse_cupy.host._pages.HostPages` as requests are admitted and grow, shared
  between requests with a common prefix, and given back on release.

On the device, ``table`` (int32 ``[R, max_pages]``: the request's page of every P tokens, -1
where none was taken) and ``own_from`` (int32 ``[R]``: tokens below it lie in shared pages)
tell the step's newest-token backup (``cu/newest.cu``) where the newest token goes: row
``table[r, t // P] * P + t % P``, and never into a shared page or a page not taken. Each
token's row is recorded in ``host_locs`` (which the swaps read) once its bytes are there.
"""

from __future__ import annotations

import cupy
import numpy as np

from . import _checks
from ._kernels.rows import store_rows, write_rows_from_host
from ._order import StreamOrder
from .host import HostKVPool, HostPages

__all__ = ["CacheRows"]


def default_pool_rows(max_requests: int, max_len: int, page_tokens: int) -> int:
    """A paged pool's default rows a layer: every request slot at ``max_len`` tokens in whole
    pages of ``page_tokens`` (``max_requests * ceil(max_len / P) * P``)."""
    return max_requests * -(-max_len // page_tokens) * page_tokens


def host_pool(L: int, R: int, max_len: int, row_bytes: int, page_tokens, pool_rows, pool):
    """The cache's host pool and whether the cache made it: ``pool`` checked (``L`` layers of
    ``row_bytes`` rows: ``R * max_len`` of them in the slot layout, a page's when paged), or a
    new one (``pool_rows`` rounded up to pages when paged, default
    :func:`default_pool_rows`)."""
    need = R * max_len
    if page_tokens is None:
        if pool_rows is not None:
            raise ValueError("pool_rows applies to a paged pool (page_tokens=P)")
    else:
        P = _checks.integer("page_tokens", page_tokens, 1, 2**20)
        rows = default_pool_rows(R, max_len, P) if pool_rows is None else \
            _checks.integer("pool_rows", pool_rows, 1)
        need = -(-rows // P) * P if pool is None else P
    if pool is None:
        return HostKVPool(L, need, row_bytes), True
    if not isinstance(pool, HostKVPool):
        raise TypeError(f"pool must be a HostKVPool, got {type(pool).__name__}")
    if pool_rows is not None:
        raise ValueError("give pool_rows or pool, not both")
    if (pool.n_layers, pool.row_bytes) != (L, row_bytes) or pool.n_rows < need:
        raise ValueError(f"pool holds {pool.n_layers} layers of {pool.n_rows} rows of "
                         f"{pool.row_bytes} bytes; the cache needs {L} layers of at least "
                         f"{need} rows of {row_bytes}")
    if page_tokens is not None and pool.n_rows % P:
        raise ValueError(f"pool holds {pool.n_rows} rows per layer, not a whole number of "
                         f"pages of page_tokens={P}")
    return pool, False


class CacheRows:
    """The token -> host row map of ``max_requests`` request slots over ``pool`` (see the
    module docstring), and the writes into its rows. ``pages`` is the :class:`HostPages` of a
    paged map, None in the slot layout. A paged map's pages carry fences
    (``hisparse_cupy/_order.py``, rule 2): a release gives them back with an event after its
    stream's work, and a stream that takes pages (admission, growth) waits for theirs. In
    the slot layout a request slot's rows are its own: the calls' order (rule 1) puts a slot's
    next admission after its release."""

    def __init__(self, max_requests: int, max_len: int, pool, page_tokens: int | None = None):
        R, self.max_len, self.pool = max_requests, max_len, pool
        self.n_rows = n_rows = pool.n_rows
        if page_tokens is None:
            self.pages = None
            self.page_tokens = max_len
            table = np.arange(R, dtype=np.int32).reshape(R, 1)
        else:
            P = self.page_tokens = _checks.integer("page_tokens", page_tokens, 1, 2**20)
            if n_rows < P:
                raise ValueError(f"the host pool holds {n_rows} rows per layer, fewer than one "
                                 f"page of page_tokens={P}")
            if n_rows >= 2**31:
                raise ValueError(f"a paged host pool holds fewer than 2^31 rows per layer, "
                                 f"got {n_rows}")
            self.pages = HostPages(n_rows // P, P)
            table = np.full((R, -(-max_len // P)), -1, np.int32)
        self.table = cupy.asarray(table)
        self.own_from = cupy.zeros(R, cupy.int32)
        # token -> host row, -1 until the row is written (admission, write_host, a step's
        # backup records it on the device); the swaps read it
        self.locs = cupy.full((R, max_len), -1, cupy.int64)
        self._written: dict[int, int] = {}  # paged: tokens the host knows have rows written

    @property
    def paged(self) -> bool:
        return self.pages is not None

    def rows(self, rid: int, start: int, stop: int) -> np.ndarray:
        """int64 host rows of request slot ``rid``'s tokens ``[start, stop)`` (paged: pages
        taken for them)."""
        if self.pages is None:
            return rid * self.max_len + np.arange(start, stop, dtype=np.int64)
        return self.pages.rows(rid, start, stop)

    def own_from_host(self, rid: int) -> int:
        """The first token ``rid`` may write (0 in the slot layout)."""
        return 0 if self.pages is None else self.pages.own_from(rid)

    def shared_tokens(self, n: int, prefix, pages) -> int:
        """The tokens of an admission of ``n`` that ``prefix`` or ``pages`` cover (checked
        forms; the rest is checked by :meth:`admit`)."""
        if prefix is None and pages is None:
            return 0
        if self.pages is None:
            raise ValueError("prefix and pages need a paged host pool: "
                             "HotBufferCache(..., page_tokens=P)")
        if prefix is not None and pages is not None:
            raise ValueError("give prefix or pages, not both")
        if pages is not None:
            return np.asarray(pages).size * self.page_tokens
        if not isinstance(prefix, (tuple, list)) or len(prefix) != 2:
            raise TypeError(f"prefix must be (parent request slot, tokens), got {prefix!r}")
        _checks.integer("prefix's parent", prefix[0], 0)
        p = _checks.integer("prefix tokens", prefix[1], 1)
        if p > n:
            raise ValueError(f"prefix of {p} tokens is longer than n_tokens {n}")
        return p

    def admit(self, rid: int, n: int, prefix, pages, stream) -> list:
        """Rows for ``rid``'s first ``n`` tokens; the tables written on ``stream``. Returns the
        host -> host copies ``(src_row, dst_row, count)`` (every layer) to queue before its
        rows are read. Raises (nothing taken) on a bad prefix or a full pool. A prefix may
        cover the tokens whose rows were written: those of the parent's admission and of its
        steps before its last :meth:`grow` (an engine that grows ahead of its steps must not
        fork past the tokens it wrote)."""
        if self.pages is None:
            return []
        parent = None
        if prefix is not None:
            parent = int(prefix[0])
            if parent not in self._written:
                raise KeyError(f"prefix's parent {parent} is not admitted (or was released)")
            p = _checks.integer("prefix tokens", prefix[1], 1)
            done = self._written_through(parent, p, stream)
            if p > done:
                raise ValueError(f"prefix of {p} tokens: request slot {parent} has not written "
                                 f"token {done} (its host rows hold tokens 0..{done - 1} so "
                                 f"far; a grow() makes room, a step's backup writes the row)")
        copies = self.pages.admit(rid, n, prefix=prefix, pages=pages,
                                  wait=StreamOrder.waiter(stream))
        self._written[rid] = n
        try:
            with stream:
                self._write_pages(rid, 0, self.pages.pages(rid))
                self.own_from[rid] = self.pages.own_from(rid)
                if parent is not None:  # its pages below the fork are shared from now on
                    self.own_from[parent] = self.pages.own_from(parent)
        except BaseException:
            self.release(rid, stream)
            raise
        return copies

    def grow(self, rid: int, n: int, stream) -> None:
        """Pages for ``rid``'s tokens up to ``n`` (their table entries written on ``stream``,
        which first waits for their fences: a step's backup writes them); nothing where it has
        them."""
        n = _checks.integer("n_tokens", n, 1, self.max_len)
        if self.pages is None:
            return
        before = self.pages.tokens(rid)
        if n <= before:  # the room is there (e.g. taken for draft tokens)
            return
        new = self.pages.grow(rid, n, wait=StreamOrder.waiter(stream))
        if new:
            with stream:
                self._write_pages(rid, self.pages.pages_for(before), new)

    def wrote(self, rid: int, start: int, stop: int) -> None:
        """The host learnt that ``rid``'s tokens ``[start, stop)`` have rows written."""
        if rid in self._written and start <= self._written[rid]:
            self._written[rid] = max(self._written[rid], stop)

    def _written_through(self, rid: int, p: int, stream) -> int:
        """How many of ``rid``'s first ``p`` tokens have host rows written, in the order of
        ``stream``: the host knows its admission's and :meth:`wrote`'s; a step's backups are
        read from ``locs`` on the device, after the work queued on ``stream`` (synchronized:
        only a fork past what the host knows pays it)."""
        done = self._written[rid]
        if p > done:
            locs = self.locs[rid, done:p].get(stream=stream)
            stream.synchronize()
            unwritten = np.flatnonzero(locs < 0)
            done += int(unwritten[0]) if unwritten.size else p - done
            self._written[rid] = done
        return done

    def release(self, rid: int, stream) -> None:
        """``rid``'s pages back (those no other request holds are free), carrying an event
        after the work queued on ``stream``; its table row cleared there."""
        if self.pages is None:
            return
        with StreamOrder.fence(stream) as ev:
            self.pages.release(rid, fence=ev)
            del self._written[rid]
            with stream:
                self.table[rid] = -1
                self.own_from[rid] = 0

    def check(self, req, lens) -> None:
        """Raise ``ValueError`` unless each admitted request slot of ``req`` (host ints) has
        pages for its ``lens`` tokens and its device page table and ``own_from`` equal the
        host's (paged; synchronizes). The kernels never read or write past the pool anyway."""
        table, own = cupy.asnumpy(self.table), cupy.asnumpy(self.own_from)
        for r, n in zip(np.asarray(req).tolist(), np.asarray(lens).tolist(), strict=True):
            if r not in self.pages:
                continue  # not admitted (or out of range): the swaps' per-row status says it
            if n > self.pages.tokens(r):
                raise ValueError(f"request slot {r}: seq_len {n} past its host pages "
                                 f"({self.pages.tokens(r)} tokens): grow() it before the step")
            pg = np.asarray(self.pages.pages(r), np.int32)
            if (table[r, :pg.size] != pg).any() or (table[r, pg.size:] != -1).any() or \
                    own[r] != self.pages.own_from(r):
                raise ValueError(f"request slot {r}: the device page table disagrees with "
                                 f"its host pages")

    def store(self, rows: np.ndarray, kv, on_host: bool, s) -> None:
        """Write ``kv`` (``[L, n, row_bytes]``) into host ``rows`` (taken by an admission or
        growth queued on ``s``, which waited for their fences): a GPU array with one launch on
        stream ``s``; a host array by the CPU, after the work queued on ``s``
        (synchronized)."""
        if not len(rows):
            return
        if on_host:
            s.synchronize()
            write_rows_from_host(self.pool, rows, kv)
        else:
            store_rows(self.pool, rows, kv, s)

    def _write_pages(self, rid: int, at: int, pages) -> None:
        """Table entries ``at..`` of ``rid`` (current stream): a few as kernel arguments (no
        host -> device copy from pageable memory, which may wait for the device), more as one
        copy."""
        if len(pages) <= 4:
            for j, g in enumerate(pages):
                self.table[rid, at + j] = g
        else:
            self.table[rid, at: at + len(pages)] = cupy.asarray(np.asarray(pages, np.int32))
