"""Helpers shared by the tests: byte patterns and state builders."""

from __future__ import annotations

import numpy as np


def pattern(layer: int, rows: np.ndarray, row_bytes: int) -> np.ndarray:
    """uint8 ``[len(rows), row_bytes]``: a pattern unique to (layer, row) in every 4-byte word."""
    rows = np.asarray(rows, dtype=np.uint64).reshape(-1, 1)
    words = np.arange(row_bytes // 4, dtype=np.uint64).reshape(1, -1)
    key = (np.uint64(layer) * np.uint64(1_000_003) + rows) * np.uint64(2_654_435_761)
    w = (key + words * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(17)
    w = (w & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return w.view(np.uint8).reshape(len(rows), row_bytes)


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
