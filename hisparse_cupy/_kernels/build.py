"""Kernel build path: one ``cupy.RawModule`` per ``cu/*.cu``, holding every instance of it.

:data:`INSTANCES` is the static table of every template instance the package launches, by
source file: the ``cu/`` sources, and the demo's synthetic model (``demo/model.cu``, a source
with a folder in its key: that path from the package's folder), which is built, checked and
cached as they are. :func:`kernel` returns the ``cupy.RawKernel`` of one instance: the file's
RawModule is created on first use and CuPy compiles it lazily (NVRTC, then its disk cache) and
per device. The options (:func:`options`) carry a digest of every ``.cu``/``.cuh`` source, so an
edited header changes CuPy's cache key, and the ABI macros of :mod:`hisparse_cupy._abi`
(struct layouts, constants, shared-memory tables) that the kernels ``static_assert`` against.

:func:`compile_check` compiles every instance through NVRTC (``cuda.bindings.nvrtc``, no GPU)
with exactly these options plus the ones CuPy appends (``-ftz=true``,
``--device-as-default-execution-space``, ``-arch``), so CPU-only CI catches a kernel that no
longer compiles and any drift between a C++ parameter struct and its Python mirror. The
kernels include nothing outside ``cu/`` (fixed-width types come from NVRTC's builtins), so the
include paths CuPy adds do not change what compiles.

``HISPARSE_CUPY_DEBUG=1`` adds ``-DHS_DEBUG``: every shared-memory carve is checked against
the launch's dynamic shared memory (a trap on overrun). ``HISPARSE_CUPY_LINEINFO=1`` adds
``-lineinfo`` (source lines in Nsight Compute's source view; ``tools/profile_kernels.py``).
``HISPARSE_CUPY_PHASE_CLOCK=1`` adds ``-DHS_PHASE_CLOCK``: the kernels record the SM cycles from
their start to the end of each phase (a barrier is added at each mark; measuring only, see
:func:`phase_cycles` and ``tools/profile_kernels.py --phases``).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np

from .. import _abi
from .._log import log

PKG_DIR = Path(__file__).resolve().parents[1]
CU_DIR = PKG_DIR / "cu"

# C++ spelling of the index dtypes kernels accept for req_indices / seq_lens
INDEX_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


def index_instances(template: str) -> dict[tuple[np.dtype, np.dtype], str]:
    """Name expressions of ``template`` for every (req_indices, seq_lens) dtype pair.

    ``template`` holds the fields ``{req}`` and ``{len}``, e.g.
    ``"hs::swap_resolve<{req}, {len}>"``; keys are ``(req dtype, len dtype)``.
    """
    return {(r, s): template.format(req=rn, len=sn)
            for r, rn in INDEX_TYPES.items() for s, sn in INDEX_TYPES.items()}


# Every instance the package launches (the ops pick theirs from these tables).
# the resolve per block size: one block of RESOLVE_BLOCK threads per row, or a cluster of
# RESOLVE_CLUSTER_BLOCK-thread blocks
RESOLVE = {blk: index_instances(f"hs::swap_resolve<{{req}}, {{len}}, {blk}>")
           for blk in (_abi.RESOLVE_BLOCK, _abi.RESOLVE_CLUSTER_BLOCK)}
# the resolve that looks tokens up in a token -> slot table (SwapState.token_slot), one block a row
RESOLVE_TABLE = index_instances(f"hs::swap_resolve<{{req}}, {{len}}, {_abi.RESOLVE_BLOCK}, true>")
COPY_ROWS_PER_WARP = (1, 2, 4, 8)  # rows a warp of the host -> device copy keeps in flight
# host rows (int64) -> device rows, per rows per warp (cu/plan.cu; kernels.plan launches them),
# and the measuring instance of each (cu/plan_probe.cu; hisparse_cupy.testing.probe)
COPY_H2D = {r: f"hs::planned_copy<long long, int, {r}>" for r in COPY_ROWS_PER_WARP}
COPY_H2D_PROBE = {r: f"hs::planned_copy_probe<long long, int, {r}>" for r in COPY_ROWS_PER_WARP}
COPY_D2H = "hs::planned_copy<int, long long, 1>"  # device rows -> host rows (int64)
NEWEST = index_instances("hs::newest_rows<{req}, {len}>")
GATHER = index_instances("hs::ms::gather<{req}, {len}>")
COMMIT = index_instances("hs::ms::commit<{req}, {len}>")
MS_INIT = "hs::ms::init"
PREDICT = index_instances("hs::predict_stage<{req}, {len}>")
LAYER_SUMS = "hs::layer_sums"  # a transfer's per-layer checksum (hisparse_cupy._kernels.sums)
# the demo's synthetic model (hisparse_cupy.demo._model launches them): its kernels by name, and
# those that read or write KV rows once per row format, DEMO_ROWS[name][fp8]
DEMO_MODEL = "demo/model.cu"
DEMO = {n: f"demo::{n}" for n in (
    "topk_drift", "topk_table", "direct_locs", "embed", "weights", "attn_combine", "tally",
    "tick", "gemm_bf16", "index_fill", "index_query", "indexer")}
DEMO_ROWS = {n: {fp8: f"demo::{n}<{'true' if fp8 else 'false'}>" for fp8 in (False, True)}
             for n in ("kv_prefill", "kv_newest", "attn_partial")}

INSTANCES: dict[str, tuple[str, ...]] = {
    "swap.cu": (*(n for per in RESOLVE.values() for n in per.values()), *RESOLVE_TABLE.values()),
    "plan.cu": (*COPY_H2D.values(), COPY_D2H),
    "plan_probe.cu": tuple(COPY_H2D_PROBE.values()),  # measuring only: its own module
    "newest.cu": tuple(NEWEST.values()),
    "multistep.cu": (*GATHER.values(), *COMMIT.values(), MS_INIT),
    "predict.cu": tuple(PREDICT.values()),
    "sums.cu": (LAYER_SUMS,),
    DEMO_MODEL: (*DEMO.values(), *(n for per in DEMO_ROWS.values() for n in per.values())),
}
_FILE_OF = {n: f for f, names in INSTANCES.items() for n in names}


def source_path(file: str) -> Path:
    """Where the source ``file`` (a key of :data:`INSTANCES`) is: in ``cu/``, or, for a key
    with a folder (the demo's model), at that path from the package's folder."""
    return PKG_DIR / file if "/" in file else CU_DIR / file


def _source_files() -> list[Path]:
    """Every kernel source and header: ``cu/``'s, then the sources outside it."""
    return [*sorted(CU_DIR.glob("*.cu*")), *(PKG_DIR / f for f in INSTANCES if "/" in f)]


@functools.cache
def source_digest() -> str:
    """SHA-256 over every file of ``cu/`` (names and contents), hex: what a source can
    include. (CuPy's cache key holds the compiled source itself.)"""
    h = hashlib.sha256()
    for p in sorted(CU_DIR.glob("*.cu*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def debug() -> bool:
    return _flag("HISPARSE_CUPY_DEBUG")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "off")


def lineinfo() -> bool:
    return _flag("HISPARSE_CUPY_LINEINFO")


def phase_clock() -> bool:
    return _flag("HISPARSE_CUPY_PHASE_CLOCK")


PHASE_SLOTS = 32  # marks of the phase clock (HS_PHASE_SLOTS in the kernels)


def options() -> tuple[str, ...]:
    """The NVRTC options of every compile (runtime and :func:`compile_check`)."""
    return _options(source_digest(), debug(), lineinfo(), phase_clock(), tuple(_abi.defines()))


@functools.lru_cache(maxsize=8)
def _options(digest: str, dbg: bool, lines: bool, clock: bool,
             defines: tuple) -> tuple[str, ...]:
    return (
        "-std=c++20",  # designated initializers check the ABI (cu/abi.cuh)
        f"-I{CU_DIR}",
        f"-DHS_SRC_DIGEST=0x{digest[:16]}ull",
        *(f"-D{name}={value}" for name, value in defines),
        *(("-DHS_DEBUG",) if dbg else ()),
        *(("-lineinfo",) if lines else ()),
        *(("-DHS_PHASE_CLOCK", f"-DHS_PHASE_SLOTS={PHASE_SLOTS}") if clock else ()),
    )


_modules: dict[tuple[str, tuple[str, ...]], object] = {}
_kernels: dict[tuple[int, str], object] = {}


def kernel(name_expression: str):
    """The ``cupy.RawKernel`` of one instance (see :data:`INSTANCES`) on the current device."""
    import cupy

    file = _FILE_OF.get(name_expression)
    if file is None:
        raise KeyError(f"{name_expression!r} is not an instance of any kernel source "
                       f"(see hisparse_cupy._kernels.build.INSTANCES)")
    dev = cupy.cuda.runtime.getDevice()
    k = _kernels.get((dev, name_expression))
    if k is not None:
        return k
    opts = options()
    mod = _modules.get((file, opts))
    if mod is None:
        mod = _modules[(file, opts)] = cupy.RawModule(
            code=source_path(file).read_text(encoding="utf-8"), options=opts,
            name_expressions=INSTANCES[file])
    k = _kernels[(dev, name_expression)] = mod.get_function(name_expression)
    log.info("kernel %s of %s ready on device %d (NVRTC or CuPy's disk cache)",
             name_expression, file, dev)
    return k


def phase_cycles(file: str, reset: bool = True) -> np.ndarray:
    """The phase clock of ``file``'s module (built with ``HISPARSE_CUPY_PHASE_CLOCK=1``): uint64
    ``[PHASE_SLOTS]``, slot i = the most SM cycles any block took from its start to mark i
    (0 where no block reached it); ``reset`` zeroes it afterwards. The device must be idle."""
    import cupy

    if not phase_clock():
        raise RuntimeError("set HISPARSE_CUPY_PHASE_CLOCK=1 before the first kernel is built")
    mod = _modules.get((file, options()))
    if mod is None:
        raise KeyError(f"no kernel of {file} has been built yet")
    g = mod.get_global("hs_phase_clock")
    arr = cupy.ndarray((PHASE_SLOTS,), cupy.uint64, g)
    out = cupy.asnumpy(arr)
    if reset:
        arr.fill(0)
    return out


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message holds the file, arch and NVRTC's log."""


def check_options(arch: str) -> list[str]:
    """The runtime's options (:func:`options`), the ones CuPy appends, and ``arch``: what
    :func:`compile_check` compiles with."""
    return [*options(), "-ftz=true", "--device-as-default-execution-space", f"-arch={arch}"]


def _nvrtc_compile(file: str, names: tuple[str, ...], arch: str) -> int:
    return nvrtc_cubin_size(source_path(file), names, check_options(arch), f"{file} ({arch})")


def nvrtc_cubin_size(path: Path, names: tuple[str, ...], opts, what: str) -> int:
    """The size of :func:`nvrtc_cubin`'s cubin."""
    return len(nvrtc_cubin(path, names, opts, what))


def nvrtc_cubin(path: Path, names: tuple[str, ...], opts, what: str) -> bytes:
    """Compile the source at ``path`` with NVRTC (no GPU needed) with options ``opts``, every
    name expression of ``names`` instantiated; the cubin. :class:`CompileError` (named
    ``what``) with NVRTC's log if it does not compile."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - the cuda12/cuda13 extras bring it
        raise ImportError("compile_check() needs cuda-bindings and NVRTC: install the "
                          "package with its cuda12 or cuda13 extra") from e

    def ok(res):
        err = res[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC error {err} for {what}")
        return res[1:]

    (prog,) = ok(nvrtc.nvrtcCreateProgram(Path(path).read_bytes(), str(path).encode(), 0, [],
                                          []))
    try:
        for n in names:
            ok(nvrtc.nvrtcAddNameExpression(prog, n.encode()))
        enc = [o.encode() for o in opts]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(enc), enc)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            (size,) = ok(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            ok(nvrtc.nvrtcGetProgramLog(prog, log))
            raise CompileError(f"{what} does not compile:\n{log.decode(errors='replace')}")
        (size,) = ok(nvrtc.nvrtcGetCUBINSize(prog))
        for n in names:  # every instance was instantiated
            ok(nvrtc.nvrtcGetLoweredName(prog, n.encode()))
        cubin = b" " * int(size)
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin))
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_check(archs: tuple[str, ...] = ("sm_80", "sm_90"), progress=None,
                  files: tuple[str, ...] | None = None) -> dict[tuple[str, str], int]:
    """Compile every kernel instance (of ``files``, default every source) with NVRTC for each
    arch; no GPU needed.

    Needs ``cuda-bindings`` and the NVRTC library (both come with the ``cuda12`` / ``cuda13``
    extras). Uses exactly the runtime's options (:func:`options`) plus the ones CuPy appends.
    ``progress(done, total, file, arch, seconds)``, if given, is called as each source and arch
    finishes (from the compiling threads, one call at a time).

    Returns
    -------
    dict
        ``(file, arch) -> cubin size in bytes``. Raises :class:`CompileError` with NVRTC's log
        on the first source that does not compile.
    """
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    # the key reads the sources now (source_digest() is cached), so an edited file compiles anew
    h = hashlib.sha256()
    for p in _source_files():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    key = (h.hexdigest(), options())
    if files is not None and (unknown := sorted(set(files) - set(INSTANCES))):
        raise ValueError(f"files names {unknown}: not kernel sources (INSTANCES has "
                         f"{sorted(INSTANCES)})")
    jobs = [(file, names, arch) for file, names in INSTANCES.items() for arch in archs
            if files is None or file in files]
    lock, done = threading.Lock(), [0]

    def one(job) -> int:
        t0 = time.perf_counter()
        n = _compiled(key, *job)
        if progress is not None:
            with lock:
                done[0] += 1
                progress(done[0], len(jobs), job[0], job[2], time.perf_counter() - t0)
        return n

    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as ex:
        sizes = list(ex.map(one, jobs))  # in order: first error
    return {(file, arch): n for (file, _, arch), n in zip(jobs, sizes, strict=True)}


_COMPILED: dict[tuple, int] = {}  # (sources' digest, options, file, names, arch) -> cubin size


def compile_cache_dir() -> Path | None:
    """Where :func:`compile_check` keeps what compiled, across processes:
    ``$HISPARSE_CUPY_COMPILE_CACHE`` (``0``: nowhere), else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, ``hisparse_cupy/nvrtc``."""
    env = os.environ.get("HISPARSE_CUPY_COMPILE_CACHE")
    if env == "0":
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hisparse_cupy" / "nvrtc"


def _compiled(key: tuple, file: str, names: tuple[str, ...], arch: str) -> int:
    """:func:`_nvrtc_compile`, once per process for the same sources and options, and once
    per machine: a compile that succeeded is recorded in :func:`compile_cache_dir` under a
    digest of every source, the options, the instances, the arch and NVRTC's version (a
    source edited, another NVRTC: compiled anew), and two processes that want the same one
    take turns (a lock file), so the second reads what the first wrote. A failed compile is
    never recorded."""
    full = (*key, file, names, arch)
    n = _COMPILED.get(full)
    if n is None:
        n = _COMPILED[full] = _disk_cached(full, lambda: _nvrtc_compile(file, names, arch))
    return n


def _disk_cached(full: tuple, compile_one) -> int:
    d = compile_cache_dir()
    try:
        from cuda.bindings import nvrtc

        version = nvrtc.nvrtcVersion()[1:]
    except ImportError:  # (compile_one raises the error that names the missing package)
        d = None
    try:
        import fcntl
    except ImportError:  # (no POSIX file locks: compile, record nothing)
        d = None
    if d is None:
        return compile_one()
    name = hashlib.sha256(repr((full, version)).encode()).hexdigest()[:32]
    try:
        d.mkdir(parents=True, exist_ok=True)
        lock = open(d / f"{name}.lock", "w")  # noqa: SIM115 (held across the compile)
    except OSError:  # an unwritable cache: compile, record nothing
        return compile_one()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = d / f"{name}.size"
        if done.is_file():
            return int(done.read_text())
        n = compile_one()
        tmp = d / f"{name}.{os.getpid()}.tmp"
        tmp.write_text(str(n))
        tmp.replace(done)
        return n
