"""hisparse_cupy: hierarchical sparse KV caching for LLM decoding, CUDA kernels through CuPy.

The full KV cache lives in pinned, device-mapped host memory (:class:`HostKVPool`); each
request keeps a small hot buffer on the GPU, and a swap-in kernel brings the selected top-k
rows in (:func:`swap_in`, :func:`multistep_swap_in`, or the stateful :class:`HotBufferCache`
and its per-step :meth:`HotBufferCache.begin_step`). :mod:`hisparse_cupy.reference` holds the
same algorithms in NumPy.

Importing the package needs NumPy only: :mod:`hisparse_cupy.reference`, the ABI and
:func:`compile_check` work without CuPy; every GPU name below is imported on first use and
needs CuPy (a clear ``ImportError`` names the extras otherwise). Kernels compile on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access: PEP 562)
_LAZY = {
    "GPUUnavailableError": "_device",
    "HostKVPool": "host_pool",
    "HotBufferCache": "cache",
    "SlotsExhausted": "cache",
    "PoolExhausted": "host_pages",
    "LayerCounters": "counters",
    "Step": "step",
    "MissPlan": "plan",
    "replay_plan": "plan",
    "MultiStepConfig": "multistep",
    "MultiStepState": "multistep",
    "MultiStepWorkspace": "multistep",
    "multistep_swap_in": "multistep",
    "LayerPattern": "streams",
    "Prefetcher": "streams",
    "SMPartition": "streams",
    "layer_pattern": "streams",
    "SwapState": "swap",
    "swap_in": "swap",
    "Ptr": "_launch",
    "pdl_enabled": "_launch",
    "pdl_supported": "_launch",
    "set_pdl": "_launch",
    "compile_check": "_build",
    "interop": None,
    "reference": None,
}

__all__ = sorted(_LAZY)

_NEEDS_CUPY = ("hisparse_cupy needs CuPy for its GPU API. Install the extra that matches your "
               "driver: pip install 'hisparse_cupy[cuda12]' (CUDA 12.x driver) or "
               "'hisparse_cupy[cuda13]' (driver >= 580). hisparse_cupy.reference works "
               "without it.")


def __dir__() -> list[str]:
    """The public names (``__all__``) and ``__version__``: not this module's own imports."""
    return sorted([*__all__, "__version__"])


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'hisparse_cupy' has no attribute {name!r}")
    mod = _LAZY[name]
    try:
        m = importlib.import_module(f".{mod or name}", __name__)
    except ImportError as e:
        if e.name == "cupy" or (e.name or "").startswith("cupy."):
            raise ImportError(_NEEDS_CUPY) from e
        raise
    value = m if mod is None else getattr(m, name)
    globals()[name] = value
    return value

