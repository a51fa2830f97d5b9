"""The load sweep on the GPU: ``python -m hisparse_cupy demo --sweep --context N``.

At one context, each concurrency ``n`` of :func:`._sweep.concurrencies` (or ``--concurrency``)
runs, steps graphed, on the same ``n`` requests (the same top-k streams, the same KV):

- ``gpu-only``: every layer's KV and the indexer's key cache on the GPU. Run at every ``n``,
  inside the budget or not (``fits``: whether its bytes fit ``--gpu-budget``; outside it the
  row is the reference of the self-check and the TPOT at the same batch, marked as such);
- ``resident``: the residency-managed cache (IndexCache overlap on; with ``--sweep-offload
  predict``, prediction too, as in ``sparse``): ``k`` requests
  resident, the largest ``k`` whose pages and a hot buffer for each other request fit what
  ``--gpu-budget`` leaves after the indexer's key cache and the resident layers
  (:func:`._sweep.plan`), the others sparse, with a device budget of exactly those rows
  (``--resident-requests k``: the requests' lengths do not change, so nothing promotes);
  all resident, the steps run lean;
- ``sparse``: every request sparse (no device budget: a hot buffer each), overlap on; and
  ``sparse-no-overlap`` (the plain offload), from which the sparse row's hidden share comes.

Each row carries its cost under pressure: gpu-only's TPOT at the same ``n`` beside its own
(:func:`against_gpu_only`). ``--mtp S`` runs every mode with S draft steps a step (the
multi-step swap; TPOT is the step's time, acceptance is not modelled).

Every offloaded run's attention outputs must equal gpu-only's bit for bit (its self-check);
the exit status is 1 if one does not. One pinned host pool, sized for the largest ``n``, serves
every run. Rows and their JSON: :func:`row`, :func:`document`; docs/design.md section 11.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from . import _sweep
from ._config import GB, Config

# the configuration's fields each run sets itself (left out of the JSON's "config")
_PER_RUN = ("json", "png", "sweep", "batch", "modes", "execs", "device_budget",
            "resident_requests", "lean")


def runs(offload: str = "overlap") -> tuple:
    """The sweep's runs, ``(row mode, demo mode, device budget: "managed" or None)``; the
    managed and all-sparse rows run the demo's ``offload`` mode (``"overlap"`` or
    ``"predict"``), the plain offload beside them gives the sparse row's hidden share."""
    if offload not in ("overlap", "predict"):
        raise ValueError(f"offload must be 'overlap' or 'predict', got {offload!r}")
    return (("gpu-only", "gpu-only", None), ("resident", offload, "managed"),
            ("sparse-no-overlap", "offload", None), ("sparse", offload, None))


def row(mode: str, n: int, result, *, fits: bool, gpu_bytes: int, host_gb: float,
        resident: int) -> dict:
    """One row of the sweep's JSON from a run's per-step times (``result.step_ms``)."""
    ms = np.asarray(result.step_ms, float)
    tpot = float(ms.mean())
    return {"concurrency": n, "mode": mode, "fits": bool(fits), "tpot_ms": round(tpot, 4),
            "p99_ms": round(float(np.percentile(ms, 99)), 4),
            "tokens_per_s": round(1e3 * n / tpot, 2), "resident": int(resident),
            "sparse": n - int(resident), "gpu_gb": round(gpu_bytes / GB, 3),
            "host_gb": round(host_gb, 3)}


def hidden_share(rows: list[dict]) -> None:
    """The sparse rows' hidden share: the part of the plain offload's overhead over gpu-only
    that the overlap removes, ``(no_overlap - sparse) / (no_overlap - gpu_only)``, per
    concurrency (None where the offload costs nothing)."""
    by = {(r["concurrency"], r["mode"]): r["tpot_ms"] for r in rows}
    for r in rows:
        r.setdefault("hidden_share", None)
        if r["mode"] != "sparse":
            continue
        n = r["concurrency"]
        g, off = by.get((n, "gpu-only")), by.get((n, "sparse-no-overlap"))
        if g is not None and off is not None and off - g > 0:
            r["hidden_share"] = round((off - r["tpot_ms"]) / (off - g), 4)


def against_gpu_only(rows: list[dict]) -> None:
    """Each row's cost under pressure: ``gpu_only_tpot_ms``, gpu-only's TPOT at the same
    concurrency (run outside the budget where it does not fit it: the GPU that would have
    room), and ``vs_gpu_only_pct``, the row's TPOT over it in percent (None without a
    gpu-only row of that concurrency)."""
    g = {r["concurrency"]: r["tpot_ms"] for r in rows if r["mode"] == "gpu-only"}
    for r in rows:
        ref = g.get(r["concurrency"])
        r["gpu_only_tpot_ms"] = ref
        r["vs_gpu_only_pct"] = None if ref is None else round(100 * (r["tpot_ms"] / ref - 1), 2)


def document(cfg: Config, rows: list[dict], *, gpu_budget_gb: float, host_gb: float,
             plan_rows, errors: list[str], extra: dict, offload: str = "overlap") -> dict:
    """The sweep's JSON: the fields docs/design.md section 11 lists, then what ran."""
    return {"context": cfg.context, "gpu_budget_gb": gpu_budget_gb, "row_bytes": cfg.row_bytes,
            "mtp": cfg.mtp, "offload": offload,
            "model": f"{cfg.model} (hidden {cfg.hidden}), indexer "
                     f"{'on' if cfg.indexer else 'off'}",
            "self_check": "passed" if not errors else "failed", "rows": rows,
            "errors": errors, "host_gb": host_gb,
            "gpu_only_max": _sweep.gpu_only_max(cfg.context, cfg.total_steps,
                                                gpu_budget_gb=gpu_budget_gb,
                                                shape=_sweep.demo_shape(cfg)),
            "plan": [dataclasses.asdict(p) for p in plan_rows],
            "config": {k: v for k, v in vars(cfg).items() if k not in _PER_RUN},
            **extra}


def table(doc: dict) -> str:
    """The rows as text, one line each."""
    out = [f"{'n':>3} {'mode':<18} {'fits':>5} {'TPOT ms':>8} {'p99 ms':>8} {'tok/s':>8} "
           f"{'res/sp':>7} {'GPU GB':>7} {'host GB':>8} {'hidden':>7} {'vs g-o':>7}"]
    for r in doc["rows"]:
        h, v = r.get("hidden_share"), r.get("vs_gpu_only_pct")
        out.append(f"{r['concurrency']:>3} {r['mode']:<18} {'yes' if r['fits'] else 'no':>5} "
                   f"{r['tpot_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['tokens_per_s']:>8.1f} "
                   f"{r['resident']:>3}/{r['sparse']:<3} {r['gpu_gb']:>7.2f} "
                   f"{r['host_gb']:>8.2f} {'-' if h is None else f'{100 * h:.1f}%':>7} "
                   f"{'-' if v is None or r['mode'] == 'gpu-only' else f'{v:+.1f}%':>7}")
    return "\n".join(out)


def plot(path: str, doc: dict) -> str:
    """TPOT, tokens/s and TPOT over gpu-only's at the same concurrency (percent), against
    concurrency per mode; gpu-only outside the budget hollow; the budget's gpu-only maximum
    marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"png: not written ({path}): matplotlib is not installed"
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, key, label in ((axes[0], "tpot_ms", "TPOT (ms per step)"),
                           (axes[1], "tokens_per_s", "tokens/s"),
                           (axes[2], "vs_gpu_only_pct", "TPOT over gpu-only's, same n (%)")):
        for mode in ("gpu-only", "resident", "sparse", "sparse-no-overlap"):
            rs = [r for r in doc["rows"] if r["mode"] == mode and r.get(key) is not None]
            if not rs:
                continue
            line, = ax.plot([r["concurrency"] for r in rs], [r[key] for r in rs], "-",
                            label=mode, alpha=0.8)
            for r in rs:
                ax.plot(r["concurrency"], r[key], "o", color=line.get_color(),
                        fillstyle="full" if r["fits"] else "none")
        ax.axvline(doc["gpu_only_max"], color="gray", ls="--", lw=1)
        ax.set_xlabel("concurrency (requests decoding)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(title=f"hollow: outside {doc['gpu_budget_gb']:g} GB")
    fig.suptitle(f"context {doc['context']}, GPU budget {doc['gpu_budget_gb']:g} GB "
                 f"(dashed: gpu-only's maximum, {doc['gpu_only_max']}), {doc['model']}",
                 fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"png: {path}"


def _kv_bytes(rig) -> int:
    """Bytes of KV on the GPU now: gpu-only's resident KV, or the cache's device rows and the
    resident layers; and the indexer's key cache."""
    idx = 0 if rig.indexer is None else rig.indexer.keys.nbytes
    if rig.cache is None:
        return rig.resident.nbytes + idx
    return rig.cache.device.nbytes + (0 if rig.low is None else rig.low.nbytes) + idx


def run_sweep(cfg: Config, *, gpu_budget_gb: float, host_gb: float,
              concurrencies=None, offload: str = "overlap") -> int:
    """The sweep (module docstring; ``offload``: :func:`runs`); returns the exit status (1: a
    self-check failed, 2: a concurrency the host pool does not hold, or whose gpu-only
    reference does not fit this GPU)."""
    plan_runs = runs(offload)
    import cupy

    from ..host import HostKVPool
    from ._loop import Rig
    from ._report import self_check

    log = (lambda msg: None) if cfg.quiet else (lambda msg: print(msg, flush=True))
    shape = _sweep.demo_shape(cfg)
    T = cfg.total_steps
    ns = concurrencies or _sweep.concurrencies(cfg.context, T, host_gb=host_gb,
                                               gpu_budget_gb=gpu_budget_gb, shape=shape)
    plans = _sweep.plan(cfg.context, T, ns, gpu_budget_gb=gpu_budget_gb, host_gb=host_gb,
                        shape=shape)
    over = [p for p in plans if not p.host_fits]
    if over:
        print(f"demo: --sweep: --concurrency {over[0].concurrency} needs {over[0].host_gb:.1f} "
              f"GB of host pool, more than --host-gb {host_gb:g} holds (at most "
              f"{_sweep.host_max(cfg.context, T, host_gb=host_gb, shape=shape)} requests)")
        return 2
    top = dataclasses.replace(cfg, batch=max(ns))
    m = top.memory()
    free = cupy.cuda.runtime.memGetInfo()[0]
    need = m["gpu_resident"] + m["gpu_model"] + m["gpu_indexer"]
    if need > 0.95 * free:
        print(f"demo: --sweep: gpu-only of {top.batch} requests (the self-check's reference) "
              f"needs {need / GB:.1f} GB of GPU memory, {free / GB:.1f} GB are free: lower "
              f"--host-gb or give --concurrency")
        return 2
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    g_max = _sweep.gpu_only_max(cfg.context, T, gpu_budget_gb=gpu_budget_gb, shape=shape)
    print(f"hisparse_cupy load sweep on {name}: context {cfg.context}, {T} steps "
          f"({cfg.warmup} warm-up), concurrencies {ns}, GPU budget {gpu_budget_gb:g} GB "
          f"(gpu-only fits {g_max}), host {host_gb:g} GB; model {cfg.model} (hidden "
          f"{cfg.hidden}), indexer {'on' if cfg.indexer else 'off'}", flush=True)
    s = cupy.cuda.Stream(non_blocking=True)
    t0 = time.perf_counter()
    pool = HostKVPool(cfg.layers - cfg.resident_layers, Rig.paged_rows(top), cfg.row_bytes)
    log(f"host pool: {pool.n_layers * pool.layer_bytes / GB:.1f} GB pinned in "
        f"{time.perf_counter() - t0:.1f} s (every run's pages)")
    rows, errors, shapes = [], [], {}
    try:
        for p in plans:
            n = p.concurrency
            c = dataclasses.replace(cfg, batch=n, modes=tuple(r[1] for r in plan_runs),
                                    execs=("graph",), device_budget=None,
                                    resident_requests=None, json=None, png=None, sweep=None)
            rig = Rig(c, s, log, pool=pool, paged=True)
            shapes[n] = rig.topk_shape
            results = []
            try:
                for mode, demo_mode, budget in plan_runs:
                    want = max(p.resident, 0) if budget == "managed" else None
                    if c.resident_requests != want:  # another device budget: a new cache
                        rig.free_cache()
                        c.resident_requests = want
                    r = rig.run(demo_mode, "graph", None)
                    results.append(r)
                    fits = {"gpu-only": p.gpu_only_fits, "resident": p.resident >= 0}.get(
                        mode, p.sparse_fits)
                    rows.append(row(mode, n, r, fits=fits, gpu_bytes=_kv_bytes(rig),
                                    host_gb=0.0 if mode == "gpu-only" else p.host_gb,
                                    resident=n if mode == "gpu-only" else (r.resident or 0)))
                    log(f"n {n} {mode}: TPOT {rows[-1]['tpot_ms']:.3f} ms, "
                        f"{rows[-1]['resident']} resident, {rows[-1]['gpu_gb']:.2f} GB on "
                        f"the GPU")
            finally:
                rig.close()
                del rig  # (its KV buffers and indexer keys before the next n's)
            # the runs named by their rows (two of them run the same demo mode)
            named = [dataclasses.replace(r, mode=m) if m != "gpu-only" else r
                     for r, (m, _, _) in zip(results, plan_runs, strict=False)]
            errors += [f"n {n}: {e}" for e in self_check(named)]
    finally:
        pool.close()
    hidden_share(rows)
    against_gpu_only(rows)
    doc = document(cfg, rows, gpu_budget_gb=gpu_budget_gb, host_gb=host_gb, plan_rows=plans,
                   errors=errors, offload=offload, extra={"device": name, "topk_shape": shapes,
                                         "wall_s": round(time.perf_counter() - t0, 1)})
    print()
    mtp = f", {cfg.mtp} draft steps a step (acceptance not modelled)" if cfg.mtp > 1 else ""
    mtp += ", managed and sparse rows with prediction" if offload == "predict" else ""
    print(f"load sweep, context {cfg.context}{mtp}: TPOT = mean step time after {cfg.warmup} "
          f"warm-up steps ({cfg.steps} timed, CUDA events); tokens/s = n / TPOT; GPU GB = "
          f"the KV and indexer keys on the GPU; gpu-only outside the budget (fits no) is the "
          f"reference at the same batch; vs g-o = TPOT over gpu-only's at the same n")
    print(table(doc))
    if cfg.json:
        Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.json).write_text(json.dumps(doc, indent=1))
        print(f"json: {cfg.json}")
    if cfg.png:
        print(plot(cfg.png, doc))
    if errors:
        print("SELF-CHECK FAILED:\n  " + "\n  ".join(errors))
        return 1
    print("self-check passed: every offloaded run's attention outputs are bit-identical to "
          "gpu-only's of the same requests")
    return 0
