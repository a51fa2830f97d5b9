"""Tensor-parallel decode over ONE host pool shared by every GPU of the host.

With MLA every tensor-parallel rank holds the same latent KV, so one pinned host copy can serve
all of them: rank 0 creates the pool in POSIX shared memory and writes the prompts' KV into it,
every other rank attaches it (each registers the same pages, mapped for its own GPU). Each rank
keeps its own hot buffers and cache state over it. The model is the decode loop's
(:mod:`hisparse_cupy.demo`) split over the ranks: every rank attends with all heads over the
replicated KV rows, multiplies its share of the heads' outputs by its rows of the output
projection, and an NCCL all-reduce (``torch.distributed``) sums the partial hidden states.

Who writes the newest token's host row: every rank backs up its own copy of the newest token's
KV (identical bytes: the KV is replicated) on its own stream, before any swap of its own that
could miss on it. No rank ever reads a host row before its own backup of it has landed, and no
cross-process event is needed; the cost is one extra device -> host row per layer and request
per rank and step (the tables show it in the offload overhead).

Each rank runs gpu-only, offload and overlap (eager: the all-reduce runs through torch) and
checks its own attention outputs against its gpu-only run bit for bit; rank 0 prints every
rank's table, the host memory pinned (one pool per host instead of one per rank) and each
rank's swap GB/s.

    torchrun --nproc-per-node 2 examples/tp_decode.py [demo options]
    python examples/tp_decode.py --nproc 2 [demo options]          (mp.spawn)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time


def worker(rank: int, world: int, argv: list[str], pool_name: str) -> int:
    import cupy
    import torch
    import torch.distributed as dist

    from hisparse_cupy import HostKVPool
    from hisparse_cupy.demo import describe, report_results, run_modes
    from hisparse_cupy.demo.config import ROW_BYTES, from_args
    from hisparse_cupy.demo.loop import Rig
    from hisparse_cupy.interop import to_torch

    torch.cuda.set_device(rank)
    cupy.cuda.Device(rank).use()
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    cfg = from_args(argv + ["--quiet"] if rank else argv)
    cfg.execs = ("eager",)  # the all-reduce goes through torch: eager steps only
    log = (lambda msg: None) if cfg.quiet else (lambda msg: print(f"[rank {rank}] {msg}",
                                                                  flush=True))
    why = describe(cfg) if rank == 0 else None
    why = [why]
    dist.broadcast_object_list(why, src=0)
    if why[0]:
        if rank == 0:
            print(f"tp_decode: {why[0]}")
        dist.destroy_process_group()
        return 2
    s = cupy.cuda.Stream(non_blocking=True)
    ts = torch.cuda.ExternalStream(s.ptr)

    def all_reduce(h) -> None:  # bf16 partial hidden states, summed in place on s
        with torch.cuda.stream(ts):
            dist.all_reduce(to_torch(h, stream=s).view(torch.bfloat16))

    n_rows = cfg.batch * cfg.max_len
    t0 = time.perf_counter()
    if rank == 0:
        pool = HostKVPool(cfg.layers, n_rows, ROW_BYTES, shared_name=pool_name)
    dist.barrier()
    if rank:
        pool = HostKVPool.attach(pool_name, cfg.layers, n_rows, ROW_BYTES)
    t_pool = time.perf_counter() - t0
    try:
        rig = Rig(cfg, s, log, pool=pool, write_pool=rank == 0, tp=(rank, world, all_reduce))
        if rank == 0:
            rig.use_cache()  # writes the prompts' KV into the shared pool
        dist.barrier()  # every rank swaps those rows from here on
        try:
            results = run_modes(cfg, rig, log)
        finally:
            rig.close()
        # each rank's table, printed by rank 0 in rank order
        name = cupy.cuda.runtime.getDeviceProperties(rank)["name"].decode()
        for key in ("json", "png"):  # one file per rank
            path = getattr(cfg, key)
            if path:
                stem, dot, ext = path.rpartition(".")
                setattr(cfg, key, f"{stem}.rank{rank}.{ext}" if dot else f"{path}.rank{rank}")
        outs = [None] * world
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = report_results(cfg, results, {"device": name, "rank": rank, "world": world,
                                               "matmul": rig.model.gemm.kind,
                                               "pool_s": t_pool},
                                f"rank {rank} of {world}: {name}")
        dist.all_gather_object(outs, (rc, buf.getvalue(), t_pool))
        if rank == 0:
            gb = pool.n_layers * pool.layer_bytes / 1e9
            for r, (_, text, tp) in enumerate(outs):
                print(f"\n=== rank {r} (pool {'created' if r == 0 else 'attached'} and "
                      f"registered in {tp:.1f} s)\n{text.strip()}")
            print(f"\nhost memory pinned: {gb:.1f} GB per host (one shared pool, registered by "
                  f"each of the {world} ranks), {gb:.1f} GB per rank's view of it; a pool per "
                  f"rank would pin {world * gb:.1f} GB")
        rc = max(o[0] for o in outs)
    finally:
        dist.barrier()  # nobody reads the pool any more
        pool.close()  # rank 0, the creator, unlinks the name
        dist.destroy_process_group()
    return rc


def _spawned(rank: int, world: int, argv: list[str], pool_name: str) -> None:
    rc = worker(rank, world, argv, pool_name)
    if rc:
        sys.exit(rc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks to start with mp.spawn (default: run under torchrun)")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args()
    if args.help:
        print(__doc__)
        from hisparse_cupy.demo.config import parser

        parser().print_help()
        return 0
    pool_name = f"hs-tp-{os.getpid()}"
    if "RANK" in os.environ and args.nproc is None:  # torchrun
        world = int(os.environ["WORLD_SIZE"])
        if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
            print("tp_decode: one host pool serves the GPUs of one host: run every rank on "
                  "one node (torchrun --nnodes 1)")
            return 2
        pool_name = os.environ.get("HS_POOL_NAME", f"hs-tp-{os.environ.get('MASTER_PORT', '0')}")
        return worker(int(os.environ["LOCAL_RANK"]), world, rest, pool_name)
    import torch
    import torch.multiprocessing as mp

    n = args.nproc or torch.cuda.device_count()
    if n > torch.cuda.device_count():
        print(f"tp_decode: {n} ranks need {n} GPUs, this machine has "
              f"{torch.cuda.device_count()}")
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    mp.spawn(_spawned, args=(n, rest, pool_name), nprocs=n, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
