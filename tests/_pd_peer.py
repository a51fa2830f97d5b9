"""The prefill side of tests/test_pd.py in a process of its own, and a DRAM -> DRAM benchmark.

``python tests/_pd_peer.py send``: one KVSender; reads JSON lines from stdin and answers each on
stdout with one line starting ``@pd `` (NIXL's own log lines are mixed in, and skipped):

- ``{"ticket": ..., "seed": s}``: send :func:`make_kv` ``(s, ...)`` (the ticket's sizes);
  answers ``{"bytes", "seconds", "xfer_id"}`` or ``{"error": "..."}``;
- ``"pull": true`` in it: the same by a ``KVSender(pull=True)`` (the receiver reads; the
  test polls its receiver before it reads the answer);
- ``{"ticket": ..., "seed": s, "partial": true}`` (a push ticket): ask for the grant as a
  WRITE does, then write layer 0 only and notify nothing (a sender dying mid-transfer), answer
  ``{"partial": true}`` and sleep: the test kills the process;
- ``{"quit": true}``: close and exit.

``python tests/_pd_peer.py bench [MiB] [reps]``: two agents of this process, one receiver's
pool of MiB MiB (L=4 layers, 4 KiB rows, pages of 64 tokens) and requests filling it, sent
``reps`` times: prints GB/s (median and best) of the whole ``send`` and ``poll`` path.
``python tests/_pd_peer.py bench2 [MiB] [reps]``: the same sizes, the sender in a child process
(``send`` mode; each send registers its freshly made kv): GB/s of the child's ``send`` calls.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time

import numpy as np

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def make_kv(seed: int, n_layers: int, n_tokens: int, row_bytes: int) -> np.ndarray:
    """A request's KV, the same bytes in every process for a seed."""
    return np.random.default_rng(seed).integers(0, 256, (n_layers, n_tokens, row_bytes),
                                                dtype=np.uint8)


def host_zeros(shape) -> np.ndarray:
    """A zeroed uint8 array on pages of its own (an anonymous mapping) for a receiver's pool:
    UCX registers host memory with CUDA a page at a time, and a heap array can share a page
    with another agent's registration (a test's earlier pool or kv), which fails."""
    n = int(np.prod(shape))
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), np.uint8, n).reshape(shape)


def say(obj) -> None:
    sys.stdout.write("@pd " + json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve() -> None:
    from hisparse_cupy.pd import KVSender

    tx, puller = KVSender(), KVSender(pull=True)  # tx: a pull, or a push ticket's WRITE
    say({"ready": tx.name})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        t = msg["ticket"]
        kv = make_kv(msg["seed"], t["n_layers"], t["n_tokens"], t["row_bytes"])
        try:
            if msg.get("partial"):  # granted, a WRITE of layer 0 only, never told
                partial(tx, t, kv)
                say({"partial": True})
                while True:
                    time.sleep(60)
            s = (puller if msg.get("pull") else tx).send(t, kv,
                                                         timeout_s=msg.get("timeout_s", 10.0))
            say({"bytes": s.bytes, "seconds": s.seconds, "xfer_id": s.xfer_id})
        except Exception as e:  # the test reads the error
            say({"error": f"{type(e).__name__}: {e}"})
    tx.close()
    puller.close()


def partial(tx, t, kv) -> None:
    """The grant of ``t``'s WRITE (the test polls its receiver), then a WRITE of layer 0's
    rows alone with no notification in its place."""
    import numpy as np

    from hisparse_cupy.pd import _nixl

    p = tx.send(t, kv, wait=False)
    runs = np.asarray(t["runs"], np.uint64).reshape(-1, 2)
    rb = t["row_bytes"]
    local = np.stack([kv.ctypes.data + runs[:, 0] * np.uint64(rb), runs[:, 1] * np.uint64(rb)],
                     -1)
    remote = np.asarray(t["descs"], np.uint64)[: len(runs)]
    part = tx._agent.initialize_xfer("WRITE", _nixl.xfer_descs(tx._agent, local, 0, "DRAM"),
                                     _nixl.xfer_descs(tx._agent, remote, 0, "DRAM"), t["agent"],
                                     b"")
    tx._agent.release_xfer_handle(p._handle)
    p._handle = part
    while p._phase in ("queued", "asking", "writing"):
        p.poll()
        time.sleep(0.001)


def bench(mib: int = 256, reps: int = 5) -> None:
    from hisparse_cupy.host._pages import HostPages
    from hisparse_cupy.pd import KVReceiver, KVSender

    L, rb, P = 4, 4096, 64
    n_pages = max(1, (mib << 20) // (L * rb * P))
    pool = host_zeros((L, n_pages * P, rb))
    pages = HostPages(n_pages, P)
    n_req = 8
    n_tok = n_pages * P // n_req
    kv = make_kv(0, L, n_pages * P, rb)
    rx, tx = KVReceiver(pool, pages), KVSender()
    tx.register(kv)
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sends = [tx.send(rx.reserve(r, n_tok), kv[:, r * n_tok:(r + 1) * n_tok], wait=False)
                 for r in range(n_req)]
        got = []
        while len(got) < n_req or not all(p.poll() for p in sends):  # (the READs: in poll)
            got += rx.poll().done
        dt = time.perf_counter() - t0
        rates.append(L * n_req * n_tok * rb / dt / 1e9)
        for a in got:
            rx.release(a)
    rx.close()
    tx.close()
    print(f"DRAM -> DRAM over NIXL/UCX, one process, {L * n_req * n_tok * rb / 2**20:.0f} MiB "
          f"in {n_req} requests: median {np.median(rates):.2f} GB/s, best {max(rates):.2f} GB/s")


def bench_procs(mib: int = 256, reps: int = 5) -> None:
    import select
    import subprocess

    from hisparse_cupy.host._pages import HostPages
    from hisparse_cupy.pd import KVReceiver

    L, rb, P, n_req = 4, 4096, 64, 8
    n_pages = max(n_req, (mib << 20) // (L * rb * P))
    pool, pages = host_zeros((L, n_pages * P, rb)), HostPages(n_pages, P)
    n_tok = n_pages // n_req * P
    rx = KVReceiver(pool, pages)
    child = subprocess.Popen([sys.executable, __file__, "send"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # (stdout read as bytes)

    got, buf = [], [b""]

    def answer():  # the child's next answer; the receiver polled meanwhile (its READs)
        while True:
            while b"\n" in buf[0]:
                line, buf[0] = buf[0].split(b"\n", 1)
                if line.startswith(b"@pd "):
                    return json.loads(line[4:])
            if select.select([child.stdout], [], [], 0.0005)[0]:
                chunk = os.read(child.stdout.fileno(), 65536)
                assert chunk, "the sender process exited"
                buf[0] += chunk
            got.extend(rx.poll().done)

    answer()
    secs = []
    for rep in range(reps):
        for r in range(n_req):
            child.stdin.write(json.dumps({"ticket": rx.reserve(r, n_tok), "seed": rep}) + "\n")
            child.stdin.flush()
            secs.append(answer()["seconds"])
        while len(got) < n_req:
            got += rx.poll().done
        for a in got:
            rx.release(a)
        got.clear()
    child.stdin.write('{"quit": true}\n')
    child.stdin.close()
    child.wait()
    rx.close()
    b = L * n_tok * rb
    print(f"DRAM -> DRAM over NIXL/UCX, two processes, {b / 2**20:.0f} MiB requests: median "
          f"{b / np.median(secs) / 1e9:.2f} GB/s, best {b / min(secs) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    if sys.argv[1:2] == ["send"]:
        serve()
    elif sys.argv[1:2] in (["bench"], ["bench2"]):
        (bench if sys.argv[1] == "bench" else bench_procs)(*(int(a) for a in sys.argv[2:4]))
    else:
        sys.exit(__doc__)
