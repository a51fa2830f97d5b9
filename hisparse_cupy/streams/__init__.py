"""IndexCache shared-layer IO overlap: layer patterns, the side-stream prefetcher, and captured
steps that keep the side stream's priority."""

from .graph import PriorityGraph
from .pattern import LayerPattern, layer_pattern
from .prefetch import Prefetcher, default_replay_grid

__all__ = ["LayerPattern", "Prefetcher", "PriorityGraph", "default_replay_grid", "layer_pattern"]
