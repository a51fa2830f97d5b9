"""The command line: ``python -m hisparse_cupy COMMAND``.

- ``info``: versions, driver, devices, PDL, the host -> device ceilings for a row size
  measured on this GPU (a ``cudaMemcpyAsync`` and a zero-copy gather of random rows), and the
  rate at which this machine sets up a (2 GB) host pool;
- ``check``: every kernel against the NumPy oracle on this GPU (:mod:`hisparse_cupy._selfcheck`);
  for people who installed a wheel and have no test suite at hand;
- ``demo``: the decode loop (:mod:`hisparse_cupy.demo`; the NumPy oracle without a GPU);
- ``bench``: the benchmark scripts of a source checkout (``benchmarks/bench_*.py``), JSON and
  plots collected in one folder.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import subprocess
import sys
import time
from pathlib import Path

from . import __version__, _checks
from ._device import cupy_or_why


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _ceilings(cupy, row_bytes: int, rows: int = 65536, iters: int = 10) -> tuple[float, float]:
    """GB/s of a cudaMemcpyAsync of ``rows`` rows and of a zero-copy gather of ``rows`` random
    rows of ``row_bytes`` (this package's planned copy), from one pinned mapped pool."""
    import numpy as np

    from .host_pool import HostKVPool
    from .plan import MissPlan, replay_plan

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


def _pool_setup(gb: float = 2.0) -> str:
    """One line: how fast this machine sets up (and tears down) a private host pool of
    ``gb`` GB (anonymous mmap, parallel first touch, chunked cudaHostRegister)."""
    from .host_pool import HostKVPool, default_threads

    try:
        pool = HostKVPool(1, int(gb * 1e9) // 656, 656, alloc="mmap")
        pool.close()
    except (MemoryError, OSError, RuntimeError) as e:  # a small machine, a driver refusal
        return f"  host pool setup: not measured ({type(e).__name__}: {e})"
    t = pool.timings
    return (f"  host pool setup ({gb:g} GB: mmap, first touch by {default_threads()} threads, "
            f"cudaHostRegister): {gb / t['setup_s']:.1f} GB/s (touch {t['touch_s']:.2f} s, "
            f"register {t['register_s']:.2f} s), teardown {t['teardown_s']:.2f} s")


def cmd_info(args) -> int:
    import numpy as np

    import hisparse_cupy

    print(f"hisparse_cupy {hisparse_cupy.__version__}, Python {platform.python_version()}, "
          f"NumPy {np.__version__}")
    for dist in ("cupy-cuda12x", "cupy-cuda13x", "cuda-bindings"):
        v = _version(dist)
        if v != "not installed":
            print(f"{dist} {v}")
    from .host_shm import describe

    print(describe())
    g = cupy_or_why()
    if isinstance(g, str):
        print(g)
        return 0
    cupy = g
    rt = cupy.cuda.runtime
    drv = rt.driverGetVersion()
    print(f"CUDA driver {drv // 1000}.{drv % 1000 // 10}, CuPy {cupy.__version__}")
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        print(f"NVRTC {major}.{minor}")
    except Exception as e:  # NVRTC wheel missing: kernels will not compile
        print(f"NVRTC not found ({type(e).__name__}): kernels cannot compile")
    from ._launch import pdl_supported

    for i in range(rt.getDeviceCount()):
        p = rt.getDeviceProperties(i)
        with cupy.cuda.Device(i):
            pdl = "yes" if pdl_supported(i) else "no (needs sm_90 and HISPARSE_CUPY_PDL != 0)"
            print(f"device {i}: {p['name'].decode()}, sm_{p['major']}{p['minor']}, "
                  f"{p['multiProcessorCount']} SMs, {p['totalGlobalMem'] / 2**30:.0f} GiB, "
                  f"PDL {pdl}")
            if i == args.device:
                memcpy, gather = _ceilings(cupy, args.row_bytes)
                print(f"  ceilings for {args.row_bytes}-byte rows (65536 rows from pinned "
                      f"mapped memory, median of 10): cudaMemcpyAsync {memcpy:.1f} GB/s, "
                      f"zero-copy gather of random rows {gather:.1f} GB/s")
                print(_pool_setup())
    return 0


def _check_cpu(why: str, seed: int) -> int:
    """``check`` without a device: every kernel compiled through NVRTC for sm_80 and sm_90,
    and the NumPy decode loop's bit-for-bit self-check over the oracle; says what it skipped."""
    from ._build import CompileError, compile_check
    from .demo.config import cpu_config
    from .demo.cpu import run

    print(f"no CUDA device ({why}): checking what runs without one", flush=True)
    t0 = time.perf_counter()
    try:
        sizes = compile_check()
    except (ImportError, CompileError) as e:
        print(f"compile check FAILED: {e}")
        return 1
    files = sorted({f for f, _ in sizes})
    print(f"compile check: {len(files)} kernel sources ({', '.join(files)}) x sm_80, sm_90 "
          f"compiled through NVRTC with the runtime's options ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    run(cpu_config(["--steps", "6", "--warmup", "0", "--layers", "4", "--seed", str(seed),
                    "--quiet"]))
    print(f"oracle: the NumPy decode loop's swaps and attention outputs passed their self-check "
          f"({time.perf_counter() - t0:.1f} s)")
    print("not checked without a device: the kernels' results (python -m hisparse_cupy check "
          "on a CUDA machine compares every kernel with the oracle)")
    return 0


def cmd_check(args) -> int:
    g = cupy_or_why()
    if isinstance(g, str):
        return _check_cpu(g, args.seed)
    from ._selfcheck import run

    t0 = time.perf_counter()
    ok = run(seed=args.seed)
    print(f"({time.perf_counter() - t0:.1f} s including compiles)")
    return 0 if ok else 1


def cmd_demo(args) -> int:
    from .demo import main

    return main(args.rest)


def cmd_bench(args) -> int:
    root = Path(__file__).resolve().parents[1]
    scripts = sorted((root / "benchmarks").glob("bench_*.py"))
    if not scripts:
        print("the benchmarks ship with the source repository, not with the package: clone it "
              "and run `python -m hisparse_cupy bench` from the checkout")
        return 1
    if args.names:
        scripts = [p for p in scripts if p.stem in args.names or p.stem[6:] in args.names]
        if not scripts:
            print(f"no benchmark named {args.names}; have: "
                  f"{[p.stem for p in sorted((root / 'benchmarks').glob('bench_*.py'))]}")
            return 2
    g = cupy_or_why()
    if isinstance(g, str):  # before any script runs or any folder is made
        print(f"bench needs a CUDA device: {g}")
        return 1
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for i, p in enumerate(scripts, 1):
        cmd = [sys.executable, str(p), "--out", str(out)] + ([] if args.full else ["--quick"])
        print(f"[{i}/{len(scripts)}] {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        r = subprocess.run(cmd)
        print(f"[{i}/{len(scripts)}] {p.stem}: rc={r.returncode} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        rc = rc or r.returncode
    print(f"results (JSON, PNG): {out}")
    return rc


def _arg(check, name: str):
    """An argparse type: an int passed through ``check(name, value)`` (its message on error)."""

    def parse(text: str) -> int:
        try:
            return check(name, int(text))
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e) if "must" in str(e) else
                                             f"{name} must be an int, got {text!r}") from None

    parse.__name__ = name  # (argparse names the type in its messages)
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hisparse_cupy",
                                 description="hierarchical sparse KV caching: CUDA kernels "
                                             "through CuPy")
    ap.add_argument("--version", action="version", version=f"hisparse_cupy {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="versions, driver, devices, PDL, measured link ceilings")
    p.add_argument("--row-bytes", type=_arg(_checks.row_bytes, "--row-bytes"), default=656,
                   help="row size of the ceilings (a positive multiple of 16)")
    p.add_argument("--device", type=_arg(lambda n, v: _checks.integer(n, v, 0), "--device"),
                   default=0, help="device whose ceilings to measure")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help="every kernel against the NumPy oracle on this GPU "
                                     "(without one: the compile check and the oracle's)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("demo", help="the decode loop (NumPy oracle without a GPU); its options "
                                    "follow (demo --help lists them)", add_help=False)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help="the benchmark scripts of a source checkout")
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all), e.g. swap spec")
    p.add_argument("--full", action="store_true", help="full grids (default: --quick)")
    p.add_argument("--out", default="bench_results", help="folder for JSON and plots")
    p.set_defaults(fn=cmd_bench)
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "demo":
        args.rest = rest
    elif rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.fn(args)
