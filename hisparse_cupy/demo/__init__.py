"""The decode loop: the whole system end to end, and the command the README's quick start runs.

    python -m hisparse_cupy demo [--batch 32] [--context 8192] [--steps 200] [--eager] ...
    python examples/decode_loop.py ...            (the same)
    python -m hisparse_cupy demo --help           (every knob)

A synthetic sparse-attention model with realistic shapes (GLM-5.2's 78 layers and IndexCache
pattern, MLA rows of 576 values (GLM-5.2's 656-byte FP8 row, or bf16: ``--row``), 16 heads, K
2048, H 4096, the lightning indexer's cost on every full layer, an MLP stand-in sized by
``--model``: docs/design.md section 11) decodes a batch of long requests on top-k lists of a
published shape (:mod:`hisparse_cupy.demo._topk_model`, their measured shape printed;
``--topk-model drift`` for the older drifting lists) in four modes, one after another on the
same inputs:

- ``gpu-only``: every layer's KV resident on the GPU; the attention reads it directly;
- ``offload``: the full KV in pinned host memory, a hot buffer per request and layer on the GPU,
  every layer swapped in on the main stream (:class:`hisparse_cupy.HotBufferCache`);
- ``overlap``: the same with IndexCache overlap: shared layers replay their full layer's miss
  plan on a side stream while the main stream computes (:class:`hisparse_cupy.Prefetcher`);
- ``predict``: overlap, and the next full layer's likely misses staged on a side stream
  (``Prefetcher.set_predict``; single-step only);

each captured as one CUDA graph per step (``--eager``: a Python loop; ``--eager-and-graph``:
both), optionally on an SM partition (``--side-sms N``). It checks itself: the offloaded modes'
attention outputs (every step, every layer) must equal the GPU-only mode's bit for bit, or it
exits with status 1. It prints the memory a configuration needs before allocating, then a
table per run: step time (ITL) after the warm-up (mean, p50, p99), overhead over gpu-only,
share of the overhead hidden, hit rate, bytes moved per step and their rate, the Python time
of one swap call (eager), prediction's precision and recall, and the device counters;
``--json`` and ``--png`` write the results and an ITL-per-step plot.

``--sweep`` runs the load sweep instead (:mod:`hisparse_cupy.demo._sweep_run`): at one
context, concurrency 1 up to what the host memory holds, gpu-only, residency-managed and
always-sparse under one GPU budget, each offloaded run self-checked.

Without a CUDA device it runs the same algorithm on the NumPy reference backend, small, and
says so in its first line (:mod:`hisparse_cupy.demo._cpu`).

Building on the loop (``examples/tp_decode.py``, ``examples/pd_decode.py``): its flags
(:func:`parser`, :func:`from_args`, :func:`cpu_config`; a row's bytes: ``Config.row_bytes``),
the rig that owns its model, cache and indexer (:class:`Rig`, imported on first use), the
prompts' KV its model writes (:func:`prompt_kv` with the model's :class:`Kernels`;
:func:`kv_rows` on the NumPy backend) and the runs (:func:`run_gpu`, :func:`run_cpu`,
:func:`run_modes`).
"""

from __future__ import annotations

import sys
import time

from .._cli.usage import FAILED, OK, USAGE, UsageError
from .._device import cupy_or_why
from .._lazy import lazy
from ._args import cpu_config, from_args, parser
from ._config import Config, host_memory_bytes

# imported on first use (they need CuPy, or are the NumPy backend's)
_LAZY = {"Rig": "_loop", "prompt_kv": "_model", "Kernels": "_model", "kv_rows": "_cpu"}
__all__ = ["Config", "Kernels", "Rig", "cpu_config", "describe", "from_args",
           "kv_rows", "main", "parser", "partition", "prompt_kv", "report_results", "run_cpu",
           "run_gpu", "run_modes"]
__getattr__, _dir = lazy(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(_dir()) | set(__all__))


def describe(cfg: Config) -> str | None:
    """Print what runs and the memory it needs; returns why it cannot run here, or None."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    n_full = len(cfg.pattern_obj().full_layers)
    print(f"hisparse_cupy decode loop on {name}: {cfg.layers} layers ({n_full} full, "
          f"{cfg.layers - n_full} shared), batch {cfg.batch}, context {cfg.context}, K "
          f"{cfg.top_k}, H {cfg.hot}, rows of 576 values ({cfg.row}, {cfg.row_bytes} B), 16 "
          f"heads, top-k "
          + (f"drift ({100 * cfg.new_share:g}% new tokens per step)" if cfg.topk_model ==
             "drift" else "lru streams (demo.topk_model)")
          + (f", MTP {cfg.mtp} draft steps (multi-step swap)" if cfg.mtp > 1 else "")
          + f"; model {cfg.model} (hidden {cfg.hidden}), indexer "
          + ("on (64 heads x 128 dims over the whole context, every full layer)"
             if cfg.indexer else "off"))
    mem = cfg.memory()
    print(cfg.describe_memory(), flush=True)
    free, _ = cupy.cuda.runtime.memGetInfo()
    need_gpu = max(mem["gpu_resident"], mem["gpu_hot"]) + mem["gpu_model"] + mem["gpu_indexer"]
    if need_gpu > free:
        return (f"this configuration needs {need_gpu / 1e9:.1f} GB of GPU memory, "
                f"{free / 1e9:.1f} GB are free: lower --batch, --context or --layers")
    host = host_memory_bytes()
    if host and mem["host_pinned"] > 0.8 * host:
        return (f"{mem['host_pinned'] / 1e9:.1f} GB of pinned host memory is more than 80% of "
                f"this machine's {host / 1e9:.0f} GB: lower --batch, --context or --layers")
    return None


def partition(cfg: Config):
    """The SM partition the run uses (``--side-sms``), or None, and the line that says which
    and why."""
    if not cfg.side_sms:
        return None, ("SM partition: off: the side streams share the step's SMs; --side-sms 8 "
                      "to compare (benchmarks/NOTES.md, \"The demo on realistic top-k "
                      "streams\", has both measured)")
    from ..streams import SMPartition

    try:
        part = SMPartition(cfg.side_sms)
    except (RuntimeError, ValueError, ImportError) as e:
        raise UsageError(f"demo: --side-sms {cfg.side_sms}: {e}") from e
    return part, (f"SM partition (green contexts, --side-sms {cfg.side_sms}): side streams on "
                  f"{part.side_sms} SMs, the step on {part.main_sms} (the attention split and, "
                  f"with cuBLAS, the matmuls' SM target sized to them)")


def run_modes(cfg: Config, rig, log) -> list:
    """Every configured mode and exec kind on ``rig`` (a :class:`~.loop.Rig`), in order."""
    from .._kernels import launch

    log(f"model: {rig.model.gemm.kind}; attention split in {rig.model.nsplit} x "
        f"{rig.model.chunk} rows; PDL {'on' if launch.resolve_pdl(None) else 'off'}")
    results = []
    for mode in cfg.modes:
        for ex in cfg.execs:
            t1 = time.perf_counter()
            r = rig.run(mode, ex, None if cfg.quiet else log)
            log(f"{mode} {ex}: {cfg.total_steps} steps in {time.perf_counter() - t1:.1f} s, "
                f"mean step {r.step_ms.mean():.3f} ms")
            results.append(r)
    return results


def report_results(cfg: Config, results, extra: dict, title: str) -> int:
    """The table, the self-check, JSON and PNG; returns the exit status (1: check failed)."""
    from . import _report as report

    rows = report.summarize(cfg, results, len(cfg.pattern_obj().full_layers))
    print()
    print(f"step time after {cfg.warmup} warm-up steps, {cfg.steps} timed (CUDA events on the "
          f"main stream); overhead vs gpu-only of the same exec kind; hidden = share of the "
          f"offload overhead the overlap removes; GB/s = bytes moved per step / overhead; "
          f"swap us = Python time of one step.swap call (eager, measured on an idle stream)")
    print(report.table(rows))
    lines = report.predict_lines(rows)
    if lines:
        when = ("in its indexer's window" if cfg.predict_at == "indexer" else
                "while the current group computes")
        print(f"prediction (Prefetcher.predict_summary(), every step; the next full layer's "
              f"likely misses staged {when}, rule {cfg.predict_rule}):")
        print("\n".join(lines))
    lines = report.counter_lines(results)
    if lines:
        print("device counters (HotBufferCache.counters, read once per run; a shared layer a "
              "prefetcher replays runs no swap and counts nothing):")
        print("\n".join(lines))
    errors = report.self_check(results)
    extra = {**extra, "self_check": "passed" if not errors else errors}
    if cfg.json:
        report.write_json(cfg.json, cfg, rows, results, extra)
        print(f"json: {cfg.json}")
    if cfg.png:
        print(report.plot(cfg.png, cfg, results, title))
    if errors:
        print("SELF-CHECK FAILED:\n  " + "\n  ".join(errors))
        return FAILED
    print(f"self-check passed: every offloaded run's attention outputs ({cfg.total_steps} steps "
          f"x {cfg.layers} layers) are bit-identical to gpu-only")
    return OK


def run_gpu(cfg: Config, admission=None, pool=None) -> int:
    """Run every configured mode and exec kind; returns the exit status (1: self-check failed,
    2: the configuration does not fit). ``admission``: :class:`~.loop.Rig`'s; ``pool``: a host
    pool for the cache to page (:meth:`~.loop.Rig.paged_rows` rows; the caller closes it)."""
    import cupy

    from ._loop import Rig

    log = (lambda msg: None) if cfg.quiet else (lambda msg: print(msg, flush=True))
    why = describe(cfg)
    if why:
        print(f"demo: {why}", file=sys.stderr)
        return USAGE
    part, line = partition(cfg)
    print(line, flush=True)
    print(cfg.describe_resident(), flush=True)
    s = cupy.cuda.Stream(non_blocking=True) if part is None else part.stream("main")
    t0 = time.perf_counter()
    try:
        rig = Rig(cfg, s, log, partition=part, admission=admission, pool=pool,
                  paged=True if pool is not None else None)
        try:
            results = run_modes(cfg, rig, log)
        finally:
            rig.close()
    finally:
        if part is not None:
            part.close()
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    return report_results(
        cfg, results, {"device": name, "matmul": rig.model.gemm.kind, "partition": line,
                       "resident_layers": cfg.resident_layers,
                       "topk_shape": rig.topk_shape, "wall_s": time.perf_counter() - t0},
        f"{name}: {cfg.layers} layers, batch {cfg.batch}, context {cfg.context}, top-k "
        + (f"drift {100 * cfg.new_share:g}% new/step" if cfg.topk_model == "drift" else "lru"))


def run_cpu(argv=None, *, admit=None) -> dict:
    """The decode loop on the NumPy reference backend (no GPU): the configuration of ``argv``
    (the flags given, small values for the others; :class:`UsageError` naming a flag it cannot
    honour), run and self-checked (a mismatch raises); its results. ``admit``: how the
    prompts' KV gets into the pool (default: written locally; ``demo._cpu.admit_local``'s
    signature and duties)."""
    from ._cpu import admit_local, run

    return run(cpu_config(argv), admit=admit or admit_local)


def main(argv=None) -> int:
    """``python -m hisparse_cupy demo``: the GPU decode loop, or the NumPy backend without one."""
    g = cupy_or_why()
    if isinstance(g, str):
        cfg = cpu_config(argv)
        print(f"{g}: running the NumPy reference backend (hisparse_cupy.reference): "
              f"{cfg.layers} layers, {cfg.batch} requests, context {cfg.context}, K "
              f"{cfg.top_k}, H {cfg.hot}, {cfg.warmup} + {cfg.steps} steps (flags not given "
              f"take the small values `demo --help` lists)", flush=True)
        from ._cpu import run

        run(cfg)
        return OK
    cfg = from_args(argv)
    if cfg.warmup < 1:
        raise UsageError("demo: the GPU decode loop needs --warmup >= 1 (kernels compile, and "
                         "graphs are captured, after an eager step)")
    if cfg.sweep is not None:
        from ._sweep_run import run_sweep

        return run_sweep(cfg, **cfg.sweep)
    return run_gpu(cfg)


if __name__ == "__main__":
    sys.exit(main())
