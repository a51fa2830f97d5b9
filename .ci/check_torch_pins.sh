#!/usr/bin/env bash
# Installing .[cuda12] beside torch must leave torch's exact CUDA pins alone. Resolves metadata
# only (pip --dry-run: no large wheel is downloaded) and fails, saying which pin moved, when
#   A. resolving .[cuda12] together with torch's pins picks any other version of those wheels
#      or pulls in the cuda-toolkit meta-package, or
#   B. installing .[cuda12] into an environment that already holds torch and its pinned wheels
#      would replace one of them (pip does not re-resolve what is installed, so an exact pin
#      of ours, e.g. through cuda-toolkit[nvrtc,cudart]==12.*, silently breaks torch's).
# Run with the Python whose pip should resolve (CI: the .venv of .ci/run); PYTHON overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

# From the Requires-Dist of torch 2.10.0 on PyPI (torch-2.10.0-3-cp311-cp311-manylinux_2_28_x86_64,
# CUDA 12.8), the newest torch release whose default Linux wheel pins the -cu12 wheels by name;
# 2.11 and later depend on cuda-toolkit[...]==13.0.x instead.
TORCH=torch==2.10.0
PINS=(nvidia-cuda-nvrtc-cu12==12.8.93 nvidia-cuda-runtime-cu12==12.8.90)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Reads a pip --report and checks the pins; mode "exact": each pinned wheel is installed at its
# pin; mode "kept": a pinned wheel is either left as installed or installed at its pin.
verify() {
  "$PY" - "$@" <<'EOF'
import json
import re
import sys

mode, report, label, *pins = sys.argv[1:]


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


want = {canon(n): v for n, v in (p.split("==") for p in pins)}
got = {canon(i["metadata"]["name"]): i["metadata"]["version"]
       for i in json.load(open(report))["install"]}
bad = []
for name, ver in want.items():
    if mode == "exact" and got.get(name) != ver:
        bad.append(f"{name}: torch pins {ver}, resolver chose {got.get(name, 'nothing')}")
    if mode == "kept" and name in got and got[name] != ver:
        bad.append(f"{name}: torch pins {ver}, install would replace it with {got[name]}")
bad += [f"{n} {v} would be installed (exact-pinned meta-package)"
        for n, v in got.items() if n.startswith("cuda-toolkit")]
if bad:
    print(f"check_torch_pins FAILED ({label}):", *bad, sep="\n  ", file=sys.stderr)
    sys.exit(1)
print(f"check_torch_pins ok ({label}):", ", ".join(f"{n}=={got.get(n, want[n])}" for n in want))
EOF
}

# A. One resolve of .[cuda12] with torch's pins as requirements.
"$PY" -m pip install -q --dry-run --ignore-installed --report "$tmp/a.json" \
  -e '.[cuda12]' "${PINS[@]}" \
  || { echo "check_torch_pins FAILED: .[cuda12] cannot resolve with ${PINS[*]}" >&2; exit 1; }
verify exact "$tmp/a.json" "resolve with $TORCH's pins" "${PINS[@]}"

# B. Install into an environment holding torch and its pinned wheels. Only their metadata is
# needed for pip to see them installed, so the environment holds bare .dist-info folders.
"$PY" -m venv --without-pip "$tmp/env"
site=$("$tmp/env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dist() {  # name version [Requires-Dist ...]
  local d
  d="$site/$(echo "$1" | tr - _)-$2.dist-info"
  mkdir -p "$d"
  { printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$1" "$2"
    shift 2
    for r in "$@"; do printf 'Requires-Dist: %s\n' "$r"; done; } >"$d/METADATA"
  echo pip >"$d/INSTALLER"
  : >"$d/RECORD"
}
dist torch "${TORCH#torch==}" "${PINS[@]}"
for p in "${PINS[@]}"; do dist "${p%%==*}" "${p#*==}"; done
"$PY" -m pip --python "$tmp/env/bin/python" install -q --dry-run --report "$tmp/b.json" \
  -e '.[cuda12]' \
  || { echo "check_torch_pins FAILED: .[cuda12] does not resolve beside $TORCH" >&2; exit 1; }
verify kept "$tmp/b.json" "install beside $TORCH" "${PINS[@]}"
