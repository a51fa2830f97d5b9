"""Tensor-parallel ranks over one shared host pool: examples/tp_decode.py (each rank's attention
bit for bit against its gpu-only run, the ranks' page allocators agreeing) with two ranks on two
GPUs (NCCL) and with two ranks sharing one GPU (gloo), benchmarks/bench_shared_pool.py (every
GPU's gathers from the one pool return the right bytes), and one process mapping one pool into
both GPUs. The two-GPU tests skip, with the reason, on one GPU; the placement's errors run on a
CPU."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _util import pattern

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "8", "--batch", "4", "--context", "2304", "--hot", "1024", "--top-k", "256",
         "--steps", "6", "--warmup", "3"]


def _two_gpus() -> None:
    from conftest import _device_count

    n, why = _device_count()
    if n < 2:
        pytest.skip(f"needs two GPUs of one host (nvidia-h200-x2), found {n} {why}".strip())


def test_tp_decode_help_without_a_gpu():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_decode.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "ONE host pool" in p.stdout and "--new-share" in p.stdout
    assert "--newest-writer" in p.stdout


@pytest.mark.parametrize("flag", [["--graph"], ["--eager-and-graph"], ["--side-sms", "8"]])
def test_tp_decode_refuses_what_its_ranks_cannot_run(flag):
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_decode.py"), *flag],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"tp_decode: {flag[0]} cannot run here" in p.stdout, p


def _tp_module():
    spec = importlib.util.spec_from_file_location("tp_decode", ROOT / "examples" / "tp_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # stdlib imports only at the top: no torch, no GPU
    return mod


def test_tp_placement():
    place = _tp_module().placement
    assert place(2, None, 2, "auto") == (2, "nccl")
    assert place(2, None, 8, "auto") == (2, "nccl")
    assert place(2, 1, 8, "auto") == (1, "gloo")
    assert place(2, None, 1, "auto") == (1, "gloo")
    assert place(4, 2, 2, "gloo") == (2, "gloo")
    assert place(2, 4, 4, "auto") == (2, "nccl")  # never more GPUs than ranks
    for args, names in [((2, 1, 1, "nccl"), "--backend nccl needs a GPU per rank"),
                        ((2, 3, 2, "auto"), "--gpus must be in [1, 2]"),
                        ((2, 0, 2, "auto"), "--gpus must be in [1, 2]"),
                        ((0, None, 2, "auto"), "--nproc must be >= 1"),
                        ((2, None, 2, "mpi"), "--backend must be one of"),
                        ((2, None, 0, "auto"), "needs a CUDA GPU"),
                        ((0, None, 0, "auto"), "needs a CUDA GPU")]:  # no flags, no GPU
        with pytest.raises(ValueError, match=re.escape(names)):
            place(*args)


def _tp_decode(tmp_path, writer, layout, *placement):
    js = tmp_path / "tp.json"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_decode.py"), "--nproc", "2",
                        *placement, "--newest-writer", writer, *SMALL, "--json", str(js)]
                       + (["--slot-layout"] if layout == "slot" else []),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "=== rank 0" in p.stdout and "=== rank 1" in p.stdout
    assert p.stdout.count("self-check passed") == 2
    assert ("waits on rank 0's backup" in p.stdout) == (writer == "rank0")
    assert "a pool per rank would pin" in p.stdout
    docs = [json.loads((tmp_path / f"tp.rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, doc in enumerate(docs):
        assert doc["self_check"] == "passed" and doc["rank"] == rank
        assert doc["newest_writer"] == writer and doc["paged"] == (layout == "paged")
        rows = {(r["mode"], r["exec"]): r for r in doc["summary"]}
        assert rows[("offload", "eager")]["mb_per_step"] > 0
    return p.stdout, docs


TP_CASES = [("every", "paged"), ("rank0", "paged"), ("every", "slot")]


@pytest.mark.gpu
@pytest.mark.parametrize("writer, layout", TP_CASES)
def test_tp_decode_two_ranks_one_pool(tmp_path, writer, layout):
    """Either way of writing the newest rows: every rank its own copy, or rank 0 alone with
    the others waiting on its interprocess event; the pool paged (the ranks' allocators
    checked to agree) or in the slot layout; both ranks bit for bit against gpu-only."""
    _two_gpus()
    pytest.importorskip("torch", reason="the example's all-reduce runs through torch.distributed")
    _, docs = _tp_decode(tmp_path, writer, layout)
    assert [(d["gpu"], d["backend"]) for d in docs] == [(0, "nccl"), (1, "nccl")]


@pytest.mark.gpu
@pytest.mark.parametrize("writer, layout", TP_CASES)
def test_tp_decode_two_ranks_share_one_gpu(tmp_path, writer, layout):
    """The same two processes over one shared pool on GPU 0 (any machine with a GPU): two
    registrations of the pool's pages on one device, the ranks' allocators agreeing page for
    page, the interprocess event of rank 0's backups; the all-reduce through gloo."""
    pytest.importorskip("torch", reason="the example's all-reduce runs through torch.distributed")
    out, docs = _tp_decode(tmp_path, writer, layout, "--gpus", "1")
    assert [(d["gpu"], d["backend"]) for d in docs] == [(0, "gloo"), (0, "gloo")]
    assert "2 ranks on 1 GPU(s), summed through gloo" in out


@pytest.mark.gpu
def test_shared_pool_bench_two_gpus(tmp_path):
    _two_gpus()
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_shared_pool.py"),
                        "--gpus", "2", "--pool-gb", "1", "--rows", "16384", "--iters", "5",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((tmp_path / "bench_shared_pool_2gpu.json").read_text())
    assert [r["gpu"] for r in doc["per_gpu"]] == [0, 1]
    assert all(r["bytes_ok"] for r in doc["per_gpu"])
    assert doc["host_gb_pinned_without_sharing"] == 2 * doc["host_gb_pinned"]


@pytest.mark.gpu
def test_one_process_maps_one_pool_into_two_gpus(rng):
    """One process, one pool (portable pinned memory), a cache per GPU over it: a request whose
    prefill one GPU wrote (device -> host) is admitted and swapped by the other, both ways."""
    _two_gpus()
    import cupy
    import numpy as np

    from hisparse_cupy import HostKVPool, HotBufferCache

    L, R, MAXLEN, ROW, H, K = 2, 2, 512, 656, 64, 32
    n = 400

    def kv(rid):
        return np.stack([pattern(layer, rid * MAXLEN + np.arange(n), ROW) for layer in range(L)])

    def swap_ok(gpu, rid):
        with cupy.cuda.Device(gpu):
            c = caches[gpu]
            req = cupy.asarray([rid], dtype=cupy.int32)
            lens = cupy.asarray([n], dtype=cupy.int32)
            topk = rng.choice(n - 1, K, replace=False).astype(np.int32)
            for layer in range(L):
                locs = c.begin_step(req, lens).swap(layer, cupy.asarray(topk[None]))
                got = cupy.asnumpy(c.device_rows(layer)[locs[0]])
                assert (got == kv(rid)[layer][topk]).all(), (gpu, rid, layer)

    with HostKVPool(L, R * MAXLEN, ROW) as pool:
        caches = []
        for gpu in (0, 1):
            with cupy.cuda.Device(gpu):
                caches.append(HotBufferCache(n_layers=L, max_requests=R, max_len=MAXLEN,
                                             row_bytes=ROW, hot_size=H, top_k=K, extra_page=4,
                                             pool=pool))
        for writer, reader in ((0, 1), (1, 0)):  # request slot `writer`
            rid = writer
            with cupy.cuda.Device(writer):  # prefill from this GPU into the shared rows
                slot = caches[writer].admit(n, kv=cupy.asarray(kv(rid)))
                cupy.cuda.get_current_stream().synchronize()
            with cupy.cuda.Device(reader):
                assert caches[reader].admit(n) == slot == rid  # rows already in the pool
            swap_ok(writer, rid)
            swap_ok(reader, rid)
        for gpu in (0, 1):
            with cupy.cuda.Device(gpu):
                cupy.cuda.get_current_stream().synchronize()
                caches[gpu].close()
