#!/usr/bin/env bash
# The decode loop's figures (the sparse path: no device budget): GLM-5.2's 78-layer pattern,
# every mode eager and graph-captured,
# on the lru top-k streams (the default) and on the drift model at 1 % and 5 % new tokens per
# step, at the given batch:context pairs. One process per configuration (each pins its own
# host pool); JSON, PNG and logs under $OUT/demo_figures.
#
# --residency: instead, per BATCH:CONTEXT the lru streams graph-captured under four device
# budgets (docs/design.md section 10): none (every request sparse), every request resident
# (steps lean), every request resident with --no-lean, and half the batch resident.
#
# Usage: bash tools/demo_figures.sh [--warmup N] [--steps N] [--residency] BATCH:CONTEXT ...
#   e.g. bash tools/demo_figures.sh --warmup 100 --steps 300 32:8192 64:6272
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
dir="$OUT/demo_figures"
mkdir -p "$dir"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
warmup=100 steps=300 fail=0 residency=0
while [ $# -gt 0 ]; do
  case $1 in
    --warmup) warmup=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --residency) residency=1; shift ;;
    *) break ;;
  esac
done
run() {  # name, demo arguments...
  local name=$1 t0=$SECONDS rc
  shift
  $PY -m hisparse_cupy demo "$@" --warmup "$warmup" --steps "$steps" --quiet \
    --json "$dir/$name.json" >"$dir/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc ($((SECONDS - t0)) s)"
  grep -E "^device budget|^mode|^-----|^(gpu-only|offload|overlap|predict) " "$dir/$name.log"
  [ $rc = 0 ] || fail=1
}
if [ $residency = 1 ]; then
  for bc in "$@"; do
    b=${bc%%:*} ctx=${bc##*:}
    base=(--batch "$b" --context "$ctx" --graph)
    run "b${b}_ctx${ctx}_sparse" "${base[@]}" --device-budget 0
    run "b${b}_ctx${ctx}_resident" "${base[@]}" --resident-requests "$b"
    run "b${b}_ctx${ctx}_resident_nolean" "${base[@]}" --resident-requests "$b" --no-lean
    [ "$b" -gt 1 ] && run "b${b}_ctx${ctx}_half" "${base[@]}" --resident-requests $((b / 2))
  done
  exit $fail
fi
for bc in "$@"; do
  b=${bc%%:*} ctx=${bc##*:}
  for share in lru 0.01 0.05; do
    if [ $share = lru ]; then name="b${b}_ctx${ctx}_lru" topk=()
    else name="b${b}_ctx${ctx}_new${share}" topk=(--topk-model drift --new-share "$share"); fi
    t0=$SECONDS
    $PY -m hisparse_cupy demo --batch "$b" --context "$ctx" ${topk[@]+"${topk[@]}"} --device-budget 0 \
      --warmup "$warmup" --steps "$steps" --eager-and-graph --quiet \
      --json "$dir/$name.json" --png "$dir/$name.png" >"$dir/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc ($((SECONDS - t0)) s)"
    sed -n '/^mode/,$p' "$dir/$name.log"
    [ $rc = 0 ] || fail=1
  done
done
exit $fail
