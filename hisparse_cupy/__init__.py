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

from ._lazy import lazy

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access: PEP 562; None: a submodule)
_LAZY = {
    "GPUUnavailableError": "_device",
    "HostKVPool": "host.pool",
    "PoolExhausted": "host.pages",
    "HotBufferCache": "cache",
    "SlotsExhausted": "cache",
    "LayerCounters": "counters",
    "Step": "step",
    "MissPlan": "kernels.plan",
    "replay_plan": "kernels.plan",
    "MultiStepConfig": "kernels.multistep",
    "MultiStepState": "kernels.multistep",
    "MultiStepWorkspace": "kernels.multistep",
    "multistep_swap_in": "kernels.multistep",
    "LayerPattern": "streams",
    "Prefetcher": "streams",
    "SMPartition": "streams",
    "layer_pattern": "streams",
    "SwapState": "kernels.swap",
    "swap_in": "kernels.swap",
    "Ptr": "kernels._launch",
    "pdl_enabled": "kernels._launch",
    "pdl_supported": "kernels._launch",
    "set_pdl": "kernels._launch",
    "compile_check": "kernels._build",
    "interop": None,
    "reference": None,
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy(__name__, _LAZY, extra=("__version__",))
