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
    "HostKVPool": "host._pool",
    "PoolExhausted": "host._pages",
    "HotBufferCache": "cache",
    "SlotsExhausted": "cache",
    "LayerCounters": "counters",
    "Step": "step",
    "MissPlan": "_kernels.plan",
    "replay_plan": "_kernels.plan",
    "MultiStepConfig": "_kernels.multistep",
    "MultiStepState": "_kernels.multistep",
    "MultiStepWorkspace": "_kernels.multistep",
    "multistep_swap_in": "_kernels.multistep",
    "LayerPattern": "streams",
    "Prefetcher": "streams",
    "SMPartition": "streams",
    "layer_pattern": "streams",
    "SwapState": "_kernels.swap",
    "swap_in": "_kernels.swap",
    "Ptr": "_device",
    "pdl_supported": "_kernels.launch",
    "compile_check": "_kernels.build",
    "interop": None,
    "reference": None,
}

__all__ = sorted(_LAZY)


def _set_pdl(enabled: bool) -> None:
    from ._kernels import launch

    launch.FIXED["pdl"] = bool(enabled)


def _pdl_enabled() -> bool:
    from ._kernels import launch

    return launch.FIXED["pdl"]


_PDL = ("PDL is each call's pdl= and HISPARSE_CUPY_PDL=0 for the process "
        "(measurements: hisparse_cupy.testing.knobs.pdl)")
__getattr__, __dir__ = lazy(__name__, _LAZY, extra=("__version__",),
                            deprecated={"set_pdl": (_set_pdl, _PDL),
                                        "pdl_enabled": (_pdl_enabled, _PDL)})
