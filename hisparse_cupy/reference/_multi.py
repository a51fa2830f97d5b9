"""The multi-step (MTP) swap's oracle (``cu/multistep.cu``), its invariants, and a layer
mirrored into another."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _abi
from .._abi import N_STATUS, ST_BADROW, ST_NOHOST, ST_RANGE
from ._resident import DIRECT_NOROW, DIRECT_RANGE, direct_entry
from ._single import InvariantError

__all__ = ["MULTISTEP_KINDS", "MultiStepResult", "check_multistep_invariants", "mirror_layer",
           "multistep_swap_in"]


# =============================================================================================
# Multi-step (MTP) swap: gather + commit (cu/multistep.cu, multistep.py)
#
# The oracle below follows the kernels' semantics (the header of cu/multistep.cu states them). The
# kernels number unique misses in the order their claims land (not deterministic); pass that
# order (``miss_order``, e.g. read back from a recorded miss plan) and the oracle reproduces the
# call exactly: outputs, status, plan, statistics and every state array but the token -> slot
# table, whose entries for tokens no slot holds are never read (check_multistep_invariants checks
# the entries that count).
# =============================================================================================

_KEY_EMPTY, _KEY_NEVER, _KEY_AGE_MAX = _abi.MS_KEY_EMPTY, _abi.MS_KEY_NEVER, _abi.MS_KEY_AGE_MAX
_M32 = 0xFFFFFFFF


@dataclass
class MultiStepResult:
    """What one multi-step call produced.

    device_locs : int32 ``[B, S, K]``, device row of each occurrence, -1 unused / invalid
    tokens : int32 ``[B, S, K]``, the token whose bytes ``device_locs`` must hold, -1 where none
    kind : uint8 ``[B, S, K]``, one of ``MULTISTEP_KINDS`` (index)
    plan_src : int64 ``[B, S*K]``, host row of unique miss u (-1 beyond plan_count)
    plan_dst : int32 ``[B, S*K]``, device row it was copied to
    plan_count : int32 ``[B]``, unique misses (0 for padding and bad rows)
    status : int32 ``[B, 3]`` (``ST_*``)
    stats : int32 ``[B, 4]``: unique misses, admitted, evictable slots, partial admission
    misses : per row, the unique missed tokens in miss-ordinal order
    """

    device_locs: np.ndarray
    tokens: np.ndarray
    kind: np.ndarray
    plan_src: np.ndarray
    plan_dst: np.ndarray
    plan_count: np.ndarray
    status: np.ndarray
    stats: np.ndarray
    misses: list


MULTISTEP_KINDS = ("unused", "range", "positional", "extra", "hit", "miss", "nohost", "badrow")


def multistep_swap_in(
    top_k_tokens: np.ndarray,
    req_indices: np.ndarray,
    seq_lens: np.ndarray,
    *,
    host_locs: np.ndarray,
    slot_tokens: np.ndarray,
    slot_locs: np.ndarray,
    scratch_locs: np.ndarray,
    ref: np.ndarray,
    clock: np.ndarray,
    hot_size: int,
    n_host_rows: int,
    num_real: int | None = None,
    miss_order=None,
) -> MultiStepResult:
    """Multi-step swap-in (the semantics of ``cu/multistep.cu``; state updated in place).

    Parameters
    ----------
    top_k_tokens : int ``[B, S, K]``
    req_indices : int ``[B]``;  seq_lens : int ``[B, S]`` (its first S columns) or ``[B]``
    (every step the same length)
    host_locs : int64 ``[R, max_len]``
    slot_tokens, slot_locs : int32 ``[R, H + P]`` (updated)
    scratch_locs : int32 ``[R, C]`` (updated)
    ref : uint32 ``[R, H]`` reference epochs (updated);  clock : uint32 ``[R, 2]`` (updated)
    hot_size : H;  n_host_rows : rows of the host pool layer
    num_real : rows ``>= num_real`` are padding (default: all real)
    miss_order : optional, per batch row a sequence of the row's unique missed tokens in
        miss-ordinal order (what the kernel's claims produced). Default: order of first
        occurrence, step-major.
    """
    topk = np.asarray(top_k_tokens)
    B, S, K = topk.shape
    T = S * K
    H = int(hot_size)
    R, max_len = host_locs.shape
    P = slot_tokens.shape[1] - H
    C = scratch_locs.shape[1]
    nr = B if num_real is None else min(max(int(num_real), 0), B)
    out = np.full((B, S, K), -1, np.int32)
    toks = np.full((B, S, K), -1, np.int32)
    kind = np.zeros((B, S, K), np.uint8)
    psrc = np.full((B, T), -1, np.int64)
    pdst = np.full((B, T), -1, np.int32)
    pcnt = np.zeros(B, np.int32)
    status = np.zeros((B, N_STATUS), np.int32)
    stats = np.zeros((B, 4), np.int32)
    k_of = {n: i for i, n in enumerate(MULTISTEP_KINDS)}
    all_misses: list = [[] for _ in range(B)]
    for b in range(nr):
        rid = int(req_indices[b])
        row = np.asarray(seq_lens[b]).reshape(-1)  # [S'] per step, or one length for all
        seqs = [int(v) for v in (np.repeat(row, S) if row.size == 1 else row[:S])]
        if rid < 0 or rid >= R or min(seqs) < 0:
            status[b, ST_BADROW] = 1
            kind[b] = k_of["badrow"]
            continue
        epoch = int(clock[rid, 0])
        cursor = int(clock[rid, 1]) % H
        where = {int(t): s for s, t in enumerate(slot_tokens[rid, :H]) if t >= 0}
        extra = slot_tokens[rid, H:]
        misses: dict[int, list] = {}  # token -> [host row, min reverse rank, occurrences]
        for s in range(S):
            seq = seqs[s]
            for i in range(K):
                tok = int(topk[b, s, i])
                if tok == -1:
                    continue
                if seq <= H:  # the positional layout: the direct path (token t in slot t)
                    r = direct_entry(tok, i, seq, hot_size=H, max_len=max_len,
                                     row_of=slot_locs[rid].__getitem__,
                                     host_row=host_locs[rid])
                    if r >= 0:
                        out[b, s, i] = r
                        toks[b, s, i] = tok
                        kind[b, s, i] = k_of["positional"]
                        ref[rid, tok] = epoch
                    elif r == DIRECT_RANGE:
                        status[b, ST_RANGE] += 1
                        kind[b, s, i] = k_of["range"]
                    elif r == DIRECT_NOROW:
                        status[b, ST_NOHOST] += 1
                        kind[b, s, i] = k_of["nohost"]
                    continue
                if tok < 0 or tok >= seq or tok >= max_len:
                    status[b, ST_RANGE] += 1
                    kind[b, s, i] = k_of["range"]
                    continue
                if tok >= min(seqs) - P:  # the row's shortest step: one row per token
                    js = [j for j in range(P) if extra[j] == tok and slot_locs[rid, H + j] >= 0]
                    if js:
                        out[b, s, i] = slot_locs[rid, H + js[0]]
                        toks[b, s, i] = tok
                        kind[b, s, i] = k_of["extra"]
                        continue
                slot = where.get(tok, -1)
                if slot >= 0:
                    out[b, s, i] = slot_locs[rid, slot]
                    toks[b, s, i] = tok
                    kind[b, s, i] = k_of["hit"]
                    ref[rid, slot] = epoch
                    continue
                hl = int(host_locs[rid, tok])
                if not 0 <= hl < n_host_rows:
                    status[b, ST_NOHOST] += 1
                    kind[b, s, i] = k_of["nohost"]
                    continue
                rank = (S - 1 - s) * K + i
                m = misses.setdefault(tok, [hl, rank, []])
                m[1] = min(m[1], rank)
                m[2].append((s, i))
                toks[b, s, i] = tok
                kind[b, s, i] = k_of["miss"]
        if miss_order is None:
            order = list(misses)  # dict order = first occurrence, step-major
        else:
            order = [int(t) for t in miss_order[b]]
            if sorted(order) != sorted(misses):
                raise ValueError(f"row {b}: miss_order {sorted(order)[:8]}... is not the set of "
                                 f"unique misses {sorted(misses)[:8]}...")
        M = len(order)
        # eviction keys in ring order from the cursor
        ring = (cursor + np.arange(H)) % H
        keys = np.empty(H, np.int64)
        positional = min(seqs) <= H  # later calls read its slots in place: admit nothing
        for j, slot in enumerate(ring):
            r = int(ref[rid, slot])
            if positional or r == epoch:
                keys[j] = 0
            elif slot_tokens[rid, slot] < 0:
                keys[j] = _KEY_EMPTY
            elif r == 0:
                keys[j] = _KEY_NEVER
            else:
                keys[j] = min((epoch - r) & _M32, _KEY_AGE_MAX)
        E = int((keys > 0).sum())
        V = min(M, E)
        partial = M > E
        cand = np.nonzero(keys > 0)[0]
        chosen = sorted(sorted(cand.tolist(), key=lambda j: (-keys[j], j))[:V])
        victims = [int(ring[j]) for j in chosen]
        new_cursor = (cursor + chosen[-1] + 1) % H if chosen else cursor
        # admitted misses, in miss order (smallest reverse rank first)
        rank_of = {t: misses[t][1] for t in order}
        if not partial:
            admitted = list(order)
        else:
            n_over = max(0, M - C)
            budget = max(0, V - n_over)
            scr = sorted(order[:C], key=lambda t: rank_of[t])
            admitted = order[C:] + scr[:budget]
        admitted.sort(key=lambda t: rank_of[t])
        victim_of = {t: victims[a] for a, t in enumerate(admitted) if a < V}
        loc_of = {}
        for u, t in enumerate(order):
            if u < C:
                loc_of[t] = int(scratch_locs[rid, u])
            elif t in victim_of:
                loc_of[t] = int(slot_locs[rid, victim_of[t]])
            else:
                loc_of[t] = -1
                status[b, ST_BADROW] = 1  # unreachable while C >= S*K - H (and S - 1)
            psrc[b, u] = misses[t][0] if loc_of[t] >= 0 else -1
            pdst[b, u] = loc_of[t]
        for u, t in enumerate(order):
            if t not in victim_of:
                continue
            v = victim_of[t]
            slot_tokens[rid, v] = t
            ref[rid, v] = epoch
            if u < C:
                old = slot_locs[rid, v]
                slot_locs[rid, v] = scratch_locs[rid, u]
                scratch_locs[rid, u] = old
        for t in order:
            for s, i in misses[t][2]:
                out[b, s, i] = loc_of[t]
        nxt = (epoch + 1) & _M32
        if nxt == 0:
            nxt = 1
            ref[rid, :] = 0
        clock[rid, 0] = nxt
        clock[rid, 1] = new_cursor
        pcnt[b] = M
        stats[b] = (M, V, E, int(partial))
        all_misses[b] = order
    return MultiStepResult(out, toks, kind, psrc, pdst, pcnt, status, stats, all_misses)


def check_multistep_invariants(
    slot_tokens: np.ndarray,
    slot_locs: np.ndarray,
    scratch_locs: np.ndarray,
    token_slot: np.ndarray,
    ref: np.ndarray,
    clock: np.ndarray,
    hot_size: int,
    *,
    n_device_rows: int | None = None,
    requests=None,
) -> None:
    """Assert the multi-step state invariants (raises :class:`InvariantError`).

    For each request slot (default: all):
    - hot tokens are -1 or >= 0, each held once;
    - ``clock`` epoch != 0, cursor in ``[0, H)``; every ref epoch is 0 or older than the epoch;
    - the token -> slot table names the slot of every hot token below its width
      (``token_slot[r, t] == s`` where ``slot_tokens[r, s] == t``, ``s < H``).
    Over all requests: hot slots own a row; every row in ``slot_locs`` and ``scratch_locs`` is
    owned once (and below ``n_device_rows`` when given).
    """
    H = int(hot_size)
    R = slot_tokens.shape[0]
    width = token_slot.shape[1]
    rows = range(R) if requests is None else requests
    for r in rows:
        toks = slot_tokens[r, :H]
        if (toks < -1).any():
            raise InvariantError(f"slot_tokens[{r}] holds a token below -1")
        held = toks[toks >= 0]
        uniq, cnt = np.unique(held, return_counts=True)
        if (cnt > 1).any():
            raise InvariantError(f"slot_tokens[{r}] holds token(s) {uniq[cnt > 1][:8]} twice")
        epoch, cursor = int(clock[r, 0]), int(clock[r, 1])
        if epoch == 0 or not 0 <= cursor < H:
            raise InvariantError(f"clock[{r}] = ({epoch}, {cursor}) is invalid")
        refs = ref[r].astype(np.int64)
        if ((refs != 0) & (refs >= epoch)).any():
            raise InvariantError(f"ref[{r}] holds an epoch >= the current epoch {epoch}")
        slots = np.nonzero((toks >= 0) & (toks < width))[0]
        named = token_slot[r, toks[slots]].astype(np.int64)
        bad = slots[named != slots]
        if bad.size:
            s0 = int(bad[0])
            raise InvariantError(f"token_slot[{r}] maps hot token {int(toks[s0])} to "
                                 f"{int(token_slot[r, toks[s0]])}, not to its slot {s0} "
                                 f"({bad.size} such)")
    if (slot_locs[:, :H] < 0).any():
        raise InvariantError("a hot slot owns no device row")
    locs = np.concatenate([slot_locs.reshape(-1), scratch_locs.reshape(-1)])
    locs = locs[locs >= 0]
    if np.unique(locs).size != locs.size:
        raise InvariantError("a device row is owned twice (slot_locs / scratch_locs)")
    if n_device_rows is not None and locs.size and locs.max() >= n_device_rows:
        raise InvariantError(f"device row {locs.max()} >= n_device_rows {n_device_rows}")


def mirror_layer(src: dict, dst: dict, *, host_locs: np.ndarray, dst_device: np.ndarray,
                 dst_host: np.ndarray) -> None:
    """Layer ``dst`` takes layer ``src``'s state (``HotBufferCache.mirror_layer(rows=True)``).

    ``src``, ``dst``: each layer's tables by name (``slot_tokens`` and ``slot_locs`` ``[R, W]``
    and any others), ``dst`` updated in place. The row where ``src`` holds token t (any slot)
    receives ``dst``'s bytes of t: from the row where ``dst`` held it (its first slot holding
    t, if several do), else from ``dst``'s host row of t (``dst_host[host_locs[r, t]]``);
    ``dst_device`` ``[D, row_bytes]`` is updated. Then every table of ``src`` is copied into
    ``dst``.
    """
    R, W = src["slot_tokens"].shape
    max_len = host_locs.shape[1]
    before = dst_device.copy()
    for r in range(R):
        where: dict[int, int] = {}  # a token held twice: its first slot's row
        for t, loc in zip(dst["slot_tokens"][r], dst["slot_locs"][r], strict=True):
            if t >= 0:
                where.setdefault(int(t), int(loc))
        for t, to in zip(src["slot_tokens"][r], src["slot_locs"][r], strict=True):
            t = int(t)
            if t < 0:
                continue
            if t in where:
                dst_device[to] = before[where[t]]
            elif t < max_len and host_locs[r, t] >= 0:
                dst_device[to] = dst_host[host_locs[r, t]]
    for name, table in src.items():
        dst[name][...] = table
