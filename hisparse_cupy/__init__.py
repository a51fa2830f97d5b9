"""hisparse_cupy: hierarchical sparse KV caching for LLM decoding, CUDA kernels through CuPy.

The full KV cache lives in pinned, device-mapped host memory (:class:`HostKVPool`); each
request keeps a small hot buffer on the GPU, and a swap-in kernel brings the selected top-k
rows in (:func:`swap_in`, or the stateful :class:`HotBufferCache`). :mod:`hisparse_cupy.reference`
holds the same algorithms in NumPy.

Importing works without a GPU (kernels compile on first use); CuPy itself is required.
"""

try:
    import cupy  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without CuPy
    raise ImportError(
        "hisparse_cupy needs CuPy. Install the extra that matches your driver: "
        "pip install 'hisparse_cupy[cuda12]' (CUDA 12.x driver) or "
        "'hisparse_cupy[cuda13]' (driver >= 580)."
    ) from e

from . import reference
from ._build import compile_check
from ._launch import Ptr, pdl_enabled, pdl_supported, set_pdl
from .cache import HotBufferCache
from .host_pool import HostKVPool
from .plan import MissPlan, replay_plan
from .spec import SpecConfig, SpecState, SpecWorkspace, spec_swap_in
from .streams import LayerPattern, Prefetcher, layer_pattern
from .swap import SwapState, swap_in

__version__ = "0.1.0"

__all__ = [
    "HostKVPool",
    "HotBufferCache",
    "LayerPattern",
    "MissPlan",
    "Prefetcher",
    "Ptr",
    "SpecConfig",
    "SpecState",
    "SpecWorkspace",
    "SwapState",
    "compile_check",
    "layer_pattern",
    "pdl_enabled",
    "pdl_supported",
    "reference",
    "replay_plan",
    "set_pdl",
    "spec_swap_in",
    "swap_in",
]
