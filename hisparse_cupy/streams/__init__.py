"""IndexCache shared-layer IO overlap: layer patterns, the side-stream prefetcher, and SM
partitions that keep its copies off the compute's SMs.

Layer patterns need NumPy only; the Prefetcher and SMPartition (CuPy) are imported on first use.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it (imported on first access: PEP 562)
_LAZY = {
    "DEFAULT_REPLAY_ROWS_PER_WARP": "prefetch",
    "PARTITION_REPLAY_ROWS_PER_WARP": "prefetch",
    "LayerPattern": "pattern",
    "Prefetcher": "prefetch",
    "SMPartition": "partition",
    "default_replay_grid": "prefetch",
    "layer_pattern": "pattern",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hisparse_cupy.streams' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
