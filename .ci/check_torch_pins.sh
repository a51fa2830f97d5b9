#!/usr/bin/env bash
# Installing the CUDA extra that matches torch's CUDA (torch.version.cuda: 12.x -> .[cuda12],
# 13.x -> .[cuda13]) must leave torch's CUDA pins alone. Resolves metadata only (pip --dry-run:
# no large wheel is downloaded) and fails, saying which pin moved, when for either pair
#   A. resolving the extra together with torch's pins picks any other version of those wheels
#      or pulls in the cuda-toolkit meta-package, or
#   B. installing the extra into an environment that already holds torch and its pinned wheels
#      would replace one of them (pip does not re-resolve what is installed, so an exact pin
#      of ours, e.g. through cuda-toolkit[nvrtc,cudart]==12.*, silently breaks torch's).
# Run with the Python whose pip should resolve (CI: the .venv of .ci/run); PYTHON overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

# CUDA 12: from the Requires-Dist of torch 2.10.0 on PyPI (torch-2.10.0-3-cp311-cp311-manylinux_2_28_x86_64,
# CUDA 12.8), the newest torch release whose default Linux wheel pins the -cu12 wheels by name.
TORCH12=torch==2.10.0
PINS12=(nvidia-cuda-nvrtc-cu12==12.8.93 nvidia-cuda-runtime-cu12==12.8.90)
# CUDA 13: torch 2.14.1 (CUDA 13.0) depends on cuda-toolkit[...,nvrtc,cudart]==13.0.3, which pins
# nvidia-cuda-nvrtc==13.0.88.* and nvidia-cuda-runtime==13.0.96.*, and on cuda-bindings<14,>=13.0.3
# (13.5.0 was what pip installed beside it on 2026-12-01).
TORCH13=torch==2.14.1
PINS13=(nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 cuda-bindings==13.5.0)

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

check() {  # extra torch-spec pins...
  local extra=$1 torch=$2 env="$tmp/env-$1"
  shift 2
  local pins=("$@")
  # A. One resolve of the extra with torch's pins as requirements.
  "$PY" -m pip install -q --dry-run --ignore-installed --report "$tmp/a-$extra.json" \
    -e ".[$extra]" "${pins[@]}" \
    || { echo "check_torch_pins FAILED: .[$extra] cannot resolve with ${pins[*]}" >&2; exit 1; }
  verify exact "$tmp/a-$extra.json" ".[$extra] resolved with $torch's pins" "${pins[@]}"
  # B. Install into an environment holding torch and its pinned wheels. Only their metadata is
  # needed for pip to see them installed, so the environment holds bare .dist-info folders.
  "$PY" -m venv --without-pip "$env"
  site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  dist torch "${torch#torch==}" "${pins[@]}"
  for p in "${pins[@]}"; do dist "${p%%==*}" "${p#*==}"; done
  "$PY" -m pip --python "$env/bin/python" install -q --dry-run --report "$tmp/b-$extra.json" \
    -e ".[$extra]" \
    || { echo "check_torch_pins FAILED: .[$extra] does not resolve beside $torch" >&2; exit 1; }
  verify kept "$tmp/b-$extra.json" ".[$extra] installed beside $torch" "${pins[@]}"
}
dist() {  # name version [Requires-Dist ...], into $site
  local d
  d="$site/$(echo "$1" | tr - _)-$2.dist-info"
  mkdir -p "$d"
  { printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$1" "$2"
    shift 2
    for r in "$@"; do printf 'Requires-Dist: %s\n' "$r"; done; } >"$d/METADATA"
  echo pip >"$d/INSTALLER"
  : >"$d/RECORD"
}
check cuda12 "$TORCH12" "${PINS12[@]}"
check cuda13 "$TORCH13" "${PINS13[@]}"
