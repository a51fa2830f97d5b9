"""Prefill in one process, decode in another: each prompt's KV reaches the decode pool over NIXL.

The decode process reserves host pages for every request (:class:`hisparse_cupy.pd.KVReceiver`
over its pool) and hands the tickets (JSON) to a prefill process, which computes each prompt's
KV (the decode loop's synthetic model) and offers it (:class:`hisparse_cupy.pd.KVSender`): the
decode process READs it into those pages, one NIXL READ per request. As the arrivals
come in, the decode process admits each request on its received pages and then runs the decode
loop, whose self-check compares every attention output, bit for bit, with the same attention
over the KV the model defines: a byte lost or misplaced on the way fails it.

On a CUDA device this is the GPU decode loop (``python -m hisparse_cupy demo``, the same flags):
the prefill process makes each prompt's KV in its GPU memory with the model's kernel and NIXL
moves it from there (VRAM -> the decode pool's DRAM pages), for every offloaded mode's run;
the self-check compares with the gpu-only run. Without one (or with ``--cpu``) it is the decode
loop's NumPy reference backend, KV made and sent from host memory. The two processes share this
machine here; NIXL (UCX) spans two nodes with the same code, the ticket and a ``sent`` line
then travelling over the engines' own channel.

    pip install --no-deps nixl-cu12   # NIXL's UCX agent (its declared torch is not needed)
    python examples/pd_decode.py [--cpu] [--push] [--batch 4 --context 3000 --steps 8 ...]

``--push``: ``KVReceiver(push=True)`` and ``KVSender(pull=False)``, the prefill process WRITEs
each prompt once the decode process grants it (the decode pool's keys then go to the prefill
process: ``hisparse_cupy.pd``'s trust boundary). ``--shared-pool`` (GPU): the decode pool is a
shared ``HostKVPool``, and the prefill process, on the same node, copies each prompt from its
VRAM straight into its pages once granted (``KVSender``'s same-node path, the fastest here:
``benchmarks/bench_pd.py``), its end told over NIXL.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import numpy as np

_FLAGS = ("--push", "--shared-pool")  # this example's own flags (the rest: the demo's)


def own_help() -> str:
    """This example's own flags, printed before the decode loop's by ``--help``."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="pd_decode.py", add_help=False,
        description="Prefill in one process, decode in another; each prompt's KV reaches the "
                    "decode pool over NIXL (pip install --no-deps nixl-cu12 or nixl-cu13).",
        epilog="Every other flag is the decode loop's (python -m hisparse_cupy demo): they "
               "follow.")
    ap.add_argument("--cpu", action="store_true",
                    help="the NumPy decode loop, KV made and sent from host memory (the "
                         "default without a CUDA device)")
    ap.add_argument("--push", action="store_true",
                    help="the prefill process WRITEs each prompt once granted "
                         "(KVReceiver(push=True), KVSender(pull=False)); default: the decode "
                         "process READs")
    ap.add_argument("--shared-pool", action="store_true",
                    help="GPU: the decode pool is a shared HostKVPool and the prefill process "
                         "copies each prompt into its pages on this node")
    return ap.format_help()


def prefill(argv, gpu: bool, tickets, results) -> None:
    """The prefill process: for each ticket, the request's prompt KV written into the decode
    pool's pages (on the GPU: made in VRAM by the model's kernel, sent from there; else float32
    rows in host memory viewed as bytes); a (req_id, bytes, seconds) line back."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from hisparse_cupy.pd import KVSender

    tx = KVSender(pull=False if "--push" in argv else None)
    argv = [a for a in argv if a not in _FLAGS]
    try:
        if gpu:
            import cupy

            from hisparse_cupy.demo import Kernels, from_args, prompt_kv

            cfg, k, s = from_args(argv), Kernels(), cupy.cuda.Stream(non_blocking=True)
            with s:
                buf = cupy.empty((cfg.layers, cfg.context, cfg.row_bytes), cupy.uint8)
                req = cupy.empty(1, cupy.int32)
            tx.register(buf)  # the engine's KV buffer, registered once

            def make(t):
                with s:
                    req.fill(t["req_id"])
                prompt_kv(k, cfg, buf.data.ptr, buf[0].nbytes, req, s)
                s.synchronize()
                return buf[:, :t["n_tokens"]]
        else:
            from hisparse_cupy.demo import kv_rows

            def make(t):
                n, r = t["n_tokens"], t["req_id"]
                return np.stack([kv_rows(layer, np.full(n, r), np.arange(n))
                                 for layer in range(t["n_layers"])]).view(np.uint8)
        while (t := tickets.get()) is not None:
            copied = tx.stats["copied"]
            sent = tx.send(t, make(t))
            results.put((t["req_id"], sent.bytes, sent.seconds, tx.stats["copied"] > copied))
    finally:
        tx.close()


class Receiving:
    """The decode side of one prefill process: its receiver over ``pool`` and ``pages``, the
    child, and every request's prompt of ``cfg.context`` tokens reserved and awaited."""

    def __init__(self, argv, gpu: bool, pool, pages, fence=None):
        from hisparse_cupy.pd import KVReceiver

        self.rx = KVReceiver(pool, pages, timeout_s=120, fence=fence, push="--push" in argv)
        ctx = mp.get_context("spawn")
        self.tickets, self.results = ctx.Queue(), ctx.Queue()
        self.child = ctx.Process(target=prefill, args=(argv, gpu, self.tickets, self.results),
                                 daemon=True)
        self.child.start()
        self.where = "VRAM" if gpu else "host memory"
        self.how = "written by the prefill process" if "--push" in argv else \
            "copied by the prefill process" if "--shared-pool" in argv and gpu else \
            "read by the decode process"

    def receive(self, cfg) -> dict:
        """Every request's arrival (req_id -> Arrival); prints the transfer's figures."""
        t0 = time.perf_counter()
        for r in range(cfg.batch):
            self.tickets.put(self.rx.reserve(r, cfg.context))
        got = {}
        while len(got) < cfg.batch:
            polled = self.rx.poll()
            if polled.timed_out:
                raise SystemExit(f"pd_decode: requests {polled.timed_out} never arrived")
            got.update((a.req_id, a) for a in polled.done)
            if not self.child.is_alive() and not polled.done and len(got) < cfg.batch:
                raise SystemExit(f"pd_decode: the prefill process exited ({self.child.exitcode})")
            time.sleep(0.001)
        wall = time.perf_counter() - t0
        sent = [self.results.get(timeout=60) for _ in range(cfg.batch)]
        nbytes, secs = sum(s[1] for s in sent), sum(s[2] for s in sent)
        copied = sum(s[3] for s in sent)
        way = "over NIXL" if not copied else "copied on this node into the shared pool " \
            "(notified over NIXL)" if copied == len(sent) else f"({copied} copied on this node)"
        print(f"pd_decode: {cfg.batch} prompts of {cfg.context} tokens ({nbytes / 1e6:.1f} MB) "
              f"{self.how} from {self.where} into the decode pool's pages "
              f"{way}: its sends took {secs * 1e3:.0f} ms ({nbytes / secs / 1e9:.2f} GB/s; "
              f"the first connects), {wall:.2f} s from the reservations to the last arrival "
              f"(the prefill process's KV included)", flush=True)
        return got

    def close(self) -> None:
        try:
            self.tickets.put(None)
            self.child.join(timeout=30)
        finally:
            self.rx.close()


def admit_over_nixl(cfg, hp, host, host_locs, argv=()) -> None:
    """The NumPy decode loop's admission (``hisparse_cupy.demo._cpu.admit_local``'s duties),
    the prompts' KV received from the prefill process."""
    rec = Receiving(list(argv), False, host.view(np.uint8), hp)
    try:
        got = rec.receive(cfg)
        P = hp.page_tokens
        for r in range(cfg.batch):  # each request on its pages (a partial last one copied)
            n, whole, rest = rec.rx.admit_args(got[r])
            hp.admit(r, n, pages=whole)
            if rest is not None:
                host[:, hp.rows(r, len(whole or ()) * P, n)] = rest.view(np.float32)
            rec.rx.release(got[r])
            host_locs[r, :n] = hp.rows(r)
    finally:
        rec.close()


class GpuAdmission:
    """The GPU decode loop's admission (``hisparse_cupy.demo._loop.Rig``'s ``admission``): each
    offloaded run's requests admitted on pages the prefill process wrote from its VRAM."""

    def __init__(self, argv, rig):
        c = rig.cache
        self.rig = rig
        self.rec = Receiving(argv, True, c.pool, c.pages)

    def admit_all(self) -> list:
        got = self.rec.receive(self.rig.cfg)
        rig = self.rig
        plan = rig.resident_plan()  # with a device budget: the first k resident, as local
        return rig.log_residency([self.rec.rx.admit(rig.cache, got[r], stream=rig.s,
                                                    resident=plan[r])
                                  for r in range(rig.cfg.batch)])

    def close(self) -> None:
        self.rec.close()


def _have_gpu() -> bool:
    """Whether CuPy imports and sees a CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: the NumPy backend
        return False


def main(argv=None) -> int:
    from hisparse_cupy.demo import cpu_config, from_args
    from hisparse_cupy.pd import nixl_api

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(own_help())  # then the decode loop's flags, from its parser (which exits)
    cpu = "--cpu" in argv or not _have_gpu()
    shared = "--shared-pool" in argv
    argv = [a for a in argv if a != "--cpu"]
    if shared and cpu:
        raise SystemExit("pd_decode: --shared-pool is the GPU decode loop's (a shared HostKVPool)")
    # every layer's prompt arrives over NIXL into the pool: none is kept on the GPU, and no
    # device budget (every request sparse) unless the flags give one (--device-budget,
    # --resident-requests: the received requests admitted resident by the demo's plan)
    model_argv = ["--resident-layers", "0", "--device-budget", "0"] + [a for a in argv
                                                                       if a not in _FLAGS]
    cfg = cpu_config(model_argv) if cpu else from_args(model_argv)  # --help ends here
    try:
        nixl_api()
    except ImportError as e:
        print(f"pd_decode: {e}", file=sys.stderr)
        return 2
    if cfg.shared_prefix:
        raise SystemExit("pd_decode: --shared-prefix is the local admission's (forks of "
                         "request 0); every prompt here arrives whole")
    if cpu:
        from hisparse_cupy.demo import run_cpu

        run_cpu(model_argv, admit=lambda *a: admit_over_nixl(*a, argv=argv))
        return 0
    from hisparse_cupy import HostKVPool
    from hisparse_cupy.demo import Rig, run_gpu

    if cfg.warmup < 1:
        raise SystemExit("pd_decode: the GPU decode loop needs --warmup >= 1")
    pool = HostKVPool(cfg.layers, Rig.paged_rows(cfg), cfg.row_bytes,
                      shared_name=f"pd_decode_{os.getpid()}") if shared else None
    try:
        return run_gpu(cfg, admission=lambda rig: GpuAdmission(argv, rig), pool=pool)
    finally:
        if pool is not None:
            pool.close()


if __name__ == "__main__":
    sys.exit(main())
