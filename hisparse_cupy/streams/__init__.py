"""IndexCache shared-layer IO overlap: layer patterns and the side-stream prefetcher."""

from .pattern import LayerPattern, layer_pattern
from .prefetch import Prefetcher, default_replay_grid

__all__ = ["LayerPattern", "Prefetcher", "default_replay_grid", "layer_pattern"]
