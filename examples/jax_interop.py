"""A decode loop driven from eager JAX, without a copy between JAX and the cache.

Each step a jitted JAX indexer picks every request's top-k (a JAX array on the GPU), the swap
reads it through a CuPy view (no copy, ordered after the jitted computation on the device), and
a jitted JAX attention gathers the returned device rows through JAX views of the cache's memory
(``unsafe_buffer_pointer()`` equals the CuPy pointer) and reduces them. Nothing synchronizes
the host inside the loop: every hand-over is ordered on the device (the DLPack stream
protocol), and the next swap of a layer waits, on the device, for the JAX computation that read
its rows. At the end every gathered row and every reduction is compared with NumPy.

The kernels are called eagerly between jitted functions: they are not XLA custom calls and
cannot run inside ``jax.jit``.

    python examples/jax_interop.py [--steps N]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with CuPy

import cupy  # noqa: E402
import numpy as np  # noqa: E402

try:
    import jax
    import jax.numpy as jnp
except ImportError:  # (--help still works; main says what to install)
    jax = jnp = None

from hisparse_cupy import HotBufferCache  # noqa: E402
from hisparse_cupy.interop import as_cupy, to_jax  # noqa: E402

NEEDS = ("examples/jax_interop.py needs JAX: from the checkout, pip install -e '.[interop]' (the "
         "interop extra: torch and jax[cuda12]), or JAX alone: pip install 'jax[cuda12]'")

L, H, K, P, ROW = 4, 1024, 256, 8, 1152
PROMPTS = (1500, 2600, 3700)  # every context is longer than the hot buffer
B = len(PROMPTS)


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"MISMATCH: {what}")


def _jit(fn=None, **kw):
    """``jax.jit`` (with ``kw``), or without JAX the function as it is (main says what to
    install)."""
    if jax is None:
        return fn if fn is not None else (lambda f: f)
    return jax.jit(fn, **kw) if fn is not None else functools.partial(jax.jit, **kw)


@_jit(static_argnames="n")
def indexer(key, lens, n):
    """Top-k positions of random scores over each request's length (< n): int32 [B, K]."""
    scores = jax.random.uniform(key, (B, n))
    pos = jnp.arange(scores.shape[1])
    scores = jnp.where(pos[None, :] < lens[:, None], scores, -jnp.inf)
    return jax.lax.top_k(scores, K)[1].astype(jnp.int32)


@_jit
def attend(rows, locs):
    """The rows a layer's swap selected (uint8 [B, K, ROW]) and their column sums (uint32)."""
    got = rows[locs]
    return got, got.astype(jnp.uint32).sum(axis=1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    if jax is None:
        raise SystemExit(NEEDS)
    if not any(d.platform == "gpu" for d in jax.devices()):
        raise SystemExit(f"this example needs JAX with a GPU (jax[cuda12]); JAX sees "
                         f"{jax.devices()}")
    steps = max(1, a.steps)
    max_len = max(PROMPTS) + steps
    rng = np.random.default_rng(0)
    truth = rng.integers(0, 256, (L, B, max_len, ROW), dtype=np.uint8)  # every token's KV
    s = cupy.cuda.Stream(non_blocking=True)  # the cache's stream
    cache = HotBufferCache(n_layers=L, max_requests=B, max_len=max_len, row_bytes=ROW,
                           hot_size=H, top_k=K, extra_page=P)
    # The prefill KV on the GPU as a JAX array goes device -> host without a copy. A view keeps
    # the JAX buffer allocated but not its pending reads: every JAX array the loop hands over
    # stays referenced until s has finished with it (the end of the run here).
    kv = jnp.asarray(truth)
    kv_c = as_cupy(kv, stream=s, name="kv")
    expect(kv_c.data.ptr == kv.unsafe_buffer_pointer(), "as_cupy copied the prefill KV")
    for b, n in enumerate(PROMPTS):
        expect(cache.admit(n, kv=kv_c[:, b, :n], stream=s) == b, "request slots in order")
    req = as_cupy(jnp.arange(B, dtype=jnp.int32), stream=s, name="req")
    lens_j = jnp.asarray(PROMPTS, dtype=jnp.int32)
    outs = [cupy.empty((B, K), cupy.int32) for _ in range(L)]  # one output buffer per layer
    key = jax.random.key(0)
    record = []
    t0 = time.perf_counter()
    for i in range(steps):
        lens_j = lens_j + 1  # with this step's token
        key, sub = jax.random.split(key)
        topk_j = indexer(sub, lens_j, max_len)  # dispatched: JAX runs it on its own stream
        lens = as_cupy(lens_j, stream=s, name="seq_lens")  # s waits for it on the device
        topk = as_cupy(topk_j, stream=s, name="top_k")
        expect(topk.data.ptr == topk_j.unsafe_buffer_pointer(), "as_cupy copied the top-k")
        step = cache.begin_step(req, lens, stream=s)
        newest = step.newest_rows()  # the model writes this step's KV there (all layers)
        at = np.asarray(PROMPTS) + i  # the new token's position
        new_j = jnp.asarray(truth[:, np.arange(B), at])  # the model's output, [L, B, ROW]
        with s:  # a JAX array cannot be written in place: CuPy copies the B new rows in
            cache.device[:, newest] = as_cupy(new_j, stream=s, name="new_kv")
        step.backup_newest()
        results = []
        for layer in range(L):
            got = step.swap(layer, topk, out=outs[layer])
            rows_j = to_jax(cache.device_rows(layer), stream=s)  # JAX reads after the swap
            locs_j = to_jax(got, stream=s)
            expect(rows_j.unsafe_buffer_pointer() == cache.device_rows(layer).data.ptr and
                   locs_j.unsafe_buffer_pointer() == got.data.ptr, "to_jax copied")
            res = attend(rows_j, locs_j)
            # the next step's swap rewrites these rows and this buffer: s waits for JAX's read
            as_cupy(res[1], stream=s, name="attention result")
            results.append(res)
        record.append((topk_j, results, lens_j, new_j))
    s.synchronize()  # the host waits once: for the cache's stream, then for JAX's results
    for i, (topk_j, results, _, _) in enumerate(record):
        topk_np = np.asarray(topk_j)
        for layer, (got_j, sums_j) in enumerate(results):
            want = truth[layer, np.arange(B)[:, None], topk_np]
            expect(np.array_equal(np.asarray(got_j), want),
                   f"step {i} layer {layer}: JAX gathered rows that are not the tokens' KV")
            expect(np.array_equal(np.asarray(sums_j), want.astype(np.uint32).sum(axis=1)),
                   f"step {i} layer {layer}: JAX's reduction differs from NumPy's")
    dt = time.perf_counter() - t0
    print(f"{steps} decode steps x {L} layers x {B} requests (K {K}, H {H}, rows {ROW} B) in "
          f"{dt:.2f} s: JAX top-k in and device rows out with no copy (pointers checked), no "
          f"host sync in the loop; every row JAX gathered held its token's KV and every "
          f"reduction equals NumPy's")
    cache.close()


if __name__ == "__main__":
    main()
