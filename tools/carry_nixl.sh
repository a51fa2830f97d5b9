#!/usr/bin/env bash
# Put a NIXL wheel for the lent GPU machine (Python 3.12, CUDA 13) into .whl/ (git-ignored),
# small enough to travel with the working tree (the device tool sends 64 MiB at most, the tree
# included): nixl-cu13 without its expert-parallel torch extensions (nixl_ep_cu13/: three
# ~31 MB libraries that hisparse_cupy.pd never imports), its RECORD rewritten to match
# (~31 MB instead of ~59 MB for 1.5.1). tools/gpu_check.sh installs whatever .whl/ holds, so
# tests/test_pd.py's GPU tests and benchmarks/bench_pd.py run there; carry ".whl" in the call.
#
# Usage: bash tools/carry_nixl.sh [VERSION]   (default 1.5.1; needs pip and the network here)
set -eu
cd "$(dirname "$0")/.."
version=${1:-1.5.1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d "$tmp" "nixl-cu13==$version"
mkdir -p .whl
python3 - "$tmp" .whl <<'PY'
import os
import sys
import zipfile

src_dir, out_dir = sys.argv[1], sys.argv[2]
drop = ("nixl_ep_cu13/",)
for name in os.listdir(src_dir):
    if not name.endswith(".whl"):
        continue
    src, dst = os.path.join(src_dir, name), os.path.join(out_dir, name)
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if info.filename.startswith(drop):
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [ln for ln in data.decode().splitlines() if not ln.startswith(drop)]
                data = ("\n".join(kept) + "\n").encode()
            zo.writestr(info, data)
    with zipfile.ZipFile(dst) as z:
        bad = z.testzip()
    if bad is not None:
        sys.exit(f"carry_nixl: {dst}: {bad} is corrupt")
    print(f"{dst}: {os.path.getsize(dst) / 1e6:.1f} MB")
PY
