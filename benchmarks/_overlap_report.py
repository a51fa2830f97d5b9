"""The tables and the plot of ``bench_overlap.py`` (from its JSON payload, so ``--plot JSON``
renders a stored run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _fmt(d: dict) -> str:
    return f"{d['median_ms']:.2f} [{d['p10_ms']:.2f}-{d['p90_ms']:.2f}]"


def _pct(v) -> str:
    return "n/a" if v is None else f"{v * 100:+.1f}%"


HEADER = ("| layers | batch | miss % (per req, start/end) | exec | no offload ms | no overlap ms "
          "| overlap ms | skip-IO ms | overhead no-ovl / ovl ms | hidden | ceiling "
          "| hidden skip-IO | compute slowdown | step IO MB | memcpy ms |\n" + "|---" * 15 + "|")


def table(results: list[dict]) -> str:
    """The main table: every configuration's modes, graph and eager."""
    lines = [HEADER]
    for r in results:
        for ex in ("graph", "eager"):
            m, d = r["modes"][ex], r["derived"][ex]
            lines.append(
                f"| {r['layers']} | {r['batch']} | {r['miss_rate'] * 100:g} "
                f"({r['misses_per_request']:.0f}/{r['misses_per_request_end']:.0f}) | {ex} | "
                f"{_fmt(m['no_offload'])} | "
                f"{_fmt(m['no_overlap'])} | {_fmt(m['overlap'])} | "
                f"{m['overlap_skip_io']['median_ms']:.2f} | "
                f"{d['overhead_no_overlap_ms']:.2f} / {d['overhead_overlap_ms']:.2f} | "
                f"{d['hidden'] * 100:.1f}% | {d['ceiling'] * 100:.1f}% | "
                f"{d['hidden_skip_io'] * 100:.1f}% | {_pct(d['compute_slowdown'])} | "
                f"{r['step_io_bytes'] / 1e6:.1f} | {r['memcpy_step_io_ms']:.2f} |")
    return "\n".join(lines)


def sweep_table(results: list[dict]) -> str:
    """The replay-settings sweep (graph); the block column reads old JSONs' thin rows too."""
    lines = ["| layers | batch | miss % | replay grid | rows/warp | block | side priority | "
             "overlap ms | hidden | compute slowdown |", "|---" * 10 + "|"]
    for r in results:
        for w in r.get("sweep", ()):
            lines.append(f"| {r['layers']} | {r['batch']} | {r['miss_rate'] * 100:g} | "
                         f"{w['replay_grid']} | {w.get('rows_per_warp', 1)} | "
                         f"{'1 warp' if w.get('thin') else '8 warps'} | "
                         f"{w['side_priority']} | {_fmt(w['overlap'])} | "
                         f"{w['hidden'] * 100:.1f}% | {_pct(w['compute_slowdown'])} |")
    return "\n".join(lines)


def predict_table(results: list[dict]) -> str:
    """Prediction: each configuration's own point and its top-k overlap sweep (graph)."""
    lines = ["| layers | batch | miss % | top-k overlap | no overlap ms | overlap ms | predict ms "
             "| hidden overlap | hidden predict | precision | recall |", "|---" * 11 + "|"]
    for r in results:
        pts = [{"common": r.get("common", 1.0), "no_overlap": r["modes"]["graph"]["no_overlap"],
                "overlap": r["modes"]["graph"]["overlap"],
                "overlap_predict": r["modes"]["graph"].get("overlap_predict"),
                "hidden": r["derived"]["graph"]["hidden"],
                "hidden_predict": r["derived"]["graph"].get("hidden_predict"),
                "predict": r.get("predict") or {}}] + r.get("predict_sweep", [])
        for w in pts:
            if w["overlap_predict"] is None:
                continue
            p = w["predict"]
            lines.append(f"| {r['layers']} | {r['batch']} | {r['miss_rate'] * 100:g} | "
                         f"{w['common'] * 100:g}% | {w['no_overlap']['median_ms']:.2f} | "
                         f"{w['overlap']['median_ms']:.2f} | "
                         f"{w['overlap_predict']['median_ms']:.2f} | {w['hidden'] * 100:.1f}% | "
                         f"{w['hidden_predict'] * 100:.1f}% | {p.get('precision', 0):.3f} | "
                         f"{p.get('recall', 0):.3f} |")
    return "\n".join(lines)


def print_tables(results: list[dict]) -> None:
    print(sweep_table(results))
    print(table(results))
    print(predict_table(results))


def plot(payload: dict, path: Path) -> bool:
    """The PNG: step time per mode over no offload, and the share hidden; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG (render it later with --plot JSON)")
        return False
    res = payload["results"]
    labels = [f"L{r['layers']} B{r['batch']}\n{r['miss_rate'] * 100:g}%" for r in res]
    x = np.arange(len(res))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(12, 2.8 * len(res)), 4.5))
    names = {"no_offload": "no offload", "no_overlap": "offload, no overlap",
             "overlap": "offload, overlap", "overlap_skip_io": "overlap, replays skip IO"}
    w = 0.8 / len(names)
    for j, (mode, lab) in enumerate(names.items()):
        med = np.array([r["modes"]["graph"][mode]["median_ms"] for r in res])
        lo = med - np.array([r["modes"]["graph"][mode]["p10_ms"] for r in res])
        hi = np.array([r["modes"]["graph"][mode]["p90_ms"] for r in res]) - med
        base = np.array([r["modes"]["graph"]["no_offload"]["median_ms"] for r in res])
        a1.bar(x + (j - 1.5) * w, med / base, w, yerr=[lo / base, hi / base], label=lab)
    a1.set_xticks(x, labels)
    a1.set_ylabel("step time / no-offload step (graph)")
    top = max(r["modes"]["graph"][m]["p90_ms"] / r["modes"]["graph"]["no_offload"]["median_ms"]
              for r in res for m in names)
    a1.set_ylim(0.9, 0.9 + (top - 0.9) * 1.35)
    a1.legend(fontsize=8, loc="upper center", ncol=2)
    a1.set_title("per-step time, CUDA graph")
    for j, ex in enumerate(("graph", "eager")):
        a2.bar(x + (j - 0.5) * 0.35, [100 * r["derived"][ex]["hidden"] for r in res], 0.35,
               label=f"hidden ({ex})")
    a2.scatter(x, [100 * r["derived"]["graph"]["ceiling"] for r in res], marker="_", s=600,
               color="k", label="ceiling (shared layers' IO share)", zorder=3)
    a2.axhline(55.6, color="gray", ls="--", lw=0.8, label="SGLang #28523: 55.6%")
    a2.set_xticks(x, labels)
    a2.set_ylabel("% of the offload overhead hidden")
    a2.set_title("fraction of the offload overhead hidden")
    a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    dev = payload.get("device", {}).get("name", "")
    fig.suptitle(f"IndexCache shared-layer IO overlap, {dev}, K {payload['K']}, H {payload['H']}, "
                 f"rows {payload['row_bytes']} B")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
