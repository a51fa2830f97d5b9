"""Tensor-parallel decode over ONE host pool shared by every GPU of the host.

With MLA every tensor-parallel rank holds the same latent KV, so one pinned host copy can serve
all of them: rank 0 creates the pool in POSIX shared memory, every other rank attaches it (each
registers the same pages, mapped for its own GPU). Each rank keeps its own hot buffers and cache
state over it. The pool is paged (the default): every rank's cache hands out its pages, and
since every rank makes the same calls (admissions, growth, releases) in the same order, their
allocators agree on every page, which each admission checks (``HostPages.fingerprint``,
compared across ranks); every rank admits its requests with the prompts' KV it makes on its own
GPU (identical bytes into the same pages), after a barrier that every rank's earlier reads of
the pool are done (a released page may be one another rank still read). ``--slot-layout``: the
pool in the slot layout instead, rank 0 writing the prompts' KV once. The model is the decode loop's
(:mod:`hisparse_cupy.demo`) split over the ranks: every rank attends with all heads over the
replicated KV rows, multiplies its share of the heads' outputs by its rows of the output
projection, and an NCCL all-reduce (``torch.distributed``) sums the partial hidden states.

Who writes the newest token's host row (``--newest-writer``):

- ``every`` (the default): every rank backs up its own copy of the newest token's KV (identical
  bytes: the KV is replicated) on its own stream, before any swap of its own that could miss on
  it. No rank ever reads a host row before its own backup of it has landed, nothing crosses
  processes, and the step stays capturable; the cost is one device -> host row per layer and
  request per rank and step, on each rank's own link.
- ``rank0``: the alternative, measured beside it (``benchmarks/NOTES.md``): rank 0 alone backs
  up and records an interprocess CUDA event after it; every other rank, before the swaps of the
  next step, makes its stream wait on that event (:class:`NewestRowFence`). It needs a host
  handshake per step (an event wait binds to the record queued before it), so it cannot be
  captured in a CUDA graph.

Each rank runs gpu-only, offload and overlap (eager: the all-reduce runs through torch) and
checks its own attention outputs against its gpu-only run bit for bit; rank 0 prints every
rank's table, the host memory pinned (one pool per host instead of one per rank) and each
rank's swap GB/s.

Ranks are placed round-robin on the first ``--gpus`` GPUs (default: one GPU per rank, as many
as there are). Ranks that share a GPU (``--nproc 2`` on a one-GPU machine, or ``--gpus 1``)
cannot use NCCL, which refuses two ranks on one device: ``--backend auto`` (the default) then
sums through gloo, which copies the partial hidden states through host memory and blocks the
host at every layer. The pool, its pages, the allocators' agreement, the newest-row writers and
the self-check are the same as on separate GPUs; the step times are not tensor-parallel step
times.

    torchrun --nproc-per-node 2 examples/tp_decode.py [--newest-writer every|rank0]
        [--slot-layout] [--gpus N] [--backend auto|nccl|gloo] [demo options]
    python examples/tp_decode.py --nproc 2 [...]  (mp.spawn)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

WRITERS = ("every", "rank0")
BACKENDS = ("auto", "nccl", "gloo")


def placement(world: int, gpus: int | None, device_count: int, backend: str) -> tuple[int, str]:
    """How ``world`` ranks run: on how many GPUs (rank ``r`` on GPU ``r % gpus``) and with which
    all-reduce backend; a ``ValueError`` naming the argument for what cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)} (got {backend!r})")
    if device_count < 1:  # (first: without --nproc, world is the GPUs counted, 0 here)
        raise ValueError("tp_decode needs a CUDA GPU (torch.cuda.device_count() is 0)")
    if world < 1:
        raise ValueError(f"--nproc must be >= 1 (got {world})")
    if gpus is None:
        gpus = min(world, device_count)
    if not 1 <= gpus <= device_count:
        raise ValueError(f"--gpus must be in [1, {device_count}] on this machine (got {gpus})")
    gpus = min(gpus, world)
    shared = world > gpus
    if backend == "auto":
        backend = "gloo" if shared else "nccl"
    if backend == "nccl" and shared:
        raise ValueError(f"--backend nccl needs a GPU per rank: {world} ranks on {gpus} GPU(s) "
                         f"(NCCL refuses two ranks on one device; --backend gloo runs them)")
    return gpus, backend


class NewestRowFence:
    """Single writer for the newest rows: rank 0 backs them up, the other ranks wait for it.

    Step ``t`` on rank 0: back up the newest rows, record interprocess event ``t % RING`` on its
    stream, publish ``t`` in a shared-memory counter. Step ``t`` on rank ``k > 0``: record the
    newest tokens in slot H without writing their host rows (``write_host=False``); before the
    step's swaps (which may miss on the token of step ``t - 1``, whose slot H the step's own
    newest token took) wait until ``t - 1`` is published, make the stream
    wait on that step's event and acknowledge ``t - 1``. A wait binds to the record queued
    before it, so rank 0 re-records a ring slot only after every rank acknowledged the step that
    used it (a wait bound to a later record would hold that rank's stream behind rank 0's
    all-reduces, which need that rank: a deadlock). The handshake runs on the host every step:
    this path cannot be captured in a CUDA graph.

    ``wait_s``: host seconds spent waiting for the other process (both directions).
    """

    RING = 4
    TIMEOUT_S = 120.0

    def __init__(self, rank: int, world: int, name: str, stream) -> None:
        import mmap

        import cupy
        import numpy as np
        import torch.distributed as dist

        self.rank, self.world, self.s = rank, world, stream
        self.path = f"/dev/shm/{name}"  # the counters: int64 [world], mode 0600
        self.rt = cupy.cuda.runtime
        self.t = 0
        self.wait_s = 0.0
        if rank == 0:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 8 * world)
            self.mm = mmap.mmap(fd, 8 * world)
            os.close(fd)
            self.ctr = np.ndarray((world,), np.int64, buffer=self.mm)
            self.ctr[:] = -1  # [0]: last step published by rank 0, [k]: last acknowledged
            self.events = [cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
                           for _ in range(self.RING)]
            handles = [[self.rt.ipcGetEventHandle(e.ptr) for e in self.events]]
        else:
            handles = [None]
        dist.broadcast_object_list(handles, src=0)
        if rank:
            fd = os.open(self.path, os.O_RDWR)
            self.mm = mmap.mmap(fd, 8 * world)
            os.close(fd)
            self.ctr = np.ndarray((world,), np.int64, buffer=self.mm)
            self.ptrs = [self.rt.ipcOpenEventHandle(h) for h in handles[0]]

    def _until(self, ready, what: str) -> None:
        if ready():
            return
        t0 = time.perf_counter()
        while not ready():
            if time.perf_counter() - t0 > self.TIMEOUT_S:
                raise RuntimeError(f"rank {self.rank}, step {self.t}: no {what} after "
                                   f"{self.TIMEOUT_S:.0f} s (did another rank die?)")
            time.sleep(0)
        self.wait_s += time.perf_counter() - t0

    def __call__(self, st) -> None:
        t, ring = self.t, self.RING
        if self.rank == 0:
            st.backup_newest()
            self._until(lambda: self.world == 1 or int(self.ctr[1:].min()) >= t - ring,
                        f"acknowledgement of step {t - ring}")
            self.rt.eventRecord(self.events[t % ring].ptr, self.s.ptr)
            self.ctr[0] = t
        else:
            st.backup_newest(write_host=False)  # slot H only: rank 0 writes the host rows
            if t > 0:
                self._until(lambda: int(self.ctr[0]) >= t - 1,
                            f"backup of step {t - 1} from rank 0")
                self.rt.streamWaitEvent(self.s.ptr, self.ptrs[(t - 1) % ring], 0)
                self.ctr[self.rank] = t - 1
        self.t += 1

    def close(self) -> None:
        """After every rank's last step (a barrier): rank 0 unlinks the counters."""
        self.ctr = None
        self.mm.close()
        if self.rank:
            for p in self.ptrs:
                self.rt.eventDestroy(p)
        else:
            os.unlink(self.path)


class PagedAdmission:
    """``Rig``'s admission on a paged shared pool: every rank, after every rank's earlier work
    on the pool is done (its stream synchronized, then a barrier), admits the same requests on
    the same pages with the KV it makes; the ranks' allocators are compared after each
    admission and once more at the end (a run's growth): a difference raises."""

    def __init__(self, rig, world: int):
        self.rig, self.world = rig, world

    def _agree(self, when: str) -> None:
        import torch.distributed as dist

        got = [None] * self.world
        dist.all_gather_object(got, self.rig.cache.pages.fingerprint())
        if len(set(got)) != 1:
            raise RuntimeError(f"the ranks' page allocators disagree {when} ({got}): their "
                               f"calls were not the same")

    def admit_all(self) -> list:
        import torch.distributed as dist

        self.rig.s.synchronize()
        self.rig.pf.synchronize()
        dist.barrier()  # nobody reads a released page any more
        rids = self.rig.admit_all()
        self._agree("after admission")
        return rids

    def close(self) -> None:
        self._agree("at the end")


def worker(rank: int, world: int, argv: list[str], pool_name: str, writer: str = "every",
           paged: bool = True, gpus: int | None = None, backend: str = "nccl") -> int:
    import cupy
    import torch
    import torch.distributed as dist

    from hisparse_cupy import HostKVPool
    from hisparse_cupy.demo import Rig, describe, from_args, report_results, run_modes
    from hisparse_cupy.interop import to_torch

    gpu = rank % (gpus or world)
    torch.cuda.set_device(gpu)
    cupy.cuda.Device(gpu).use()
    dist.init_process_group(backend, rank=rank, world_size=world,
                            **({"device_id": torch.device("cuda", gpu)} if backend == "nccl"
                               else {}))
    # every layer in the ranks' shared pool (--resident-layers N > 0: Rig refuses a given pool)
    # every request sparse (no device budget): the ranks share one host pool's rows
    cfg = from_args(["--resident-layers", "0", "--device-budget", "0"] + argv +
                    (["--quiet"] if rank else []))
    cfg.execs = ("eager",)  # the all-reduce goes through torch: eager steps only (main()
    # refuses --graph, --eager-and-graph and --side-sms)
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

    def all_reduce(h) -> None:  # bf16 partial hidden states, summed in place on s (gloo: the
        # sum on the host; its copies wait for s and s waits for them)
        with torch.cuda.stream(ts):
            dist.all_reduce(to_torch(h, stream=s).view(torch.bfloat16))

    n_rows = Rig.paged_rows(cfg) if paged else cfg.batch * cfg.max_len
    t0 = time.perf_counter()
    if rank == 0:
        pool = HostKVPool(cfg.layers, n_rows, cfg.row_bytes, shared_name=pool_name)
    dist.barrier()
    if rank:
        pool = HostKVPool.attach(pool_name, cfg.layers, n_rows, cfg.row_bytes)
    t_pool = time.perf_counter() - t0
    fence = NewestRowFence(rank, world, f"{pool_name}-fence", s) if writer == "rank0" else None
    try:
        rig = Rig(cfg, s, log, pool=pool, write_pool=rank == 0, tp=(rank, world, all_reduce),
                  backup=fence, paged=paged,
                  admission=(lambda r: PagedAdmission(r, world)) if paged else None)
        if rank == 0 and not paged:
            rig.use_cache()  # writes the prompts' KV into the shared pool
        dist.barrier()  # every rank swaps those rows from here on
        try:
            results = run_modes(cfg, rig, log)
        finally:
            rig.close()
        # each rank's table, printed by rank 0 in rank order
        name = cupy.cuda.runtime.getDeviceProperties(gpu)["name"].decode()
        for key in ("json", "png"):  # one file per rank
            path = getattr(cfg, key)
            if path:
                stem, dot, ext = path.rpartition(".")
                setattr(cfg, key, f"{stem}.rank{rank}.{ext}" if dot else f"{path}.rank{rank}")
        outs = [None] * world
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = report_results(cfg, results, {"device": name, "rank": rank, "world": world,
                                               "gpu": gpu, "backend": backend,
                                               "matmul": rig.model.gemm.kind,
                                               "pool_s": t_pool, "newest_writer": writer,
                                               "paged": paged,
                                               "fence_wait_s": fence and fence.wait_s},
                                f"rank {rank} of {world}: {name} (GPU {gpu})")
        dist.all_gather_object(outs, (rc, buf.getvalue(), t_pool, fence and fence.wait_s))
        if rank == 0:
            if backend == "gloo":
                print(f"\n{world} ranks on {gpus} GPU(s), summed through gloo (host memory, "
                      f"the host blocked at every layer): not tensor-parallel step times")
            gb = pool.n_layers * pool.layer_bytes / 1e9
            for r, (_, text, tp, waited) in enumerate(outs):
                how = ("backs up its own newest rows" if writer == "every" else
                       "backs up the newest rows for every rank" if r == 0 else
                       "waits on rank 0's backup")
                fw = "" if waited is None else f", {waited:.3f} s waiting for the other ranks"
                print(f"\n=== rank {r} (pool {'created' if r == 0 else 'attached'} and "
                      f"registered in {tp:.1f} s; newest rows: {how}{fw})\n{text.strip()}")
            print(f"\nhost memory pinned: {gb:.1f} GB per host (one shared pool, registered by "
                  f"each of the {world} ranks), {gb:.1f} GB per rank's view of it; a pool per "
                  f"rank would pin {world * gb:.1f} GB")
        rc = max(o[0] for o in outs)
    finally:
        dist.barrier()  # nobody reads the pool (or the fence) any more
        if fence is not None:
            fence.close()
        pool.close()  # rank 0, the creator, unlinks the name
        dist.destroy_process_group()
    return rc


def _spawned(rank: int, world: int, argv: list[str], pool_name: str, writer: str,
             paged: bool, gpus: int, backend: str) -> None:
    rc = worker(rank, world, argv, pool_name, writer, paged, gpus, backend)
    if rc:
        sys.exit(rc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks to start with mp.spawn (default: run under torchrun)")
    ap.add_argument("--newest-writer", choices=WRITERS, default="every",
                    help="who backs up the newest token's host rows: every rank its own "
                         "(default) or rank 0 for all, behind an interprocess event")
    ap.add_argument("--slot-layout", action="store_true",
                    help="the shared pool in the slot layout (rank 0 writes the prompts' KV) "
                         "instead of paged")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs to place the ranks on, round-robin (default: one per rank)")
    ap.add_argument("--backend", choices=BACKENDS, default="auto",
                    help="the all-reduce: nccl (a GPU per rank), gloo (through host memory; "
                         "ranks may share a GPU), auto (nccl unless ranks share a GPU)")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args()
    if args.help:
        print(__doc__)
        ap.print_help()
        from hisparse_cupy.demo import parser

        parser().print_help()
        return 0
    refused = [f for f in ("--graph", "--eager-and-graph", "--side-sms") if any(
        a == f or a.startswith(f + "=") for a in rest)]
    if refused:  # before any rank starts
        print(f"tp_decode: {' and '.join(refused)} cannot run here: the ranks' steps are eager "
              f"(the all-reduce goes through torch) on every SM (no partition)")
        return 2
    try:
        import torch
    except ImportError:
        print("tp_decode: needs PyTorch (torch.distributed): from the checkout, pip install -e "
              "'.[interop]' (the interop extra), or torch alone: pip install torch")
        return 2
    pool_name = f"hs-tp-{os.getpid()}"
    torchrun = "RANK" in os.environ and args.nproc is None
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
            print("tp_decode: one host pool serves the GPUs of one host: run every rank on "
                  "one node (torchrun --nnodes 1)")
            return 2
        pool_name = os.environ.get("HS_POOL_NAME", f"hs-tp-{os.environ.get('MASTER_PORT', '0')}")
    else:
        world = torch.cuda.device_count() if args.nproc is None else args.nproc
    try:
        gpus, backend = placement(world, args.gpus, torch.cuda.device_count(), args.backend)
    except ValueError as e:
        print(f"tp_decode: {e}")
        return 2
    if torchrun:
        return worker(int(os.environ["LOCAL_RANK"]), world, rest, pool_name, args.newest_writer,
                      not args.slot_layout, gpus, backend)
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    mp.spawn(_spawned, args=(world, rest, pool_name, args.newest_writer, not args.slot_layout,
                             gpus, backend), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
