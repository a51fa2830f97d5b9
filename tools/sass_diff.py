"""Whether a kernel source change leaves the machine code alone, without a GPU.

    python tools/sass_diff.py [--rev REV] [--arch sm_90 --arch sm_80] [--nvdisasm PATH]
                              [FILE.cu ...]

Compiles every kernel instance of each kernel source (``build.INSTANCES``: ``hisparse_cupy/cu``'s,
and the demo's ``demo/model.cu``; default: the sources that differ from ``REV``, default
``HEAD``) twice with NVRTC, as ``REV`` has it and as the working
tree has it, with the same options (``build.check_options``: the ABI defines of this tree,
the same source digest for both), disassembles both cubins with ``nvdisasm`` and compares them
kernel by kernel, instruction by instruction (addresses and label numbers left out). A
refactor whose every kernel prints ``same`` runs the same instructions: its timings cannot
move. Exit status 0: every kernel the same; 1: some differ (each named with the number of
differing lines); 2: cannot compare (``_abi.py`` differs from ``REV``: the defines would differ
too; no nvdisasm).

``nvdisasm`` comes with a CUDA toolkit or the ``nvidia-cuda-nvdisasm`` wheel
(``pip install nvidia-cuda-nvdisasm``); ``--nvdisasm``, ``$NVDISASM``, ``PATH`` and that wheel
are looked in, in that order.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hisparse_cupy._kernels import build  # noqa: E402


def find_nvdisasm(given: str | None) -> str | None:
    for c in (given, os.environ.get("NVDISASM"), shutil.which("nvdisasm")):
        if c and Path(c).is_file():
            return c
    try:
        import nvidia  # the nvidia-cuda-nvdisasm wheel: nvidia/cu*/bin/nvdisasm
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for p in sorted(Path(base).glob("*/bin/nvdisasm")):
            return str(p)
    return None


def _outside_cu() -> list[str]:
    """The kernel sources outside ``cu/`` (the demo's model), as paths in the repository."""
    return [f"hisparse_cupy/{f}" for f in build.INSTANCES if "/" in f]


def sources_at(rev: str, into: Path) -> Path:
    """``hisparse_cupy/cu`` and the sources outside it as ``rev`` has them, extracted under
    ``into``; the package folder they are in."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "hisparse_cupy/cu",
                          *_outside_cu()], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return into / "hisparse_cupy"


def kernels(sass: str) -> dict[str, list[str]]:
    """Each function's instructions in ``nvdisasm -c`` output, addresses and label numbers
    normalised away."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\S+?),", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is not None:
            line = re.sub(r"/\*[0-9a-f]+\*/", "", line)
            line = re.sub(r"\.L_x_\d+", ".L", line).strip()
            if line:
                cur.append(line)
    return out


def disassemble(nvdisasm: str, cubin: bytes, tmp: Path) -> dict[str, list[str]]:
    path = tmp / "k.cubin"
    path.write_bytes(cubin)
    res = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvdisasm failed: {res.stderr.strip()}")
    return kernels(res.stdout)


def changed_sources(rev: str) -> list[str]:
    names = subprocess.run(["git", "-C", str(ROOT), "diff", "--name-only", rev, "--",
                            "hisparse_cupy/cu", *_outside_cu()], check=True,
                           capture_output=True, text=True).stdout.split()
    # the keys of build.INSTANCES: a cu/ file by its name, another by its path in the package
    touched = {n.removeprefix("hisparse_cupy/cu/").removeprefix("hisparse_cupy/") for n in names}
    if any(not n.endswith(".cu") for n in touched):  # a header: every source includes it
        return sorted(build.INSTANCES)
    return sorted(touched & set(build.INSTANCES))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="kernel sources (default: those changed since "
                                             "--rev)")
    ap.add_argument("--rev", default="HEAD", help="the revision to compare with (default HEAD)")
    ap.add_argument("--arch", action="append", help="sm_90 and sm_80 unless given")
    ap.add_argument("--nvdisasm", help="the nvdisasm to use")
    a = ap.parse_args(argv)
    nvdisasm = find_nvdisasm(a.nvdisasm)
    if nvdisasm is None:
        print("sass_diff: no nvdisasm (--nvdisasm, $NVDISASM, PATH or pip install "
              "nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    files = a.files or changed_sources(a.rev)
    unknown = sorted(set(files) - set(build.INSTANCES))
    if unknown:
        print(f"sass_diff: not kernel sources: {unknown} (known: {sorted(build.INSTANCES)})",
              file=sys.stderr)
        return 2
    if subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", a.rev, "--",
                       "hisparse_cupy/_abi.py"]).returncode:
        print(f"sass_diff: hisparse_cupy/_abi.py differs from {a.rev}: the kernels' defines "
              f"differ too, so their code is not comparable this way", file=sys.stderr)
        return 2
    if not files:
        print(f"sass_diff: no kernel source differs from {a.rev}")
        return 0
    differ = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        old_pkg = sources_at(a.rev, tmp / "rev")
        for arch in a.arch or ["sm_90", "sm_80"]:
            opts = build.check_options(arch)
            old_opts = [o.replace(str(build.CU_DIR), str(old_pkg / "cu")) for o in opts]
            for f in files:
                names = build.INSTANCES[f]
                old_path = old_pkg / f if "/" in f else old_pkg / "cu" / f
                old = disassemble(nvdisasm, build.nvrtc_cubin(old_path, names, old_opts,
                                                              f"{f} at {a.rev}"), tmp)
                new = disassemble(nvdisasm, build.nvrtc_cubin(build.source_path(f), names,
                                                              opts, f), tmp)
                for k in sorted(set(old) | set(new)):
                    x, y = old.get(k), new.get(k)
                    if x == y:
                        print(f"same     {arch} {f} {k} ({len(x)} lines)")
                        continue
                    differ += 1
                    if x is None or y is None:
                        print(f"DIFFERS  {arch} {f} {k}: only {'now' if x is None else a.rev}")
                        continue
                    n = sum(1 for ln in difflib.unified_diff(x, y, n=0)
                            if ln[:1] in "+-" and ln[:3] not in ("+++", "---"))
                    print(f"DIFFERS  {arch} {f} {k}: {n} lines ({len(x)} -> {len(y)})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
