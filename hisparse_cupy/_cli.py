"""The command line: ``python -m hisparse_cupy COMMAND``.

- ``info``: versions, driver, devices, PDL, the host -> device ceilings for a row size
  measured on this GPU (a ``cudaMemcpyAsync`` and a zero-copy gather of random rows), and the
  rate at which this machine sets up a (2 GB) host pool;
- ``check``: every kernel against the NumPy oracle on this GPU
  (:mod:`hisparse_cupy.testing.selfcheck`); for people who installed a wheel and have no test
  suite at hand;
- ``demo``: the decode loop (:mod:`hisparse_cupy.demo`; the NumPy oracle without a GPU);
- ``bench``: the benchmark scripts of a source checkout (``benchmarks/bench_*.py``), JSON and
  plots collected in one folder.

``info --json`` and ``check --json`` print one JSON object on stdout instead of the text (what
``check`` prints as it goes moves to stderr); the exit status is the same.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import time
import traceback
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

    from ._kernels.plan import MissPlan, replay_plan
    from .host._pool import HostKVPool

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
    from .host._pool import HostKVPool, default_threads

    try:
        pool = HostKVPool(1, int(gb * 1e9) // 656, 656, alloc="mmap")
        pool.close()
    except (MemoryError, OSError, RuntimeError) as e:  # a small machine, a driver refusal
        return {"gb": gb, "error": f"{type(e).__name__}: {e}"}
    t = pool.timings
    return {"gb": gb, "threads": default_threads(), "setup_gb_per_s": gb / t["setup_s"],
            **{k: t[k] for k in ("setup_s", "touch_s", "register_s", "teardown_s")}}


def _pool_setup_line(r: dict) -> str:
    if "error" in r:
        return f"  host pool setup: not measured ({r['error']})"
    return (f"  host pool setup ({r['gb']:g} GB: mmap, first touch by {r['threads']} threads, "
            f"cudaHostRegister): {r['setup_gb_per_s']:.1f} GB/s (touch {r['touch_s']:.2f} s, "
            f"register {r['register_s']:.2f} s), teardown {r['teardown_s']:.2f} s")


def _nvrtc_version() -> tuple[str | None, str]:
    """NVRTC's version ("12.9"), or None and the name of the error that hid it."""
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}", ""
    except Exception as e:  # NVRTC wheel missing: kernels will not compile
        return None, type(e).__name__


@contextlib.contextmanager
def _stdout_to_stderr():
    """Meanwhile whatever Python or a C library writes to stdout goes to stderr: ``--json``
    keeps stdout for its one object."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptor 1: Python's own prints are redirected still
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _emit(doc: dict) -> None:
    print(json.dumps(doc, indent=1))


def _info(args, say) -> dict:
    """What ``info`` reports, as a dict; ``say`` gets the human lines as they come."""
    import numpy as np

    from .host._shm import describe

    doc: dict = {"hisparse_cupy": __version__,
                 "python": platform.python_version(), "numpy": np.__version__}
    say(f"hisparse_cupy {doc['hisparse_cupy']}, Python {doc['python']}, NumPy {doc['numpy']}")
    doc["distributions"] = {}
    for dist in ("cupy-cuda12x", "cupy-cuda13x", "cuda-bindings"):
        v = _version(dist)
        doc["distributions"][dist] = None if v == "not installed" else v
        if v != "not installed":
            say(f"{dist} {v}")
    doc["shm"] = describe()
    say(doc["shm"])
    doc["nvrtc"], nvrtc_error = _nvrtc_version()
    doc["gpu"], doc["why"], doc["host_pool_setup"] = None, None, None
    g = cupy_or_why()
    if isinstance(g, str):
        doc["why"] = g
        say(g)
        return doc
    cupy = g
    rt = cupy.cuda.runtime
    drv = rt.driverGetVersion()
    gpu = doc["gpu"] = {"driver": f"{drv // 1000}.{drv % 1000 // 10}",
                        "cupy": cupy.__version__, "devices": []}
    say(f"CUDA driver {gpu['driver']}, CuPy {gpu['cupy']}")
    say(f"NVRTC {doc['nvrtc']}" if doc["nvrtc"] else
        f"NVRTC not found ({nvrtc_error}): kernels cannot compile")
    from ._kernels.launch import pdl_supported

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
        return 0
    with _stdout_to_stderr():
        doc = _info(args, lambda line: None)
    _emit(doc)
    return 0


NOT_CHECKED_WITHOUT_GPU = ("the kernels' results (python -m hisparse_cupy check on a CUDA "
                           "machine compares every kernel with the oracle)")


def _check_cpu(why: str, seed: int, doc: dict) -> int:
    """``check`` without a device: every kernel compiled through NVRTC for sm_80 and sm_90,
    and the NumPy decode loop's bit-for-bit self-check over the oracle; says what it skipped.
    ``doc`` gets what ran, what did not and the error (``check --json``)."""
    from ._kernels.build import CompileError, compile_check
    from .demo._config import cpu_config
    from .demo._cpu import run

    oracle = "oracle: the NumPy decode loop's swaps and attention outputs (self-check)"
    doc.update(why=why, checked=[], not_checked=[oracle, NOT_CHECKED_WITHOUT_GPU])
    print(f"no CUDA device ({why}): checking what runs without one", flush=True)
    t0 = time.perf_counter()
    try:
        sizes = compile_check()
    except (ImportError, CompileError) as e:
        doc["checked"].append("compile: every kernel instance through NVRTC")
        doc["error"] = f"compile check FAILED: {e}"
        print(doc["error"])
        return 1
    files = sorted({f for f, _ in sizes})
    archs = sorted({a for _, a in sizes})
    doc["checked"].append(f"compile: every kernel instance of {len(files)} sources x "
                          f"{', '.join(archs)} through NVRTC with the runtime's options")
    doc.update(kernel_sources=files, archs=archs)
    print(f"compile check: {len(files)} kernel sources ({', '.join(files)}) x sm_80, sm_90 "
          f"compiled through NVRTC with the runtime's options ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    doc["checked"].append(doc["not_checked"].pop(0))
    run(cpu_config(["--steps", "6", "--warmup", "0", "--layers", "4", "--seed", str(seed),
                    "--quiet"]))
    print(f"oracle: the NumPy decode loop's swaps and attention outputs passed their self-check "
          f"({time.perf_counter() - t0:.1f} s)")
    print(f"not checked without a device: {NOT_CHECKED_WITHOUT_GPU}")
    return 0


def _check_gpu(seed: int, doc: dict) -> int:
    """``check`` on a device: :func:`hisparse_cupy.testing.selfcheck.run`, its lines printed as
    they come; ``doc`` gets the checks that ran and the failures' text (``check --json``)."""
    from .testing.selfcheck import run

    lines: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    doc.update(why=None, not_checked=[])
    try:
        ok = run(seed=seed, out=out)
    finally:  # the checks that ran ("  ok    label: ..." / "  FAIL  label: ...")
        doc["device"] = lines[0] if lines else None
        ran = [x[8:] for x in lines if x.startswith(("  ok    ", "  FAIL  "))]
        doc["checked"] = [x.split(":", 1)[0] for x in ran]
        failed = [x for x in lines if x.startswith("  FAIL  ")]
        if failed:
            doc["error"] = "\n".join(x[8:] for x in failed)
    return 0 if ok else 1


def cmd_check(args) -> int:
    g = cupy_or_why()
    doc: dict = {"ok": False, "gpu": not isinstance(g, str)}
    t0 = time.perf_counter()
    if not args.json:
        if isinstance(g, str):
            return _check_cpu(g, args.seed, doc)
        rc = _check_gpu(args.seed, doc)
        print(f"({time.perf_counter() - t0:.1f} s including compiles)")
        return rc
    with _stdout_to_stderr():
        try:
            rc = _check_cpu(g, args.seed, doc) if isinstance(g, str) else \
                _check_gpu(args.seed, doc)
        except Exception as e:  # the exit status of the traceback it would print
            print(traceback.format_exc(), end="")
            doc.setdefault("error", f"{type(e).__name__}: {e}")
            rc = 1
    doc.update(ok=rc == 0, seconds=round(time.perf_counter() - t0, 2))
    _emit(doc)
    return rc


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
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout instead of the text")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help="every kernel against the NumPy oracle on this GPU "
                                     "(without one: the compile check and the oracle's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout ({ok, gpu, checked, not_checked, seconds, "
                        "error}); the progress goes to stderr")
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
