"""A decode loop driven from PyTorch, without a copy between torch and the cache.

Torch owns every per-step tensor (batch, lengths, the indexer's scores, the step's new KV, the
attention outputs) and runs on its own side stream. Each step the model writes the newest
token's KV into the cache's device rows (a torch view of them), the cache backs it up, torch's
indexer picks each request's top-k, every layer swaps its top-k in (CuPy views of torch's
tensors, checked by data pointer) and a stand-in attention gathers the returned device rows
through torch views and reduces them.

Two caches run the same steps: one eagerly on a torch side stream, one as a whole decode step
captured once with ``torch.cuda.graph`` and replayed. Every row attention read is compared
with the KV the model wrote, and the two runs' rows, outputs and device rows bit for bit.

    python examples/torch_interop.py [--steps N]
"""

from __future__ import annotations

import argparse
import time

try:
    import torch
except ImportError:  # (--help still works; main says what to install)
    torch = None

from hisparse_cupy import HotBufferCache
from hisparse_cupy.interop import as_cupy, to_torch

NEEDS = ("examples/torch_interop.py needs PyTorch: from the checkout, pip install -e '.[interop]' "
         "(the interop extra: torch and jax[cuda12]), or torch alone: pip install torch")

L, H, K, P, ROW = 4, 1024, 256, 8, 1152
PROMPTS = (2100, 3000, 4500, 6000)  # every context is longer than the hot buffer
B = len(PROMPTS)


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"MISMATCH: {what}")


class StepIO:
    """The torch tensors of one decode step: inputs the engine fills, outputs it reads."""

    def __init__(self, max_len: int):
        dev = "cuda"
        self.req = torch.arange(B, dtype=torch.int32, device=dev)  # batch row b = request b
        self.lens = torch.zeros(B, dtype=torch.int32, device=dev)  # with this step's token
        self.scores = torch.zeros(B, max_len, device=dev)  # the indexer's token scores
        self.new_kv = torch.zeros(L, B, ROW, dtype=torch.uint8, device=dev)  # this step's KV
        self.topk = torch.zeros(B, K, dtype=torch.int32, device=dev)
        self.locs = torch.zeros(L, B, K, dtype=torch.int32, device=dev)  # swap outputs
        self.rows = torch.zeros(L, B, K, ROW, dtype=torch.uint8, device=dev)  # what was read
        self.out = torch.zeros(L, B, ROW, device=dev)  # attention outputs

    def load(self, lens, scores, new_kv) -> None:
        self.lens.copy_(lens)
        self.scores.copy_(scores)
        self.new_kv.copy_(new_kv)


def decode_step(cache: HotBufferCache, io: StepIO, s: torch.cuda.Stream, q: torch.Tensor):
    """One decode step, every kernel (the cache's and torch's) queued on ``s``, no host sync:
    the same code runs eagerly and under ``torch.cuda.graph(g, stream=s)``."""
    with torch.cuda.stream(s):
        # CuPy views of torch's tensors, ordered on s (DLPack), no copy
        req, lens, topk = (as_cupy(t, stream=s, name=n) for t, n in
                           ((io.req, "req"), (io.lens, "lens"), (io.topk, "topk")))
        expect(topk.data.ptr == io.topk.data_ptr() and lens.data.ptr == io.lens.data_ptr(),
               "as_cupy copied a torch tensor")
        dev = to_torch(cache.device, stream=s)  # uint8 [L, D, ROW]: every layer's device rows
        expect(dev.data_ptr() == cache.device.data.ptr, "to_torch copied the device rows")
        step = cache.begin_step(req, lens, stream=s)  # the batch is validated once per step
        newest = to_torch(step.newest_rows(), stream=s).long()  # the model writes KV here
        for layer in range(L):
            dev[layer, newest] = io.new_kv[layer]
        step.backup_newest()  # device -> host copy of those rows, every layer, one launch
        # the indexer: top-k of each request's scores over its own length
        pos = torch.arange(io.scores.shape[1], device=io.scores.device)
        scores = io.scores.masked_fill(pos >= io.lens[:, None].long(), float("-inf"))
        io.topk.copy_(scores.topk(K, dim=1).indices)
        for layer in range(L):
            got = step.swap(layer, topk)  # CuPy int32 [B, K]: rows of cache.device_rows(layer)
            locs = to_torch(got, stream=s)
            expect(locs.data_ptr() == got.data.ptr, "to_torch copied the swap's output")
            rows = dev[layer][locs.long()]  # the attention's gather: uint8 [B, K, ROW]
            x = rows.float()
            w = torch.softmax(x @ q[layer], dim=-1)  # [B, K]
            io.out[layer] = (w.unsqueeze(-1) * x).sum(dim=1)
            io.locs[layer] = locs
            io.rows[layer] = rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="decode steps (the first is eager)")
    a = ap.parse_args(argv)
    if torch is None:
        raise SystemExit(NEEDS)
    if not torch.cuda.is_available():
        raise SystemExit("this example needs PyTorch with a CUDA device")
    steps = max(2, a.steps)
    max_len = max(PROMPTS) + steps + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    side = torch.cuda.Stream()  # the eager run's stream
    cap = torch.cuda.Stream()  # the graph's stream: captured on it, replayed on it
    with torch.cuda.stream(side):
        # the KV every token will have, per layer; the prompts' part is the prefill
        truth = torch.randint(0, 256, (L, B, max_len, ROW), dtype=torch.uint8, device="cuda",
                              generator=gen)
        q = torch.randn(L, ROW, device="cuda", generator=gen) / (ROW * 128)
    cap.wait_stream(side)
    caches = []
    for s in (side, cap):
        cache = HotBufferCache(n_layers=L, max_requests=B, max_len=max_len, row_bytes=ROW,
                               hot_size=H, top_k=K, extra_page=P)
        with torch.cuda.stream(s):
            for b, n in enumerate(PROMPTS):  # the prefill KV goes device -> host, no copy
                kv = as_cupy(truth[:, b, :n], stream=s, name="kv")
                expect(kv.data.ptr == truth[:, b].data_ptr(), "as_cupy copied the prefill KV")
                expect(cache.admit(n, kv=kv, stream=s) == b, "request slots in order")
        caches.append(cache)
    eager, graphed = caches
    io_e, io_g = StepIO(max_len), StepIO(max_len)
    lens = torch.tensor(PROMPTS, dtype=torch.int32, device="cuda")
    graph = None
    t0 = time.perf_counter()
    for i in range(steps):
        with torch.cuda.stream(side):
            lens = lens + 1
            scores = torch.rand(B, max_len, device="cuda", generator=gen)
            at = (lens - 1).long()
            new_kv = truth[:, torch.arange(B, device="cuda"), at]  # this step's token's KV
            io_e.load(lens, scores, new_kv)
        cap.wait_stream(side)
        with torch.cuda.stream(cap):
            io_g.load(lens, scores, new_kv)
        decode_step(eager, io_e, side, q)  # (a) eager on the side stream
        if graph is None:  # the first step runs eagerly: kernels compile and load on first use
            decode_step(graphed, io_g, cap, q)
            cap.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=cap):  # (b) a whole decode step, captured
                decode_step(graphed, io_g, cap, q)
        else:
            with torch.cuda.stream(cap):
                graph.replay()
        side.synchronize()
        cap.synchronize()
        ids = io_e.topk.long()
        for layer in range(L):
            want = truth[layer, torch.arange(B, device="cuda")[:, None], ids]
            expect(torch.equal(io_e.rows[layer], want), f"step {i} layer {layer}: eager "
                   f"attention read rows that are not the selected tokens' KV")
        expect(torch.equal(io_e.topk, io_g.topk), f"step {i}: top-k differs")
        expect(torch.equal(io_e.locs, io_g.locs), f"step {i}: device rows differ")
        expect(torch.equal(io_e.rows, io_g.rows), f"step {i}: bytes read differ")
        expect(torch.equal(io_e.out, io_g.out), f"step {i}: attention outputs differ")
        expect(torch.equal(to_torch(eager.device), to_torch(graphed.device)),
               f"step {i}: the caches' device rows differ")
        if i == 0 or i == steps - 1:
            print(f"step {i}: lens {lens.tolist()}, {'eager' if i == 0 else 'graph replay'} "
                  f"checked")
    dt = time.perf_counter() - t0
    print(f"{steps} decode steps x {L} layers x {B} requests (K {K}, H {H}, rows {ROW} B) in "
          f"{dt:.2f} s: torch tensors in and out with no copy (data pointers checked); every "
          f"row attention read held its token's KV; the captured torch.cuda.graph replays "
          f"equal the eager side-stream steps bit for bit (top-k, device rows, bytes read, "
          f"attention outputs, the caches' device rows)")
    for c in caches:
        c.close()


if __name__ == "__main__":
    main()
