"""The command line: ``python -m hisparse_cupy COMMAND``.

- ``info``: versions; CuPy, NVRTC and the driver, each on its own line; devices, PDL, the
  host -> device ceilings for a row size measured on this GPU (a ``cudaMemcpyAsync`` and a
  zero-copy gather of random rows), and the rate at which this machine sets up a (2 GB) host
  pool (:mod:`hisparse_cupy._cli._info`);
- ``check``: every kernel against the NumPy oracle on this GPU
  (:mod:`hisparse_cupy.testing.selfcheck`); without one, every kernel compiled through NVRTC
  (a line as each finishes) and the NumPy decode loop's self-check; for people who installed a
  wheel and have no test suite at hand;
- ``demo``: the decode loop (:mod:`hisparse_cupy.demo`; the NumPy oracle without a GPU);
- ``bench``: the benchmark scripts of a source checkout (``benchmarks/bench_*.py``, listed by
  ``bench --help``), JSON and plots collected in one folder.

``info --json`` and ``check --json`` print one JSON object on stdout instead of the text (what
``check`` prints as it goes moves to stderr); the exit status is the same. Output paths
(``demo --json`` and ``--png``, ``bench --out``) are checked before any work starts.

Exit statuses, the same for every command (:mod:`hisparse_cupy._cli.usage`):

- 0: success;
- 1: a check, the demo's self-check or a benchmark ran and failed;
- 2: usage error: an unknown option or command, a bad value or output path, a configuration
  that does not fit this machine (the message, on stderr, names the option);
- 3: this machine or installation lacks what the command needs (``bench`` without a GPU or
  outside a source checkout);
- 141: stdout was closed early (e.g. piped into ``head``): the command stops quietly, with the
  status a shell gives a program that SIGPIPE ended (``--help`` exits 0 there: argparse drops
  its own write error).
"""

from __future__ import annotations

import argparse
import ast
import functools
import os
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

from .. import __version__
from .._device import cupy_or_why
from .usage import (
    BROKEN_PIPE,
    EXIT_STATUSES,
    FAILED,
    OK,
    UNAVAILABLE,
    USAGE,
    UsageError,
    emit,
    output_dir,
    stdout_to_stderr,
)

__all__ = ["main"]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"  # in a source checkout only
COMMANDS = {"info": "versions, CuPy, NVRTC, driver, devices, PDL, measured link ceilings",
            "check": "every kernel against the NumPy oracle on this GPU (without one: every "
                     "kernel compiled, and the oracle's self-check)",
            "demo": "the decode loop (the NumPy oracle without a GPU); demo --help lists its "
                    "options",
            "bench": "the benchmark scripts of a source checkout (bench --help lists them)"}
NOT_CHECKED_WITHOUT_GPU = ("the kernels' results (python -m hisparse_cupy check on a CUDA "
                           "machine compares every kernel with the oracle)")


def _check_cpu(why: str, seed: int, doc: dict) -> int:
    """``check`` without a device: every kernel compiled through NVRTC for sm_80 and sm_90,
    and the NumPy decode loop's bit-for-bit self-check over the oracle; says what it skipped.
    ``doc`` gets what ran, what did not and the error (``check --json``)."""
    from .._kernels.build import CompileError, compile_check
    from ..demo import run_cpu

    oracle = "oracle: the NumPy decode loop's swaps and attention outputs (self-check)"
    doc.update(why=why, checked=[], not_checked=[oracle, NOT_CHECKED_WITHOUT_GPU])
    print(f"no CUDA device ({why}): checking what runs without one", flush=True)
    print(f"compiling every kernel instance through NVRTC for sm_80 and sm_90 on "
          f"{os.cpu_count()} threads (about a minute of CPU time; a line as each source "
          f"finishes)", flush=True)
    t0 = time.perf_counter()

    def progress(done: int, total: int, file: str, arch: str, seconds: float) -> None:
        print(f"  [{done}/{total}] {file} {arch} ({seconds:.1f} s)", flush=True)

    try:
        sizes = compile_check(progress=progress)
    except (ImportError, CompileError) as e:
        doc["checked"].append("compile: every kernel instance through NVRTC")
        doc["error"] = f"compile check FAILED: {e}"
        print(doc["error"])
        return FAILED
    files = sorted({f for f, _ in sizes})
    archs = sorted({a for _, a in sizes})
    doc["checked"].append(f"compile: every kernel instance of {len(files)} sources x "
                          f"{', '.join(archs)} through NVRTC with the runtime's options")
    doc.update(kernel_sources=files, archs=archs)
    print(f"compile check: {len(files)} kernel sources ({', '.join(files)}) x sm_80, sm_90 "
          f"compiled through NVRTC with the runtime's options ({time.perf_counter() - t0:.1f} s)")
    t0 = time.perf_counter()
    doc["checked"].append(doc["not_checked"].pop(0))
    run_cpu(["--steps", "6", "--warmup", "0", "--layers", "4", "--seed", str(seed), "--quiet"])
    print(f"oracle: the NumPy decode loop's swaps and attention outputs passed their self-check "
          f"({time.perf_counter() - t0:.1f} s)")
    print(f"not checked without a device: {NOT_CHECKED_WITHOUT_GPU}")
    return OK


def _check_gpu(seed: int, doc: dict) -> int:
    """``check`` on a device: :func:`hisparse_cupy.testing.selfcheck.run`, its lines printed as
    they come; ``doc`` gets the checks that ran and the failures' text (``check --json``)."""
    from ..testing.selfcheck import run

    lines: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    doc.update(why=None, not_checked=[])
    print("the kernels compile through NVRTC as each check first uses them (CuPy caches them "
          "on disk): the first run's checks take longest", flush=True)
    try:
        ok = run(seed=seed, out=out)
    finally:  # the checks that ran ("  ok    label: ..." / "  FAIL  label: ...")
        doc["device"] = lines[0] if lines else None
        ran = [x[8:] for x in lines if x.startswith(("  ok    ", "  FAIL  "))]
        doc["checked"] = [x.split(":", 1)[0] for x in ran]
        failed = [x for x in lines if x.startswith("  FAIL  ")]
        if failed:
            doc["error"] = "\n".join(x[8:] for x in failed)
    return OK if ok else FAILED


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
    with stdout_to_stderr():
        try:
            rc = _check_cpu(g, args.seed, doc) if isinstance(g, str) else \
                _check_gpu(args.seed, doc)
        except Exception as e:  # the exit status of the traceback it would print
            print(traceback.format_exc(), end="")
            doc.setdefault("error", f"{type(e).__name__}: {e}")
            rc = FAILED
    doc.update(ok=rc == OK, seconds=round(time.perf_counter() - t0, 2))
    emit(doc)
    return rc


def cmd_demo(args) -> int:
    from ..demo import main

    return main(args.rest)


def benchmarks() -> dict[str, str]:
    """The checkout's benchmarks, ``name -> the first sentence of its docstring`` (read, not
    imported, once a folder); empty outside a source checkout."""
    return _read_benchmarks(BENCHMARKS)


@functools.lru_cache(maxsize=4)
def _read_benchmarks(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        out[p.stem[len("bench_"):]] = first.split(". ")[0].rstrip(".")
    return out


def _bench_epilog() -> str:
    have = benchmarks()
    if not have:
        return (f"No benchmarks here: they ship with the source repository, not with the "
                f"package ({BENCHMARKS} does not exist). bench needs a checkout: clone the "
                f"repository and run `python -m hisparse_cupy bench` from it.\n\n"
                f"{EXIT_STATUSES}")
    width = max(map(len, have))
    lines = [f"  {name:<{width}}  " + textwrap.shorten(line, 96 - width)
             for name, line in have.items()]
    return (f"benchmarks (NAME or bench_NAME; each needs a CUDA device; {BENCHMARKS}):\n"
            + "\n".join(lines) + f"\n\n{EXIT_STATUSES}")


def cmd_bench(args) -> int:
    have = benchmarks()
    if not have:
        print("bench: the benchmarks ship with the source repository, not with the package: "
              "clone it and run `python -m hisparse_cupy bench` from the checkout",
              file=sys.stderr)
        return UNAVAILABLE
    names = [n[len("bench_"):] if n.startswith("bench_") else n for n in args.names]
    unknown = [n for n in names if n not in have]
    if unknown:
        raise UsageError(f"bench: no benchmark named {', '.join(unknown)}; have: "
                         f"{', '.join(have)}")
    output_dir("bench", "--out", args.out)
    g = cupy_or_why()
    if isinstance(g, str):  # before any script runs or any folder is made
        print(f"bench needs a CUDA device: {g}", file=sys.stderr)
        return UNAVAILABLE
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scripts = [BENCHMARKS / f"bench_{n}.py" for n in (names or have)]
    failed = []
    for i, p in enumerate(scripts, 1):
        cmd = [sys.executable, str(p), "--out", str(out)] + ([] if args.full else ["--quick"])
        print(f"[{i}/{len(scripts)}] {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        r = subprocess.run(cmd)
        print(f"[{i}/{len(scripts)}] {p.stem}: rc={r.returncode} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if r.returncode:
            failed.append(p.stem)
    print(f"results (JSON, PNG): {out}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return FAILED if failed else OK


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


def _parser(bench: bool = True) -> argparse.ArgumentParser:
    """The command line; ``bench``: with the bench command's list of benchmarks (read from
    every script of the checkout, so only when that command is asked for)."""
    from .. import _checks

    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        prog="python -m hisparse_cupy", formatter_class=raw,
        description="hierarchical sparse KV caching: CUDA kernels through CuPy",
        epilog=f"`python -m hisparse_cupy COMMAND --help` gives a command's options.\n\n"
               f"{EXIT_STATUSES}")
    ap.add_argument("--version", action="version", version=f"hisparse_cupy {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    p = sub.add_parser("info", help=COMMANDS["info"], epilog=EXIT_STATUSES, formatter_class=raw)
    p.add_argument("--row-bytes", type=_arg(_checks.row_bytes, "--row-bytes"), default=656,
                   help="row size of the ceilings (a positive multiple of 16)")
    p.add_argument("--device", type=_arg(lambda n, v: _checks.integer(n, v, 0), "--device"),
                   default=0, help="device whose ceilings to measure")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout instead of the text")
    from ._info import cmd_info

    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("check", help=COMMANDS["check"], epilog=EXIT_STATUSES,
                       formatter_class=raw)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout ({ok, gpu, checked, not_checked, seconds, "
                        "error}); the progress goes to stderr")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("demo", help=COMMANDS["demo"], add_help=False)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("bench", help=COMMANDS["bench"],
                       epilog=_bench_epilog() if bench else EXIT_STATUSES,
                       formatter_class=raw)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="benchmarks to run (default: all), e.g. swap spec")
    p.add_argument("--full", action="store_true", help="full grids (default: --quick)")
    p.add_argument("--out", default="bench_results", help="folder for JSON and plots "
                                                          "(default: bench_results)")
    p.set_defaults(fn=cmd_bench)
    return ap


def _run(argv) -> int:
    ap = _parser(bench="bench" in (sys.argv[1:] if argv is None else argv))
    args, rest = ap.parse_known_args(argv)
    if args.cmd is None:  # (argparse would say "the following arguments are required")
        bad = [a for a in rest if a.startswith("-")]
        ap.error((f"unknown option {bad[0]}" if bad else "no command given") +
                 f"; commands: {', '.join(COMMANDS)} (python -m hisparse_cupy --help says "
                 f"what each does)")
    if args.cmd == "demo":
        args.rest = rest
    elif rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.fn(args)


def main(argv=None) -> int:
    """``python -m hisparse_cupy``: the command's exit status (the module's docstring lists
    them): a usage error's message on stderr and 2; stdout closed early (``| head``): quietly
    141."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # (the last buffered lines: a closed pipe raises here)
    except UsageError as e:
        print(e, file=sys.stderr)
        return USAGE
    except BrokenPipeError:
        # whatever is still buffered would fail again at exit: stdout goes to devnull
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE
