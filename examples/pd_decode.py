"""Prefill in one process, decode in another: each prompt's KV reaches the decode pool over NIXL.

The decode process reserves host pages for every request (:class:`hisparse_cupy.pd.KVReceiver`
over its pool) and hands the tickets (JSON) to a prefill process, which computes each prompt's
KV (the decode loop's synthetic model) and writes it into those pages
(:class:`hisparse_cupy.pd.KVSender`: one NIXL WRITE per request, notified). As the arrivals
come in, the decode process admits each request on its received pages and then runs the decode
loop, whose self-check compares every attention output, bit for bit, with the same attention
over the KV the model defines: a byte lost or misplaced on the way fails it.

This runs the decode loop's NumPy reference backend (``hisparse_cupy.demo``, no GPU needed; the
same flags). The two processes share this machine here; NIXL (UCX) spans two nodes with the
same code, the ticket and a ``sent`` line then travelling over the engines' own channel.

    pip install --no-deps nixl-cu12   # NIXL's UCX agent (its declared torch is not needed)
    python examples/pd_decode.py [--batch 4 --context 3000 --steps 8 ...]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import numpy as np


def prefill(tickets, results) -> None:
    """The prefill process: for each ticket, the request's prompt KV (float32 rows viewed as
    bytes) written into the decode pool's pages; a (req_id, bytes, seconds) line back."""
    import os

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from hisparse_cupy.demo.cpu import kv_rows
    from hisparse_cupy.pd import KVSender

    tx = KVSender()
    try:
        while (t := tickets.get()) is not None:
            n, r = t["n_tokens"], t["req_id"]
            kv = np.stack([kv_rows(layer, np.full(n, r), np.arange(n))
                           for layer in range(t["n_layers"])])
            sent = tx.send(t, kv.view(np.uint8))
            results.put((r, sent.bytes, sent.seconds))
    finally:
        tx.close()


def admit_over_nixl(cfg, hp, host, host_locs) -> None:
    """The decode loop's admission (``hisparse_cupy.demo.cpu.admit_local``'s duties), the
    prompts' KV received from the prefill process."""
    from hisparse_cupy.pd import KVReceiver

    ctx = mp.get_context("spawn")
    tickets, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=prefill, args=(tickets, results), daemon=True)
    child.start()
    rx = KVReceiver(host.view(np.uint8), hp, timeout_s=120)
    t0 = time.perf_counter()
    try:
        for r in range(cfg.batch):
            tickets.put(rx.reserve(r, cfg.context))
        tickets.put(None)
        got = {}
        while len(got) < cfg.batch:
            polled = rx.poll()
            if polled.timed_out:
                raise SystemExit(f"pd_decode: requests {polled.timed_out} never arrived")
            got.update((a.req_id, a) for a in polled.done)
            if not child.is_alive() and not polled.done and len(got) < cfg.batch:
                raise SystemExit(f"pd_decode: the prefill process exited ({child.exitcode})")
            time.sleep(0.001)
        wall = time.perf_counter() - t0
        P = hp.page_tokens
        for r in range(cfg.batch):  # each request on its pages (a partial last one copied)
            n, whole, rest = rx.admit_args(got[r])
            hp.admit(r, n, pages=whole)
            if rest is not None:
                host[:, hp.rows(r, len(whole or ()) * P, n)] = rest.view(np.float32)
            rx.release(got[r])
            host_locs[r, :n] = hp.rows(r)
        sent = [results.get(timeout=60) for _ in range(cfg.batch)]
    finally:
        rx.close()
        child.join(timeout=30)
    nbytes, secs = sum(b for _, b, _ in sent), sum(t for *_, t in sent)
    print(f"pd_decode: {cfg.batch} prompts of {cfg.context} tokens ({nbytes / 1e6:.1f} MB) "
          f"written by the prefill process into the decode pool's pages over NIXL: its sends "
          f"took {secs * 1e3:.0f} ms ({nbytes / secs / 1e9:.2f} GB/s; the first connects), "
          f"{wall:.2f} s from the reservations to the last arrival (the prefill process's "
          f"start and its KV included)", flush=True)


def main(argv=None) -> int:
    from hisparse_cupy.demo.config import cpu_config
    from hisparse_cupy.demo.cpu import run
    from hisparse_cupy.pd import nixl_api

    try:
        nixl_api()
    except ImportError as e:
        print(f"pd_decode: {e}", file=sys.stderr)
        return 2
    cfg = cpu_config(argv)
    if cfg.shared_prefix:
        raise SystemExit("pd_decode: --shared-prefix is the local admission's (forks of "
                         "request 0); every prompt here arrives whole")
    run(cfg, admit=admit_over_nixl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
