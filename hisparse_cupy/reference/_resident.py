"""The resident path's oracle: a request whose KV is all on the GPU (``hisparse_cupy.residency``,
``docs/design.md`` section 10). The kernels do not take this path yet; this is its contract.

A resident request holds a device page per ``page_tokens`` tokens, and its token ``t`` lives in
row ``page_table[r, t // P] * P + t % P``. A swap maps every valid entry of such a row to that
row: no lookup, no eviction, no copy, and no plan entry. The -1 rules and the status are those
of the sparse swaps, so an entry is -1 exactly where the sparse swap of the same call gives -1:

- ``t == -1``: -1;
- ``seq <= H`` (the positional rule): entry ``i >= seq`` is -1; ``t`` outside ``[0, seq)`` is -1
  and counts ``RANGE``;
- ``seq > H``: ``t`` outside ``[0, min(seq, max_len))`` is -1 and counts ``RANGE``;
- a token whose page is missing (-1 in the table: the engine did not grow the request) is -1
  and counts ``NOHOST``.

Multi-step calls (``[B, S, K]``, lengths ``[B]`` or ``[B, S]``) apply this per step. Rows that
are padding, name a request slot outside ``[0, R)``, have a negative length, or whose request
is not resident are left to the sparse swaps (``served`` False).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._abi import N_STATUS, ST_NOHOST, ST_RANGE

__all__ = ["ResidentResult", "resident_swap"]


@dataclass
class ResidentResult:
    """device_locs : int32, the top-k's shape, -1 where no row (and on rows not served);
    status : int32 ``[B, 3]`` (``ST_*``) of the served rows; served : bool ``[B]``."""

    device_locs: np.ndarray
    status: np.ndarray
    served: np.ndarray


def resident_swap(top_k_tokens: np.ndarray, req_indices: np.ndarray, seq_lens: np.ndarray, *,
                  resident: np.ndarray, page_table: np.ndarray, page_tokens: int,
                  hot_size: int, max_len: int, num_real: int | None = None) -> ResidentResult:
    """The resident rows of a swap (see the module docstring).

    top_k_tokens : int ``[B, K]`` or ``[B, S, K]``; seq_lens : int ``[B]`` or ``[B, S]``;
    resident : bool ``[R]``; page_table : int ``[R, pages]`` (device page ids, -1 none).
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
        for s in range(S):
            seq = int(lens[b, s if lens.shape[1] > 1 else 0])
            lim = seq if seq <= H else min(seq, max_len)
            for i in range(K):
                t = int(t3[b, s, i])
                if t == -1 or (seq <= H and i >= seq):
                    continue
                if not 0 <= t < lim:
                    status[b, ST_RANGE] += 1
                    continue
                page = int(page_table[rid, t // P]) if t // P < page_table.shape[1] else -1
                if page < 0:
                    status[b, ST_NOHOST] += 1
                    continue
                out[b, s, i] = page * P + t % P
    return ResidentResult(out.reshape(topk.shape), status, served)
