"""``python -m hisparse_cupy info``: versions; CuPy, NVRTC and the driver, each reported on its
own (what is missing is named as such); the devices, PDL, the host -> device ceilings for a row
size measured on this GPU, and the rate at which this machine sets up a host pool."""

from __future__ import annotations

import importlib.metadata as md
import platform

from .. import __version__
from .._lazy import INSTALL_CUPY
from .usage import OK, emit, stdout_to_stderr

__all__ = ["cmd_info"]


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _ceilings(cupy, row_bytes: int, rows: int = 65536, iters: int = 10) -> tuple[float, float]:
    """GB/s of a cudaMemcpyAsync of ``rows`` rows and of a zero-copy gather of ``rows`` random
    rows of ``row_bytes`` (this package's planned copy), from one pinned mapped pool."""
    import numpy as np

    from .._kernels.plan import MissPlan, replay_plan
    from ..host import HostKVPool

    n_pool = rows * 8
    s = cupy.cuda.Stream(non_blocking=True)
    with HostKVPool(1, n_pool, row_bytes) as pool, s:
        dev = cupy.empty((rows, row_bytes), cupy.uint8)
        plan = MissPlan(1, rows)
        rng = np.random.default_rng(0)
        plan.src[0] = cupy.asarray(rng.choice(n_pool, rows, replace=False).astype(np.int64))
        plan.dst[0] = cupy.arange(rows, dtype=cupy.int32)
        plan.count[0] = rows
        nbytes = rows * row_bytes
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()

        def timed(fn) -> float:
            fn()
            out = []
            for _ in range(iters):
                e0.record(s)
                fn()
                e1.record(s)
                e1.synchronize()
                out.append(cupy.cuda.get_elapsed_time(e0, e1))
            return nbytes / (sorted(out)[iters // 2] * 1e-3) / 1e9

        src = pool.numpy[0]
        memcpy = timed(lambda: cupy.cuda.runtime.memcpyAsync(
            dev.data.ptr, src.ctypes.data, nbytes, cupy.cuda.runtime.memcpyHostToDevice, s.ptr))
        gather = timed(lambda: replay_plan(plan, 1, device_rows=dev, pool=pool, layer=0,
                                           stream=s))
        s.synchronize()
    return memcpy, gather


def _pool_setup(gb: float = 2.0) -> dict:
    """How fast this machine sets up (and tears down) a private host pool of ``gb`` GB
    (anonymous mmap, parallel first touch, chunked cudaHostRegister): rates and seconds, or the
    error that stopped it."""
    from ..host import HostKVPool

    try:
        pool = HostKVPool(1, int(gb * 1e9) // 656, 656, alloc="mmap")
        pool.close()
    except (MemoryError, OSError, RuntimeError) as e:  # a small machine, a driver refusal
        return {"gb": gb, "error": f"{type(e).__name__}: {e}"}
    t = pool.timings
    return {"gb": gb, "threads": HostKVPool.default_threads(),
            "setup_gb_per_s": gb / t["setup_s"],
            **{k: t[k] for k in ("setup_s", "touch_s", "register_s", "teardown_s")}}


def _pool_setup_line(r: dict) -> str:
    if "error" in r:
        return f"  host pool setup: not measured ({r['error']})"
    return (f"  host pool setup ({r['gb']:g} GB: mmap, first touch by {r['threads']} threads, "
            f"cudaHostRegister): {r['setup_gb_per_s']:.1f} GB/s (touch {r['touch_s']:.2f} s, "
            f"register {r['register_s']:.2f} s), teardown {r['teardown_s']:.2f} s")


def _cupy() -> tuple[object | None, str]:
    """The ``cupy`` module, or None and why not (not installed, or its import failed)."""
    try:
        import cupy
    except ImportError:
        return None, f"not installed: {INSTALL_CUPY}"
    except Exception as e:  # a broken install
        return None, f"failed to import: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return cupy, ""


def _nvrtc_version(cupy) -> tuple[str | None, str]:
    """NVRTC's version ("12.9"), through CuPy or else cuda-bindings (neither needs a GPU), or
    None and the error that hid it."""
    try:
        if cupy is not None:
            major, minor = cupy.cuda.nvrtc.getVersion()
        else:
            from cuda.bindings import nvrtc

            _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}", ""
    except Exception as e:  # NVRTC's library missing: kernels will not compile
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _info(args, say) -> dict:
    """What ``info`` reports, as a dict; ``say`` gets the human lines as they come: versions,
    then CuPy, NVRTC and the driver each on its own line (each names what is missing), then
    the devices or why none can be used."""
    import numpy as np

    from .._device import driver_version, why_no_gpu
    from ..host import shared_pools

    doc: dict = {"hisparse_cupy": __version__,
                 "python": platform.python_version(), "numpy": np.__version__}
    say(f"hisparse_cupy {doc['hisparse_cupy']}, Python {doc['python']}, NumPy {doc['numpy']}")
    doc["distributions"] = {}
    for dist in ("cupy-cuda12x", "cupy-cuda13x", "cuda-bindings"):
        v = _version(dist)
        doc["distributions"][dist] = v
        if v is not None:
            say(f"{dist} {v}")
    doc["shm"] = shared_pools()
    say(doc["shm"])
    cupy, cupy_error = _cupy()
    doc["cupy"] = cupy.__version__ if cupy is not None else None
    say(f"CuPy {doc['cupy']}" if cupy is not None else f"CuPy: {cupy_error}")
    doc["nvrtc"], nvrtc_error = _nvrtc_version(cupy)
    say(f"NVRTC {doc['nvrtc']}" if doc["nvrtc"] else
        f"NVRTC: not found ({nvrtc_error}): kernels cannot compile")
    doc["driver"] = driver_version()
    say(f"CUDA driver: supports CUDA {doc['driver']}" if doc["driver"] else
        "CUDA driver: none found (libcuda cannot be loaded)")
    doc["gpu"], doc["why"], doc["host_pool_setup"] = None, why_no_gpu(), None
    if doc["why"] is not None:
        say(f"GPU: none usable: {doc['why']}")
        return doc
    rt = cupy.cuda.runtime
    gpu = doc["gpu"] = {"driver": doc["driver"], "cupy": cupy.__version__, "devices": []}

    from .._kernels.launch import pdl_supported

    for i in range(rt.getDeviceCount()):
        p = rt.getDeviceProperties(i)
        with cupy.cuda.Device(i):
            d = {"index": i, "name": p["name"].decode(),
                 "compute_capability": f"{p['major']}.{p['minor']}",
                 "sms": p["multiProcessorCount"], "memory_bytes": int(p["totalGlobalMem"]),
                 "pdl": bool(pdl_supported(i))}
            gpu["devices"].append(d)
            pdl = "yes" if d["pdl"] else "no (needs sm_90 and HISPARSE_CUPY_PDL != 0)"
            say(f"device {i}: {d['name']}, sm_{p['major']}{p['minor']}, {d['sms']} SMs, "
                f"{d['memory_bytes'] / 2**30:.0f} GiB, PDL {pdl}")
            if i == args.device:
                memcpy, gather = _ceilings(cupy, args.row_bytes)
                d["ceilings"] = {"row_bytes": args.row_bytes, "rows": 65536, "median_of": 10,
                                 "memcpy_gb_per_s": memcpy, "gather_gb_per_s": gather}
                say(f"  ceilings for {args.row_bytes}-byte rows (65536 rows from pinned "
                    f"mapped memory, median of 10): cudaMemcpyAsync {memcpy:.1f} GB/s, "
                    f"zero-copy gather of random rows {gather:.1f} GB/s")
                doc["host_pool_setup"] = _pool_setup()
                say(_pool_setup_line(doc["host_pool_setup"]))
    return doc


def cmd_info(args) -> int:
    if not args.json:
        _info(args, print)
        return OK
    with stdout_to_stderr():
        doc = _info(args, lambda line: None)
    emit(doc)
    return OK


