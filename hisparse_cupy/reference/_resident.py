"""The direct path's oracle (``cu/abi.cuh``, ``direct_entry``; ``docs/design.md`` section 10): a
row whose every token has a device row of its own. Its rows have two sources and one rule:

- a **resident** request (``hisparse_cupy.residency``) holds a device page per ``page_tokens``
  tokens, token ``t`` in row ``page_table[r, t // P] * P + t % P`` (:func:`resident_swap`);
- the **positional layout** of a request of ``seq <= H`` holds token ``t`` in hot slot ``t``,
  row ``slot_locs[r, t]`` (the sparse swaps' oracles, :func:`~._single.swap_in` and
  :func:`~._multi.multistep_swap_in`, call :func:`direct_entry` for those rows).

A swap maps every valid entry of such a row to its row: no lookup, no eviction, no copy, and no
plan entry. The -1 rules and the status are those of the sparse swaps, so an entry is -1 exactly
where the sparse swap of the same call gives -1:

- ``t == -1``: -1;
- ``seq <= H``: entry ``i >= seq`` is -1; ``t`` outside ``[0, seq)`` is -1 and counts ``RANGE``;
- ``seq > H``: ``t`` outside ``[0, min(seq, max_len))`` is -1 and counts ``RANGE``;
- a token without a row (-1: a page the engine did not take, a slot without a row) is -1 and
  counts ``NOHOST``;
- a token that was never written (its ``host_locs`` entry -1), other than the newest
  (``seq - 1``, which the step writes), is -1 and counts ``NOHOST``, in a resident row and in
  the positional layout alike: the LRU path has no row for it either (no host row to load),
  and a positional slot may still hold its previous request's row.

Multi-step calls (``[B, S, K]``, lengths ``[B]`` or ``[B, S]``) apply this per step. Rows that
are padding, name a request slot outside ``[0, R)``, have a negative length, or whose request
is not resident are left to the sparse swaps (``served`` False).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .._abi import N_STATUS, ST_NOHOST, ST_RANGE

__all__ = ["DIRECT_NOROW", "DIRECT_RANGE", "DIRECT_SKIP", "ResidentResult", "direct_entry",
           "page_row", "resident_swap"]

DIRECT_SKIP, DIRECT_RANGE, DIRECT_NOROW = -1, -2, -3  # why an entry has no row (cu/abi.cuh)


def page_row(page_table: np.ndarray, rid: int, t: int, page_tokens: int) -> int:
    """Token ``t``'s row in request slot ``rid``'s device pages, -1 where no page is taken."""
    g = t // page_tokens
    page = int(page_table[rid, g]) if g < page_table.shape[1] else -1
    return -1 if page < 0 else page * page_tokens + t % page_tokens


def direct_entry(t: int, i: int, seq: int, *, hot_size: int, max_len: int, row_of,
                 host_row=None) -> int:
    """Entry ``i`` (token ``t``) of a direct row: its row (``row_of(t)``, >= 0), or
    ``DIRECT_SKIP`` (-1, no status), ``DIRECT_RANGE`` or ``DIRECT_NOROW`` (see above).
    ``host_row``: the request's ``host_locs`` row (its tokens never written are NOROW)."""
    if t == -1 or (seq <= hot_size and i >= seq):
        return DIRECT_SKIP
    lim = min(seq, max_len)  # (a positional row may be longer than max_len: H > max_len)
    if not 0 <= t < lim:
        return DIRECT_RANGE
    if host_row is not None and t != seq - 1 and host_row[t] < 0:
        return DIRECT_NOROW
    r = int(row_of(t))
    return r if r >= 0 else DIRECT_NOROW


@dataclass
class ResidentResult:
    """device_locs : int32, the top-k's shape, -1 where no row (and on rows not served);
    status : int32 ``[B, 3]`` (``ST_*``) of the served rows; served : bool ``[B]``."""

    device_locs: np.ndarray
    status: np.ndarray
    served: np.ndarray


def resident_swap(top_k_tokens: np.ndarray, req_indices: np.ndarray, seq_lens: np.ndarray, *,
                  resident: np.ndarray, page_table: np.ndarray, page_tokens: int,
                  hot_size: int, max_len: int, host_locs: np.ndarray,
                  num_real: int | None = None) -> ResidentResult:
    """The resident rows of a swap (see the module docstring).

    top_k_tokens : int ``[B, K]`` or ``[B, S, K]``; seq_lens : int ``[B]`` or ``[B, S]``;
    resident : bool ``[R]``; page_table : int ``[R, pages]`` (device page ids, -1 none);
    host_locs : int64 ``[R, max_len]`` (-1: a token never written).
    """
    topk = np.asarray(top_k_tokens)
    t3 = topk.reshape(topk.shape[0], -1, topk.shape[-1])
    B, S, K = t3.shape
    lens = np.asarray(seq_lens).reshape(B, -1)
    R, P, H = len(resident), int(page_tokens), int(hot_size)
    nr = B if num_real is None else min(max(int(num_real), 0), B)
    out = np.full((B, S, K), -1, np.int32)
    status = np.zeros((B, N_STATUS), np.int32)
    served = np.zeros(B, bool)
    for b in range(nr):
        rid = int(req_indices[b])
        if not (0 <= rid < R) or (lens[b] < 0).any() or not resident[rid]:
            continue
        served[b] = True
        row_of = functools.partial(page_row, page_table, rid, page_tokens=P)
        for s in range(S):
            seq = int(lens[b, s if lens.shape[1] > 1 else 0])
            for i in range(K):
                r = direct_entry(int(t3[b, s, i]), i, seq, hot_size=H, max_len=max_len,
                                 row_of=row_of, host_row=host_locs[rid])
                if r >= 0:
                    out[b, s, i] = r
                elif r == DIRECT_RANGE:
                    status[b, ST_RANGE] += 1
                elif r == DIRECT_NOROW:
                    status[b, ST_NOHOST] += 1
    return ResidentResult(out.reshape(topk.shape), status, served)
