"""Kernel build path: ``cu/*.cu`` -> ``cupy.RawModule`` with name expressions.

Every kernel of the package is a template instance in one of the ``cu/*.cu`` files. Op modules
declare the instances they use with :func:`register`; :func:`kernel` compiles the module of one
(file, instance) pair on first use, memoized per device, and returns its ``cupy.RawKernel``.
The compile options carry a digest of every ``.cu``/``.cuh`` source, so an edited header
changes CuPy's cache key and recompiles (CuPy's own key covers only the top-level source).

:func:`compile_check` compiles every registered instance through NVRTC for sm_80 and sm_90 with
``cuda.core`` and no GPU, so CPU-only CI catches a kernel that no longer compiles.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import cupy
import numpy as np

CU_DIR = Path(__file__).resolve().parent / "cu"

# file name -> ordered name expressions registered for it
_INSTANCES: dict[str, list[str]] = {}


# C++ spelling of the index dtypes kernels accept for req_indices / seq_lens
INDEX_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


def index_instances(template: str) -> dict[tuple[np.dtype, np.dtype], str]:
    """Name expressions of ``template`` for every (req_indices, seq_lens) dtype pair.

    ``template`` holds the fields ``{req}`` and ``{len}``, e.g.
    ``"hs::swap_resolve<1024, {req}, {len}>"``; keys are ``(req dtype, len dtype)``.
    """
    return {(r, s): template.format(req=rn, len=sn)
            for r, rn in INDEX_TYPES.items() for s, sn in INDEX_TYPES.items()}


def register(file: str, *name_expressions: str) -> None:
    """Declare template instances of ``cu/<file>`` that the package launches."""
    if not (CU_DIR / file).is_file():
        raise FileNotFoundError(f"no kernel source {CU_DIR / file}")
    names = _INSTANCES.setdefault(file, [])
    for n in name_expressions:
        if n not in names:
            names.append(n)


def instances() -> dict[str, tuple[str, ...]]:
    """All registered instances, by source file (after importing every op module)."""
    _import_ops()
    return {f: tuple(n) for f, n in _INSTANCES.items()}


def _import_ops() -> None:
    # The op modules register their instances at import time.
    from . import cache, plan, spec, swap  # noqa: F401


@functools.cache
def source_digest() -> str:
    """SHA-256 over every kernel source file (names and contents), hex."""
    h = hashlib.sha256()
    for p in sorted(CU_DIR.glob("*.cu*")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _options() -> tuple[str, ...]:
    return (
        "-std=c++17",
        f"-I{CU_DIR}",
        f"-DHS_SRC_DIGEST=0x{source_digest()[:16]}ull",
    )


@functools.cache
def _kernel(device_id: int, file: str, name_expression: str) -> cupy.RawKernel:
    src = (CU_DIR / file).read_text()
    mod = cupy.RawModule(code=src, options=_options(), name_expressions=(name_expression,))
    return mod.get_function(name_expression)


def kernel(file: str, name_expression: str) -> cupy.RawKernel:
    """The compiled kernel ``name_expression`` of ``cu/<file>`` on the current device.

    Compiled on first use (NVRTC, then CuPy's disk cache) and memoized per device and instance.
    """
    if name_expression not in _INSTANCES.get(file, ()):
        raise KeyError(f"{name_expression!r} is not a registered instance of {file}")
    return _kernel(cupy.cuda.runtime.getDevice(), file, name_expression)


def _include_paths() -> list[str]:
    """The -I list CuPy's RawModule compiles with (CCCL, CuPy and CUDA headers) plus cu/."""
    from cupy._core.core import assemble_cupy_compiler_options  # private, mirrors RawModule

    opts = assemble_cupy_compiler_options(tuple(o for o in _options() if o.startswith("-I")))
    return [o[2:] for o in opts if o.startswith("-I")]


def compile_check(archs: tuple[str, ...] = ("sm_80", "sm_90")) -> dict[tuple[str, str], int]:
    """Compile every registered instance with NVRTC for each arch, no GPU needed.

    Returns
    -------
    dict
        ``(file, arch) -> cubin size in bytes``. Raises the NVRTC error (with its log) on the
        first source that does not compile.
    """
    from cuda.core import Program, ProgramOptions

    inc = _include_paths()
    out = {}
    for file, names in instances().items():
        src = (CU_DIR / file).read_text()
        for arch in archs:
            po = ProgramOptions(
                name=str(CU_DIR / file),
                arch=arch,
                std="c++17",
                include_path=inc,
                ftz=True,
                device_as_default_execution_space=True,
                define_macro=[("HS_SRC_DIGEST", f"0x{source_digest()[:16]}ull")],
            )
            obj = Program(src, "c++", options=po).compile("cubin", name_expressions=names)
            out[(file, arch)] = len(obj.code)
    return out
