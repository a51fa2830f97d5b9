"""IndexCache shared-layer IO overlap: layer patterns, the side-stream prefetcher, and SM
partitions that keep its copies off the compute's SMs.

Layer patterns need NumPy only; the Prefetcher and SMPartition (CuPy) are imported on first use.
"""

from __future__ import annotations

from .._lazy import lazy

# public name -> module that defines it (imported on first access: PEP 562)
_LAZY = {
    "DEFAULT_REPLAY_ROWS_PER_WARP": "_prefetch",
    "PARTITION_REPLAY_ROWS_PER_WARP": "_prefetch",
    "LayerPattern": "_pattern",
    "Prefetcher": "_prefetch",
    "SMPartition": "_partition",
    "default_replay_grid": "_prefetch",
    "layer_pattern": "_pattern",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy(__name__, _LAZY)
