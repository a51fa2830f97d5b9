"""IndexCache shared-layer IO overlap: layer patterns, the side-stream prefetcher, and SM
partitions that keep its copies off the compute's SMs."""

from .partition import SMPartition
from .pattern import LayerPattern, layer_pattern
from .prefetch import (
    DEFAULT_REPLAY_ROWS_PER_WARP,
    PARTITION_REPLAY_ROWS_PER_WARP,
    Prefetcher,
    default_replay_grid,
)

__all__ = ["DEFAULT_REPLAY_ROWS_PER_WARP", "PARTITION_REPLAY_ROWS_PER_WARP", "LayerPattern",
           "Prefetcher", "SMPartition", "default_replay_grid", "layer_pattern"]
