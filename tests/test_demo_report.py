"""The decode loop's report on the CPU (``hisparse_cupy.demo._report``): the share hidden, the
table, the prediction lines, the self-check and its counter checks, the JSON, on made-up runs
whose figures are known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hisparse_cupy.demo import _report as report
from hisparse_cupy.demo._config import Config
from hisparse_cupy.demo._loop import RunResult

STEPS, L = 5, 4
FULL = np.array([True, False, True, False])


def _runs():
    cfg = Config(layers=L, batch=2, top_k=16, hot=32, steps=STEPS, warmup=0)
    digest = np.arange(1, STEPS * L + 1, dtype=np.uint64).reshape(STEPS, L)
    misses = np.full(STEPS, 6, np.int64)  # full-layer misses per step

    def run(mode, ms, predict=None):
        ctr = None
        if mode != "gpu-only":
            ctr = {"rows": np.where(FULL, STEPS * 2, 0), "selected": np.where(FULL, 80, 0),
                   "misses": np.where(FULL, 15, 0), "flagged": np.zeros(L, np.int64),
                   "bytes": np.where(FULL, 15, 0) * 1152, "full": FULL,
                   "batch": 2}
        return RunResult(mode, "graph", np.full(STEPS, ms), digest.copy(),
                         np.full(STEPS, 12, np.int64), misses, None, ctr, predict)

    pred = {"rows": 30, "used": 9, "staged": 20, "precision": 0.45, "recall": 0.3}
    return cfg, [run("gpu-only", 10.0), run("offload", 14.0), run("overlap", 12.0),
                 run("predict", 11.0, pred)]


def test_the_share_hidden_the_table_and_the_prediction_line():
    cfg, results = _runs()
    rows = report.summarize(cfg, results, n_full=2)
    by = {r["mode"]: r for r in rows}
    assert by["offload"]["overhead_ms"] == 4.0 and by["offload"]["overhead_pct"] == 40.0
    assert by["overlap"]["hidden_pct"] == 50.0 and by["predict"]["hidden_pct"] == 75.0
    assert "hidden_pct" not in by["offload"]
    assert by["overlap"]["hit_rate"] == 1 - 6 / (2 * 2 * 16)
    text = report.table(rows)
    for mode in ("gpu-only", "offload", "overlap", "predict"):
        assert f"\n{mode}" in text
    assert "+40.0%" in text and "75.0%" in text
    (line,) = report.predict_lines(rows)
    assert "20 rows staged" in line and "precision 0.450, recall 0.300" in line
    assert report.self_check(results) == []


def test_the_self_check_names_a_differing_output_and_wrong_counters():
    _, results = _runs()
    results[2].digest[3, 1] += np.uint64(1)
    results[1].counters["rows"] = np.where(FULL, 9, 0)
    errors = report.self_check(results)
    assert any("overlap graph: attention output of step 3, layer 1" in e for e in errors)
    assert any("offload graph: full layers' counted rows" in e for e in errors)
    _, results = _runs()
    results[0].digest[0, 0] = 0
    assert any("left some (step, layer) outputs empty" in e for e in report.self_check(results))


def test_the_json_holds_every_run_with_its_layer_counters(tmp_path):
    cfg, results = _runs()
    rows = report.summarize(cfg, results, n_full=2)
    path = tmp_path / "r.json"
    report.write_json(str(path), cfg, rows, results, {"device": "none"})
    doc = json.loads(path.read_text())
    assert [r["mode"] for r in doc["runs"]] == ["gpu-only", "offload", "overlap", "predict"]
    assert "layer_counters" not in doc["runs"][0]
    assert doc["runs"][1]["layer_counters"]["misses"] == [15, 0, 15, 0]
    assert doc["summary"][3]["predict"]["staged"] == 20 and doc["device"] == "none"
    # strict JSON: a NaN (nothing staged: no precision) is written as null
    results[3].predict = {"rows": 0, "used": 0, "staged": 0, "precision": float("nan"),
                          "recall": np.float64("nan")}
    rows = report.summarize(cfg, results, n_full=2)
    report.write_json(str(path), cfg, rows, results, {"shape": {"x": float("inf")}})
    doc = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert doc["summary"][3]["predict"]["precision"] is None and doc["shape"]["x"] is None
