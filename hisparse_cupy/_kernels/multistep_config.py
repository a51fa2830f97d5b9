"""Sizes of the multi-step (MTP) state, checked without a GPU: :class:`MultiStepConfig`, the
dedup table's size and the commit's shared memory (the rules :mod:`hisparse_cupy._kernels.multistep`
launches with)."""

from __future__ import annotations

import numpy as np

from .. import _abi, _checks


def table_size(max_tokens: int) -> int:
    """Entries of the per-row dedup table (a power of two >= 2 S*K)."""
    return max(64, 1 << (2 * max_tokens - 1).bit_length())


def commit_smem_bytes(hot_size: int, tokens: int) -> int:
    """Dynamic shared memory of the commit for H hot slots and S*K occurrences per row."""
    return _abi.smem_bytes("MULTISTEP_COMMIT", H=hot_size, NW=-(-tokens // 32),
                           NS=_abi.COMMIT_BLOCK // 32 + 1)


class MultiStepConfig:
    """Sizes of the multi-step state, checked without a GPU.

    Parameters
    ----------
    n_requests : R, request slots.
    hot_size : H, hot slots per request, 2 .. 32767.
    extra_page : P >= 1, slots after the hot slots (slot H and on: newest and draft tokens).
    top_k : K, entries per step, 1 .. H.
    max_steps : the most draft steps a call may have, 2 .. 4; ``max_steps * top_k <= 8192``.
    scratch : C, scratch rows per request, ``>= max(1, max_steps - 1, max_steps * top_k - H)``
        (default :func:`default_scratch`). Every miss beyond the scratch rows is copied straight
        into an unreferenced victim; ``S*K - H`` guarantees one exists. A row still in
        positional layout admits nothing, and ``S - 1`` rows hold the draft tokens past H of
        its steps ``L, L + 1, ...``.
    max_batch : rows of the workspace (default ``n_requests``).
    """

    def __init__(self, n_requests: int, hot_size: int, extra_page: int, top_k: int, *,
                 max_steps: int = _abi.MS_MAX_STEPS, scratch: int | None = None,
                 max_batch: int | None = None):
        self.n_requests = _checks.integer("n_requests", n_requests, 1)
        self.hot_size = H = _checks.integer("hot_size", hot_size, 2, _abi.MAX_HOT)
        self.extra_page = _checks.integer("extra_page", extra_page, 1)
        self.top_k = K = _checks.integer("top_k", top_k, 1, H)
        self.max_steps = S = _checks.integer("max_steps", max_steps, _abi.MS_MIN_STEPS,
                                             _abi.MS_MAX_STEPS)
        if S * K > _abi.MS_MAX_TOKENS:
            raise ValueError(f"max_steps * top_k must be <= {_abi.MS_MAX_TOKENS}, got {S} * {K} "
                             f"= {S * K}")
        if scratch is None:
            scratch = _abi.default_scratch(H, K, S)
        self.scratch = _checks.integer("scratch", scratch, max(1, S - 1, S * K - H))
        self.max_batch = _checks.integer(
            "max_batch", self.n_requests if max_batch is None else max_batch, 1)

    @property
    def max_tokens(self) -> int:
        return self.max_steps * self.top_k

    @property
    def slots(self) -> int:
        """H + P: width of the slot tables."""
        return self.hot_size + self.extra_page

    @property
    def rows_per_request(self) -> int:
        """Device rows a request owns: H + P slots plus C scratch rows."""
        return self.slots + self.scratch

    @property
    def table_size(self) -> int:
        return table_size(self.max_tokens)

    @property
    def commit_smem(self) -> int:
        return commit_smem_bytes(self.hot_size, self.max_tokens)

    def state_bytes(self, max_len: int) -> int:
        """Device bytes of one layer's state besides the caller's slot tables and host_locs,
        for tokens below ``max_len`` (the token -> slot table: 2 bytes per token)."""
        R, H = self.n_requests, self.hot_size
        max_len = _checks.integer("max_len", max_len, 1)
        return R * (2 * max_len + 4 * H + 8 + 4 * self.scratch)

    def workspace_bytes(self) -> int:
        return self.max_batch * (12 * self.table_size + 20 * self.max_tokens
                                 + 4 * (_abi.MS_N_COUNTERS + _abi.MS_N_STATS))

    def layout(self, base: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
        """A fresh row layout: request r owns device rows ``base + r * (H + P + C) + [0, H+P+C)``.

        Returns ``(slot_locs int32 [R, H+P], scratch_locs int32 [R, C], n_device_rows)``.
        """
        R, W, C = self.n_requests, self.slots, self.scratch
        per = self.rows_per_request
        start = base + per * np.arange(R, dtype=np.int64).reshape(R, 1)
        slot_locs = (start + np.arange(W)).astype(np.int32)
        scratch_locs = (start + W + np.arange(C)).astype(np.int32)
        return slot_locs, scratch_locs, base + per * R

    def check_tables(self, slot_tokens: np.ndarray, slot_locs: np.ndarray,
                     scratch_locs: np.ndarray, n_device_rows: int) -> None:
        """Validate host copies of the slot tables (raises ValueError naming the problem).

        Hot tokens are -1 or >= 0 and distinct per request; hot slots' rows are >= 0; every row
        >= 0 in ``slot_locs`` and ``scratch_locs`` is below ``n_device_rows`` and owned once.
        """
        R, H, W, C = self.n_requests, self.hot_size, self.slots, self.scratch
        for name, a, shape in (("slot_tokens", slot_tokens, (R, W)),
                               ("slot_locs", slot_locs, (R, W)),
                               ("scratch_locs", scratch_locs, (R, C))):
            if tuple(a.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")
        hot = slot_tokens[:, :H]
        if (slot_tokens < -1).any():
            raise ValueError("slot_tokens holds a value below -1")
        for r in range(R):
            held = hot[r][hot[r] >= 0]
            if np.unique(held).size != held.size:
                raise ValueError(f"slot_tokens[{r}, :H] holds a token twice")
        if (slot_locs[:, :H] < 0).any():
            raise ValueError("slot_locs[:, :hot_size] must be >= 0 (every hot slot owns a row)")
        if (scratch_locs < 0).any():
            raise ValueError("scratch_locs must be >= 0")
        rows = np.concatenate([slot_locs.reshape(-1), scratch_locs.reshape(-1)]).astype(np.int64)
        rows = rows[rows >= 0]
        if rows.size and rows.max() >= n_device_rows:
            raise ValueError(f"a device row ({rows.max()}) is >= n_device_rows ({n_device_rows})")
        if np.unique(rows).size != rows.size:
            raise ValueError("slot_locs and scratch_locs must not share device rows")

    def __repr__(self) -> str:
        return (f"MultiStepConfig(R={self.n_requests}, H={self.hot_size}, P={self.extra_page}, "
                f"K={self.top_k}, S<={self.max_steps}, C={self.scratch}, "
                f"max_batch={self.max_batch})")
