"""The decode loop's self-check, table, JSON and plot (NumPy only)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np

from ._config import Config


def self_check(results) -> list[str]:
    """Errors: every run's attention outputs (per step and layer digests) must equal the
    GPU-only run's bit for bit; the reference must hold real outputs; an offloaded run's device
    counters must count every step's rows in every full layer."""
    ref = next((r for r in results if r.mode == "gpu-only"), None)
    if ref is None:
        return ["no gpu-only run to check against"]
    errors = []
    if not ref.digest.all():
        errors.append("the gpu-only run left some (step, layer) outputs empty")
    for r in results:
        if r is ref:
            continue
        errors += _counter_errors(r, ref.digest.shape[0])
        bad = np.argwhere(r.digest != ref.digest)
        if bad.size:
            t, layer = bad[0]
            errors.append(f"{r.mode} {r.exec}: attention output of step {t}, layer {layer} "
                          f"differs from gpu-only {ref.exec} ({len(bad)} (step, layer) pairs "
                          f"differ)")
    return errors


def _counter_errors(r, steps: int) -> list[str]:
    c = r.counters
    if c is None:
        return []
    full, out = c["full"], []
    rows = c["rows"][full]
    if not (rows == steps * c["batch"]).all():
        out.append(f"{r.mode} {r.exec}: full layers' counted rows {rows.tolist()} are not "
                   f"{steps} steps x batch {c['batch']}")
    return out


def predict_lines(rows) -> list[str]:
    """One line per predict run: what prediction staged and what the swaps used of it."""
    return [f"  predict {r['exec']}: {p['staged']} rows staged; the predicted full layers' "
            f"swaps missed {p['rows']} rows and read {p['used']} of them from staged rows: "
            f"precision {p['precision']:.3f}, recall {p['recall']:.3f}"
            for r in rows if (p := r.get("predict"))]


def counter_lines(results) -> list[str]:
    """One line per offloaded run: what its device counters say (full and shared layers)."""
    out = []
    for r in results:
        c = r.counters
        if c is None:
            continue
        f = c["full"]
        sel, miss = c["selected"], c["misses"]
        out.append(f"  {r.mode} {r.exec}: full layers hit rate "
                   f"{1 - miss[f].sum() / max(1, sel[f].sum()):.4f}, {miss.sum()} misses, "
                   f"{c['bytes'].sum() / 1e9:.2f} GB over {r.digest.shape[0]} steps; shared "
                   f"layers swapped {int(c['rows'][~f].sum())} rows themselves")
    return out


def summarize(cfg: Config, results, n_full: int) -> list[dict]:
    """One row per run: ITL statistics, overhead over gpu-only, share hidden, IO."""
    base = {r.exec: float(r.step_ms.mean()) for r in results if r.mode == "gpu-only"}
    off = {r.exec: float(r.step_ms.mean()) for r in results if r.mode == "offload"}
    rows = []
    for r in results:
        ms = r.step_ms
        mean = float(ms.mean())
        row = {"mode": r.mode, "exec": r.exec, "mean_ms": mean,
               "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
               "steps": int(ms.size)}
        if r.mode != "gpu-only":
            g = base.get(r.exec)
            over = None if g is None else mean - g
            entries = n_full * cfg.batch * cfg.mtp * cfg.top_k
            nbytes = float(r.rows_moved.mean()) * cfg.row_bytes
            row.update(overhead_ms=over, overhead_pct=None if g is None else 100 * over / g,
                       hit_rate=1.0 - float(r.misses.mean()) / entries,
                       mb_per_step=nbytes / 1e6,
                       gbps=(nbytes / (over * 1e-3) / 1e9) if over and over > 0 else None,
                       swap_call_us=r.swap_call_us, lean=r.lean)
            if r.resident is not None:
                row["resident"] = r.resident
            if r.mode in ("overlap", "predict") and g is not None and off.get(r.exec, 0) > g:
                row["hidden_pct"] = 100 * (off[r.exec] - mean) / (off[r.exec] - g)
            if r.predict is not None:
                row["predict"] = r.predict
        rows.append(row)
    return rows


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _resident(row: dict) -> str:
    """Requests resident under a device budget, "lean" when the steps ran lean."""
    n = row.get("resident")
    return "-" if n is None else f"{n}{' lean' if row.get('lean') else ''}"


def table(rows: list[dict]) -> str:
    head = (f"{'mode':<9}{'exec':<6}{'mean ms':>9}{'p50':>8}{'p99':>8}{'overhead':>10}"
            f"{'':>8}{'hidden':>8}{'hit rate':>10}{'MB/step':>9}{'GB/s':>7}{'swap us':>11}"
            f"{'resident':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        over = r.get("overhead_ms")
        over_s = "-" if over is None else f"{over:+.2f} ms"
        hid = r.get("hidden_pct")
        hid_s = "-" if hid is None else f"{hid:.1f}%"
        lines.append(
            f"{r['mode']:<9}{r['exec']:<6}{r['mean_ms']:>9.3f}{r['p50_ms']:>8.3f}"
            f"{r['p99_ms']:>8.3f}{over_s:>10}{_fmt(r.get('overhead_pct'), '+.1f'):>7}%"
            f"{hid_s:>8}"
            f"{_fmt(r.get('hit_rate'), '.4f'):>10}{_fmt(r.get('mb_per_step'), '.1f'):>9}"
            f"{_fmt(r.get('gbps'), '.1f'):>7}{_fmt(r.get('swap_call_us'), '.1f'):>11}"
            f"{_resident(r):>10}")
    return "\n".join(lines)


def write_json(path: str, cfg: Config, rows, results, extra: dict) -> None:
    doc = {"config": {k: v for k, v in vars(cfg).items() if k not in ("json", "png")},
           "python": platform.python_version(), **extra, "summary": rows,
           "runs": [{"mode": r.mode, "exec": r.exec, "step_ms": r.step_ms.round(4).tolist(),
                     "rows_moved": r.rows_moved.tolist(), "misses": r.misses.tolist(),
                     **({} if r.counters is None else {"layer_counters": {
                         k: np.asarray(r.counters[k]).tolist()
                         for k in ("rows", "selected", "misses", "flagged")}})}
                    for r in results]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(doc), indent=1, allow_nan=False))


def _finite(x):
    """``x`` with every NaN or infinity replaced by None (strict JSON has neither)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else None
    return x


def plot(path: str, cfg: Config, results, title: str) -> str:
    """ITL per step for every run; returns what happened (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        x = np.arange(cfg.warmup, cfg.warmup + r.step_ms.size)
        ax.plot(x, r.step_ms, lw=0.8, label=f"{r.mode} ({r.exec})")
    ax.set_xlabel("decode step")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"
