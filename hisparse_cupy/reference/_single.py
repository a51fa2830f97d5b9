"""The single-step swap's oracle (``cu/swap.cu``) and the cache invariants it keeps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._abi import N_STATUS, ST_BADROW, ST_NOHOST, ST_RANGE
from ._resident import DIRECT_NOROW, DIRECT_RANGE, direct_entry

__all__ = ["InvariantError", "SwapResult", "check_invariants", "swap_in"]


@dataclass
class SwapResult:
    """What one single-step swap produced.

    device_locs : int32 ``[B, K]``, device row of each entry, -1 unused / invalid
    plan_src : int64 ``[B, K]``, host row of miss m (entries beyond plan_count are -1 here)
    plan_dst : int32 ``[B, K]``, device row of miss m
    plan_count : int32 ``[B]``
    status : int32 ``[B, 3]``, see ``ST_*``
    """

    device_locs: np.ndarray
    plan_src: np.ndarray
    plan_dst: np.ndarray
    plan_count: np.ndarray
    status: np.ndarray


def swap_in(
    top_k_tokens: np.ndarray,
    req_indices: np.ndarray,
    seq_lens: np.ndarray,
    *,
    host_locs: np.ndarray,
    slot_tokens: np.ndarray,
    slot_locs: np.ndarray,
    lru: np.ndarray,
    hot_size: int,
    n_host_rows: int,
    num_real: int | None = None,
) -> SwapResult:
    """Single-step swap-in (the semantics of ``cu/swap.cu``; state updated in place).

    Parameters
    ----------
    top_k_tokens : int ``[B, K]``
    req_indices, seq_lens : int ``[B]``
    host_locs : int64 ``[R, max_len]``
    slot_tokens : int32 ``[R, H + P]`` (updated)
    slot_locs : int32 ``[R, H + P]``
    lru : int16 ``[R, H]`` (updated)
    hot_size : H
    n_host_rows : rows in the host pool layer (host rows outside it count as missing)
    num_real : rows ``>= num_real`` are padding (default: all real)
    """
    topk = np.asarray(top_k_tokens)
    B, K = topk.shape
    H = int(hot_size)
    R, max_len = host_locs.shape
    nr = B if num_real is None else min(max(int(num_real), 0), B)
    out = np.full((B, K), -1, np.int32)
    psrc = np.full((B, K), -1, np.int64)
    pdst = np.full((B, K), -1, np.int32)
    pcnt = np.zeros(B, np.int32)
    status = np.zeros((B, N_STATUS), np.int32)
    for b in range(nr):
        rid, seq = int(req_indices[b]), int(seq_lens[b])
        if rid < 0 or rid >= R or seq < 0:
            status[b, ST_BADROW] = 1
            continue
        row = topk[b]
        if seq <= H:  # the positional layout: the direct path (token t in slot t)
            for i in range(K):
                r = direct_entry(int(row[i]), i, seq, hot_size=H, max_len=max_len,
                                 row_of=slot_locs[rid].__getitem__,
                                 host_row=host_locs[rid])
                if r >= 0:
                    out[b, i] = r
                elif r == DIRECT_RANGE:
                    status[b, ST_RANGE] += 1
                elif r == DIRECT_NOROW:
                    status[b, ST_NOHOST] += 1
            continue
        lim = min(seq, max_len)
        canon: dict[int, int] = {}  # token -> first entry
        kinds = ["unused"] * K
        for i in range(K):
            tok = int(row[i])
            if tok == -1:
                continue
            if tok < 0 or tok >= lim:
                kinds[i] = "invalid"
                status[b, ST_RANGE] += 1
            elif tok == seq - 1:
                kinds[i] = "newest"
                out[b, i] = slot_locs[rid, H]
            elif tok in canon:
                kinds[i] = "dup"
            else:
                canon[tok] = i
                kinds[i] = "canon"
        hits, evict = [], []
        for p in range(H):
            slot = int(lru[rid, p])
            tok = int(slot_tokens[rid, slot])
            j = canon.get(tok, -1) if tok >= 0 else -1
            if j >= 0 and kinds[j] == "canon":
                kinds[j] = "hit"
                out[b, j] = slot_locs[rid, slot]
                hits.append(slot)
            else:
                evict.append(slot)
        m = 0
        for i in range(K):
            if kinds[i] != "canon":
                continue
            tok = int(row[i])
            hl = int(host_locs[rid, tok])
            if not (0 <= hl < n_host_rows):
                kinds[i] = "nohost"
                status[b, ST_NOHOST] += 1
                continue
            victim = evict[m]
            out[b, i] = slot_locs[rid, victim]
            slot_tokens[rid, victim] = tok
            psrc[b, m], pdst[b, m] = hl, slot_locs[rid, victim]
            m += 1
        for i in range(K):
            if kinds[i] == "dup":
                c = canon[int(row[i])]
                out[b, i] = out[b, c]
                if kinds[c] == "nohost":
                    status[b, ST_NOHOST] += 1
        lru[rid, :] = np.array(evict[m:] + evict[:m] + hits, dtype=lru.dtype)
        pcnt[b] = m
    return SwapResult(out, psrc, pdst, pcnt, status)


class InvariantError(AssertionError):
    """A cache invariant does not hold (the message says which and where)."""


def check_invariants(
    slot_tokens: np.ndarray,
    slot_locs: np.ndarray,
    lru: np.ndarray,
    hot_size: int,
    *,
    requests=None,
) -> None:
    """Assert the single-step cache invariants for the given request slots (default: all).

    - ``lru[r]`` is a permutation of ``0 .. H-1``;
    - every token held in the hot slots ``[0, H)`` is held once (``-1`` = empty);
    - no token below -1;
    - every device row appears at most once over all request slots' ``slot_locs``.
    Raises :class:`InvariantError`.
    """
    H = int(hot_size)
    rows = range(slot_tokens.shape[0]) if requests is None else requests
    ident = np.arange(H)
    for r in rows:
        if not np.array_equal(np.sort(lru[r].astype(np.int64)), ident):
            raise InvariantError(f"lru[{r}] is not a permutation of 0..{H - 1}")
        toks = slot_tokens[r, :H]
        if (toks < -1).any():
            raise InvariantError(f"slot_tokens[{r}] holds a token below -1")
        held = toks[toks >= 0]
        uniq, cnt = np.unique(held, return_counts=True)
        if (cnt > 1).any():
            raise InvariantError(f"slot_tokens[{r}] holds token(s) {uniq[cnt > 1][:8]} twice")
    locs = slot_locs.reshape(-1)
    locs = locs[locs >= 0]
    if np.unique(locs).size != locs.size:
        raise InvariantError("a device row is owned by two slots")
