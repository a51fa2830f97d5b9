#!/usr/bin/env bash
# Everything a CUDA box should run, in one command:
#   1. install the project without network (no deps: CuPy, cuda-bindings, pytest are there),
#      and any wheels carried in .whl/ (nixl-cu13 for tests/test_pd.py's GPU tests and
#      bench_pd.py: `bash tools/carry_nixl.sh` puts one small enough to carry there);
#   2. the whole test suite (CPU and GPU tests), then the randomized step test
#      (tests/_stepfuzz.py: --fuzz-steps decode steps through the step API, default 100000,
#      over --fuzz-procs processes sharing the GPU, every output byte checked), then
#      --fuzz-budget-seeds seeds (default 250, 150 steps each) with a device budget in every
#      configuration (residency's moves on unsynchronized streams: issue 60), JSON;
#   3. compute-sanitizer memcheck, racecheck and synccheck over tools/sanitize_*.py (small runs
#      of every kernel, residency's moves among them (sanitize_residency.py), built with HISPARSE_CUPY_DEBUG=1 so every shared-memory carve is checked
#      against the launch; zero errors required);
#   4. the quick benchmarks (benchmarks/bench_*.py --quick), JSON (+PNG) results;
#   5. python -m hisparse_cupy info (the measured ceilings); tools/host_overhead.py (host time
#      per eager call and per launch path), JSON;
#   6. the decode loop (python -m hisparse_cupy demo, default sizes, every mode eager and graph,
#      self-check) twice: the default device budget (auto: every request resident) and
#      --device-budget 0 (every request sparse); JSON + PNG in results; --demo=ARGS replaces its
#      arguments, --no-demo skips it; --sweep=CONTEXTS (e.g. 32768,131072): the load sweep at
#      each context (demo --sweep, 40 GB budget, 8192 hot slots, 30 + 30 steps: the README
#      headline's command; ~100 s each at 128k on an H200), JSON
#      + PNG in results; --sweep-args="ARGS" adds sweep flags to each (e.g. "--gpu-budget 24
#      --concurrency 4 --concurrency 8" on an 80 GB H100, "--sweep-offload predict", "--mtp 3");
#   7. --models=PROMPTS (e.g. 16384,32768): transformers' GLM-5 and DeepSeek-V3.2 decode through
#      the cache against their own decode (examples/transformers_decode.py: every request sparse,
#      then resident under a budget) and their indexers' top-k streams (benchmarks/
#      topk_stream.py) at each prompt length, JSON in results, logs in models.log;
#   8. with --peer DIR (a copy of the peer_sglang probe, e.g. .peer): SGLang's kernels beside
#      ours (bench_peer.py --quick, bench_peer_spec.py --quick; --peer-full: their full grids),
#      JSON.
# --shm-huge=GB (as root): mount a tmpfs of GB GB with huge=always and run everything with
# HISPARSE_CUPY_SHM_DIR set to it (shared pools on 2 MiB pages; the suite must pass there too).
# On a machine lent for 10 minutes a call, run it in two calls: --no-bench --no-demo
# --fuzz-steps=0 --fuzz-budget-seeds=0 (tests, sanitizers: ~7 min on an H200), then --no-tests --no-sanitize
# (the step fuzz, benchmarks, peer: ~4 min).
# Logs and results go under $OUT (default ./gpu_check_out): summary.txt, pytest.log,
# sanitize.log, bench.log, demo_budget_{auto,0}.log and results.tgz (benchmark and demo
# JSON/PNG). Exit status: non-zero if any
# step failed.
#
# Usage: bash tools/gpu_check.sh [--no-tests] [--no-sanitize] [--no-bench] [--full-bench]
#                                [--full=bench_NAME ...]   (that benchmark in full, others quick)
#                                [--peer=DIR] [--peer-full] [--tests=PYTEST_ARGS] [--no-demo]
#                                [--demo=ARGS] [--sweep=CONTEXTS] [--sweep-args=ARGS] [--fuzz-steps=N]
#                                [--fuzz-procs=N] [--fuzz-budget-seeds=N] [--shm-huge=GB]
#                                [--sanitize=swap,plan,...]   (those tools/sanitize_*.py only)
#                                [--models=PROMPTS]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT" "$OUT/results"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
tests=1 sanitize=1 bench=1 quick=--quick full_only= peer= peer_mode=--quick test_args=tests demo=1
demo_args="--steps 100 --warmup 20 --eager-and-graph" fuzz_steps=100000 fuzz_procs=12 shm_huge=
fuzz_budget_seeds=250
sanitize_only= sweeps= sweep_args= models=
for a in "$@"; do
  case $a in
    --no-tests) tests=0 ;; --no-sanitize) sanitize=0 ;; --no-bench) bench=0 ;;
    --sanitize=*) sanitize_only=${a#--sanitize=} ;;
    --full-bench) quick= ;;
    --full=*) full_only="$full_only ${a#--full=}" ;;
    --peer=*) peer=${a#--peer=} ;;
    --peer-full) peer_mode= ;;
    --tests=*) test_args=${a#--tests=} ;;
    --no-demo) demo=0 ;; --demo=*) demo_args=${a#--demo=} ;; --sweep=*) sweeps=${a#--sweep=} ;;
    --sweep-args=*) sweep_args=${a#--sweep-args=} ;;
    --fuzz-steps=*) fuzz_steps=${a#--fuzz-steps=} ;; --fuzz-procs=*) fuzz_procs=${a#--fuzz-procs=} ;;
    --fuzz-budget-seeds=*) fuzz_budget_seeds=${a#--fuzz-budget-seeds=} ;;
    --shm-huge=*) shm_huge=${a#--shm-huge=} ;;
    --models=*) models=${a#--models=} ;;
    *) echo "unknown option $a"; exit 2 ;;
  esac
done
fail=0
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"

$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || summary "pip install -e . failed (tests use PYTHONPATH)"
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried (e.g. nixl-cu13: tests/test_pd.py, bench_pd)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$OUT/install.log" 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH
  summary "carried wheels: $(cd .whl && ls *.whl | tr '\n' ' ')"
fi
summary "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
summary "$($PY -c 'import cupy, numpy, sys; print("python", sys.version.split()[0], "cupy", cupy.__version__, "numpy", numpy.__version__)' 2>&1)"
if [ -n "$shm_huge" ]; then  # shared pools on 2 MiB pages (needs root to mount)
  d=/tmp/hisparse-shm-huge
  mkdir -p "$d" && { mountpoint -q "$d" || mount -t tmpfs -o "huge=always,size=${shm_huge}g" tmpfs "$d"; } \
    && export HISPARSE_CUPY_SHM_DIR=$d || { summary "--shm-huge: could not mount a tmpfs at $d"; fail=1; }
  summary "$($PY -c 'from hisparse_cupy.host import shared_pools; print(shared_pools())' 2>&1)"
fi

if [ $tests = 1 ]; then
  t0=$SECONDS
  $PY -m pytest -q -rs -m "slow or not slow" $test_args >"$OUT/pytest.log" 2>&1  # (the slow CPU cases too)
  rc=$?
  summary "pytest rc=$rc ($((SECONDS - t0)) s): $(tail -n 1 "$OUT/pytest.log")"
  [ $rc = 0 ] || fail=1
fi

if [ "$fuzz_steps" -gt 0 ]; then
  t0=$SECONDS
  $PY tests/_stepfuzz.py --steps "$fuzz_steps" --procs "$fuzz_procs" --json "$OUT/fuzz.json" \
    >"$OUT/fuzz.log" 2>&1
  rc=$?
  summary "step fuzz rc=$rc ($((SECONDS - t0)) s): $(grep -m1 '^step fuzz' "$OUT/fuzz.log")"
  [ $rc = 0 ] || fail=1
fi
if [ "$fuzz_budget_seeds" -gt 0 ]; then
  t0=$SECONDS
  $PY tests/_stepfuzz.py --budget --steps $((fuzz_budget_seeds * 150)) --per-seed 150 \
    --seed 100000 --procs "$fuzz_procs" --json "$OUT/fuzz_budget.json" >"$OUT/fuzz_budget.log" 2>&1
  rc=$?
  summary "step fuzz, a budget in every config, rc=$rc ($((SECONDS - t0)) s): $(grep -m1 '^step fuzz' "$OUT/fuzz_budget.log")"
  [ $rc = 0 ] || fail=1
fi

if [ $sanitize = 1 ]; then
  : >"$OUT/sanitize.log"
  if ! command -v compute-sanitizer >/dev/null; then
    summary "compute-sanitizer not found"; fail=1
  else
    for s in tools/sanitize_*.py; do
      case ",$sanitize_only," in ",,"|*",$(basename "$s" .py | sed 's/^sanitize_//'),"*) ;; *) continue ;; esac
      for tool in memcheck racecheck synccheck; do
        t0=$SECONDS
        echo "=== $tool $s" >>"$OUT/sanitize.log"
        HISPARSE_CUPY_DEBUG=1 compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 --report-api-errors no \
          $PY "$s" >>"$OUT/sanitize.log" 2>&1
        rc=$?
        errs=$(tail -n 20 "$OUT/sanitize.log" | grep -Eo 'ERROR SUMMARY: [0-9]+ error' | tail -n 1)
        summary "sanitize $tool $(basename "$s") rc=$rc ($((SECONDS - t0)) s) ${errs:-no summary}"
        [ $rc = 0 ] || fail=1
      done
    done
  fi
fi

if [ $demo = 1 ]; then
  # twice: the default budget (auto: every request resident, steps lean) and no budget (every
  # request sparse: the hot-buffer path); --demo=ARGS comes last, so a budget it gives wins
  for budget in auto 0; do
    t0=$SECONDS
    name=demo_budget_$budget
    # shellcheck disable=SC2086
    $PY -m hisparse_cupy demo --device-budget $budget $demo_args --json "$OUT/results/$name.json" \
      --png "$OUT/results/$name.png" >"$OUT/$name.log" 2>&1
    rc=$?
    summary "demo --device-budget $budget $demo_args rc=$rc ($((SECONDS - t0)) s): $(grep -E 'self-check|SELF-CHECK' "$OUT/$name.log" | head -n 1)"
    [ $rc = 0 ] || fail=1
  done
fi

for ctx in ${sweeps//,/ }; do
  t0=$SECONDS
  # shellcheck disable=SC2086
  $PY -m hisparse_cupy demo --sweep --context "$ctx" --hot 8192 --warmup 30 --steps 30 $sweep_args \
    --json "$OUT/results/sweep_$ctx.json" --png "$OUT/results/sweep_$ctx.png" >"$OUT/sweep_$ctx.log" 2>&1
  rc=$?
  summary "demo --sweep --context $ctx $sweep_args rc=$rc ($((SECONDS - t0)) s): $(grep -E 'self-check|SELF-CHECK' "$OUT/sweep_$ctx.log" | head -n 1)"
  [ $rc = 0 ] || fail=1
done

[ -n "$models" ] && : >"$OUT/models.log"
for n in ${models//,/ }; do  # transformers' GLM-5 and DeepSeek-V3.2 through the cache (issue 61)
  for m in glm_moe_dsa deepseek_v32; do
    for budget in "" $((n + 256)); do  # every request sparse; resident under a budget
      t0=$SECONDS
      tag="${m}_${n}${budget:+_budget}"
      timeout "${BENCH_TIMEOUT:-900}" $PY examples/transformers_decode.py --model "$m" --prompt "$n" \
        ${budget:+--budget $budget} --json "$OUT/results/transformers_$tag.json" >>"$OUT/models.log" 2>&1
      rc=$?
      summary "transformers_decode $tag rc=$rc ($((SECONDS - t0)) s): $(grep 'tokens identical' "$OUT/models.log" | tail -n 1)"
      [ $rc = 0 ] || fail=1
    done
    t0=$SECONDS
    timeout "${BENCH_TIMEOUT:-900}" $PY benchmarks/topk_stream.py --model "$m" --prompt "$n" \
      --json "$OUT/results/topk_stream_${m}_$n.json" >>"$OUT/models.log" 2>&1
    rc=$?
    summary "topk_stream $m $n rc=$rc ($((SECONDS - t0)) s)"
    [ $rc = 0 ] || fail=1
  done
done

if [ $bench = 1 ]; then
  : >"$OUT/bench.log"
  for b in benchmarks/bench_*.py; do
    t0=$SECONDS
    mode=$quick
    case " $full_only " in *" $(basename "$b" .py) "*) mode= ;; esac
    case $(basename "$b") in bench_pd*.py)  # (bench_pd.py, bench_pd_churn.py)
      if ! $PY -c 'from hisparse_cupy.pd import nixl_api; nixl_api()' >/dev/null 2>&1; then
        summary "bench $(basename "$b") not run: NIXL is not installed (carry nixl-cu13 in .whl)"
        continue
      fi ;;
    esac
    echo "=== $b $mode" >>"$OUT/bench.log"
    timeout "${BENCH_TIMEOUT:-900}" $PY "$b" $mode --out "$OUT/results" >>"$OUT/bench.log" 2>&1
    rc=$?
    summary "bench $(basename "$b") ${mode:-full} rc=$rc ($((SECONDS - t0)) s)"
    [ $rc = 0 ] || fail=1
  done
fi
if [ -z "$(ls -A "$OUT/results")" ]; then rmdir "$OUT/results"
else tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"; fi
$PY -m hisparse_cupy info >"$OUT/info.log" 2>&1
summary "info rc=$?: $(grep -m1 'ceilings' "$OUT/info.log" | sed 's/^ *//')"

t0=$SECONDS
$PY tools/host_overhead.py --profile --json "$OUT/host_overhead.json" >"$OUT/host_overhead.log" 2>&1
rc=$?
summary "host_overhead rc=$rc ($((SECONDS - t0)) s)"
[ $rc = 0 ] || fail=1

if [ -n "$peer" ]; then
  # The peer probe calls 0.1's API for ours: swap_in(dry_run=) and set_pdl(True). A copy is
  # adapted to today's, same work: the dry chain runs under copy_probe(dry_run=True) on the
  # benchmark's stream, and PDL stays the default (on where supported, as set_pdl(True) set).
  adapted=$(mktemp -d) && cp -r "$peer"/. "$adapted"/
  sed -i -e 's/out=self.out, status=self.status, dry_run=dry, stream=self.stream)/out=self.out, status=self.status, stream=self.stream)/' \
    -e 's/^\( *\)rec\["ours_dry"\] = chain(/\1with copy_probe(dry_run=True, streams=[stream]): rec["ours_dry"] = chain(/' \
    -e 's/^from hisparse_cupy import HostKVPool, MissPlan, swap_in  # noqa: E402$/&\nfrom hisparse_cupy.testing.probe import copy_probe  # noqa: E402/' \
    "$adapted/bench_peer.py"
  sed -i -e 's/^from hisparse_cupy import HostKVPool, set_pdl  # noqa: E402$/from hisparse_cupy import HostKVPool  # noqa: E402/' \
    -e 's/^\( *\)set_pdl(True)$/\1pass  # PDL: the default where supported/' "$adapted/bench_peer_spec.py" \
    "$adapted/bench_peer.py"
  grep -q "dry_run=dry\|set_pdl" "$adapted"/bench_peer*.py && summary "peer: adapting the copy failed"
  peer=$adapted
  for b in bench_peer bench_peer_spec; do
    t0=$SECONDS
    HS_REPO=$PWD timeout "${BENCH_TIMEOUT:-900}" $PY "$peer/$b.py" $peer_mode --out "$OUT/peer" >"$OUT/$b.log" 2>&1
    rc=$?
    summary "peer $b ${peer_mode:-full} rc=$rc ($((SECONDS - t0)) s)"
    [ $rc = 0 ] || fail=1
  done
  [ -d "$OUT/peer" ] && tar -czf "$OUT/peer.tgz" -C "$OUT" peer && rm -rf "$OUT/peer"
fi
rm -f "$OUT/install.log"
summary "gpu_check: $([ $fail = 0 ] && echo OK || echo FAILED)"
exit $fail
