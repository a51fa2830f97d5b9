"""tools/timeline_step.py's trace reading and per-layer split, on a synthetic trace (CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import timeline_step as tl  # noqa: E402


def _ev(name, t0, dur, stream=7, grid=(1, 1, 1)):
    return {"cat": "kernel", "name": name, "ts": t0, "dur": dur,
            "args": {"stream": stream, "grid": list(grid)}}


def _trace(tmp_path, events):
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"traceEvents": [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1},
                                             *events]}))
    return str(p)


def test_two_steps_split_by_layer(tmp_path):
    """A full layer (top-k, resolve, copy, attention beside a replay) and a shared one (a wait),
    twice: windows, compute, side time and library time as written by hand."""
    step = [
        ("embed", 0, 1), ("nvjet_gemm", 1, 4),
        ("topk_table", 5, 1), ("hs::swap_resolve<int>", 6, 10), ("hs::planned_copy<8>", 7, 12),
        ("attn_partial", 20, 10), ("hs::planned_copy<4>", 21, 8, 9, (16, 1, 1)),
        ("nvjet_gemm", 30, 10),
        ("attn_partial", 42, 8), ("nvjet_gemm", 50, 5), ("tick", 55, 1),
    ]
    events = []
    for base in (0, 100):
        for k in step:
            name, t0, dur, *rest = k
            events.append(_ev(name, base + t0, dur, *rest))
    ks = tl.kernels(_trace(tmp_path, events))
    assert [k["kind"] for k in ks[:4]] == ["bookkeeping", "model", "bookkeeping", "library"]
    steps = tl.split_steps(ks)
    assert len(steps) == 2 and all(len(s) == len(step) for s in steps)
    for st in steps:
        tl.mark_side(st, 7, 16)
        r = tl.layer_split(st, (True, False))
        assert r["win"].tolist() == [15.0, 2.0]  # 5 -> 20 after the gemm; 40 -> 42
        assert r["comp"].tolist() == [20.0, 13.0]
        assert r["side_busy"] == 8  # the replay (another stream), not the full layer's copy
        assert r["library"]["swap_resolve"] == 10 and r["library"]["planned_copy"] == 20
        assert r["step"] == 56


def test_one_stream_trace_finds_side_kernels_by_grid():
    st = [dict(name="hs::planned_copy<4>", t0=0, t1=5, stream=3, grid=(16, 1, 1),
               kind="library"),
          dict(name="hs::planned_copy<1>", t0=0, t1=5, stream=3, grid=(256, 1, 1),
               kind="library"),
          dict(name="hs::predict_stage", t0=0, t1=2, stream=3, grid=(1, 1, 1), kind="library"),
          dict(name="attn_partial", t0=5, t1=9, stream=3, grid=(8, 1, 1), kind="model")]
    tl.mark_side(st, 3, 16)
    assert [k["side"] for k in st] == [True, False, True, False]


def test_layer_count_mismatch_is_refused():
    st = [dict(name="attn_partial", t0=0, t1=1, stream=1, grid=(1,), kind="model", side=False),
          dict(name="tick", t0=1, t1=2, stream=1, grid=(1,), kind="bookkeeping", side=False)]
    with pytest.raises(RuntimeError, match="1 attention kernels in a step of 2 layers"):
        tl.layer_split(st, (True, False))


def test_the_indexer_is_its_own_kind_inside_the_full_layers_window():
    """The demo's indexer kernel counts in the full layer's window (not as compute), with its
    busy time and the side kernels' time inside it (a replay overlapping it by 3 us)."""
    st = [dict(name="nvjet_gemm", t0=0, t1=5, stream=7, grid=(1,), kind="model"),
          dict(name="indexer", t0=5, t1=9, stream=7, grid=(1,), kind=tl._kind("indexer")),
          dict(name="hs::planned_copy<4>", t0=6, t1=12, stream=9, grid=(16,),
               kind="library"),
          dict(name="topk_table", t0=9, t1=10, stream=7, grid=(1,), kind="bookkeeping"),
          dict(name="attn_partial", t0=20, t1=30, stream=7, grid=(8,), kind="model"),
          dict(name="tick", t0=30, t1=31, stream=7, grid=(1,), kind="bookkeeping")]
    assert st[1]["kind"] == "indexer"
    tl.mark_side(st, 7, 16)
    r = tl.layer_split(st, (True,))
    assert r["win"].tolist() == [15.0] and r["comp"].tolist() == [10.0]
    assert (r["indexer"], r["side_busy"], r["side_in_indexer"]) == (4, 6, 3)


def test_the_demo_kernels_are_recognised_by_their_templated_names():
    """The demo's kernels as the trace names them (namespace demo, a struct argument, the row
    format's instance): the indexer, bookkeeping, and the model's attention; the structs' names
    (IndexerParams, TickParams) count for nothing."""
    assert tl._kind("void demo::indexer(demo::IndexerParams)") == "indexer"
    assert tl._kind("void demo::index_query(demo::IndexQueryParams)") == "bookkeeping"
    assert tl._kind("void demo::kv_newest<true>(demo::KvNewestParams)") == "bookkeeping"
    assert tl._kind("void demo::attn_partial<true>(demo::AttnPartialParams)") == "model"
    assert tl._kind("void demo::attn_combine(demo::AttnCombineParams)") == "model"
    assert tl._kind("void hs::swap_resolve<int, int, 1024, false>(hs::SwapResolveParams)") == \
        "library"
    st = [dict(name="void demo::attn_partial<false>(demo::AttnPartialParams)", t0=0, t1=1,
               stream=1, grid=(1,), kind="model", side=False),
          dict(name="void demo::tick(demo::TickParams)", t0=1, t1=2, stream=1, grid=(1,),
               kind="bookkeeping", side=False)]
    assert tl.split_steps(st) == [st]
    assert tl.layer_split(st, (True,))["comp"].tolist() == [1.0]


@pytest.mark.parametrize("flags", [["--warmup", "3"], ["--steps=8"]])
def test_warmup_and_steps_among_the_demo_flags_are_refused(flags, capsys):
    """``-- --warmup 3`` once overrode the tool's warm-up and profiled steps 4-6, while the hot
    buffers were still filling: refused by name before anything is loaded."""
    with pytest.raises(SystemExit) as e:
        tl.main(["--batch", "8", "--", "--context", "131072", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flags[0].split("=")[0] in err and "before --" in err
