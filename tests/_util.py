"""Helpers shared by the tests: byte patterns and state builders."""

from __future__ import annotations

import numpy as np

from hisparse_cupy._selfcheck import pattern  # noqa: F401  (one copy, shared with the check)


def lru_state(R: int, H: int, P: int, rng, *, fill: float = 0.7, max_token: int = 10**6):
    """Random but valid single-step state: unique tokens per request, random LRU order."""
    slot_tokens = np.full((R, H + P), -1, np.int32)
    lru = np.empty((R, H), np.int16)
    for r in range(R):
        n = int(H * fill)
        toks = rng.choice(max_token, size=n, replace=False).astype(np.int32)
        slots = rng.choice(H, size=n, replace=False)
        slot_tokens[r, slots] = toks
        lru[r] = rng.permutation(H).astype(np.int16)
    slot_locs = np.arange(R * (H + P), dtype=np.int32).reshape(R, H + P)
    return slot_tokens, slot_locs, lru
