"""The decode loop without a GPU: the same algorithm on the NumPy reference backend, small.

The cache is :mod:`hisparse_cupy.reference` (the oracle the kernels are tested against), the
"device" rows a NumPy array that each swap's miss plan is copied into; the attention is the
same softmax(q.k) over the selected rows in NumPy. Every layer runs its own swap (the offload
mode; the IndexCache overlap needs streams), and its attention output must equal, bit for bit,
the output of the same attention over the true KV of the selected tokens (the GPU-only mode).

The host pool is paged (:class:`hisparse_cupy.host._pages.HostPages`, pages of
:data:`PAGE_TOKENS` tokens): each request's pages are taken at admission and as it grows, one
step ahead of the token written there. With ``--shared-prefix N`` requests 1.. are admitted as
forks of request 0 at N tokens (its whole pages below N shared, a partial page copied), and a
request never writes a shared page (checked).
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from .. import reference as ref
from .._cli.usage import UsageError
from ..host import HostPages
from ._config import HEADS, PAGE_TOKENS
from ._config import ROW_VALUES as ROW
from ._config import V_VALUES as ROW_V


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def kv_rows(layer: int, slot: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """bf16 rows (as float32, exact) of tokens ``(slot, pos)`` in ``layer``: [n, 576]."""
    key = (np.uint64(layer) << np.uint64(56)) ^ (slot.astype(np.uint64) << np.uint64(40)) ^ \
        pos.astype(np.uint64)
    h = _mix(_mix(key)[:, None] + np.arange(ROW, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    u = ((h >> np.uint64(40)).astype(np.int64) - (1 << 23)).astype(np.float32) * np.float32(2**-23)
    return (u.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def attention(q: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """softmax(q . k) v per head: q [HEADS, 576] (unit rows), rows [K, 576] -> [HEADS, 512]."""
    s = (q @ rows.T) * np.float32(4.0)
    s = np.exp(s - s.max(axis=1, keepdims=True))
    return (s / s.sum(axis=1, keepdims=True)) @ rows[:, :ROW_V]




def _stream(cfg, n_full: int, rng):
    """``--topk-model lru``'s generator (None for the drift model)."""
    if cfg.topk_model != "lru":
        return None
    from ._topk_model import TopKStream, shape_for

    return TopKStream(shape_for(cfg.step_overlap, cfg.layer_overlap, cfg.recent), n_full=n_full,
                      batch=cfg.batch, top_k=cfg.top_k, context=cfg.context, rng=rng)


def fits(nbytes: int, what: str) -> None:
    """``SystemExit`` naming ``what`` when ``nbytes`` exceed the memory this machine has
    available (``MemAvailable``; not checked where there is no ``/proc/meminfo``)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return
    if nbytes > avail:
        raise UsageError(f"the NumPy decode loop at {what} needs {nbytes / 1e9:.1f} GB of host "
                         f"memory; {avail / 1e9:.1f} GB is available: lower --context, --batch "
                         f"or --layers")


def admit_local(cfg, hp: HostPages, host: np.ndarray, host_locs: np.ndarray) -> None:
    """Admission: request ``r``'s prompt KV (:func:`kv_rows` of ``(r, 0..context)``) into its
    pages of ``host`` (float32 ``[L, rows, 576]``), request 0 whole, the others sharing its
    first ``--shared-prefix`` tokens; ``host_locs[r, :context]`` its rows."""
    N = cfg.shared_prefix
    for r in range(cfg.batch):
        fork = N and r > 0
        for src, dst, cnt in hp.admit(r, cfg.context, prefix=(0, N) if fork else None):
            host[:, dst:dst + cnt] = host[:, src:src + cnt]  # the partial page, copied
        start = N if fork else 0
        rows = hp.rows(r, start, cfg.context)
        for layer in range(cfg.layers):
            host[layer, rows] = kv_rows(layer, np.full(rows.size, r),
                                        np.arange(start, cfg.context))
        host_locs[r, :cfg.context] = hp.rows(r)


def run(cfg, admit=admit_local) -> dict:
    """The decode loop of ``cfg`` (a :class:`hisparse_cupy.demo._config.Config`, see
    :func:`hisparse_cupy.demo._args.cpu_config`) on the NumPy backend: ``warmup + steps`` steps,
    every layer's attention checked bit for bit against gpu-only; returns the per-step record
    (also written to ``cfg.json`` when set). A failed check raises ``SystemExit``. ``admit``:
    how the prompts' KV gets into the pool (:func:`admit_local`'s signature and duties;
    ``examples/pd_decode.py`` receives it from another process over NIXL)."""
    t_start = time.perf_counter()
    layers, batch, context = cfg.layers, cfg.batch, cfg.context
    hot, top_k, page, recent = cfg.hot, cfg.top_k, cfg.extra_page, cfg.recent
    steps = cfg.warmup + cfg.steps
    pattern = cfg.pattern_obj()
    full = pattern.full
    max_len = context + steps
    R, W, M = batch, hot + page, max(1, round(cfg.new_share * top_k))
    rng = np.random.default_rng(cfg.seed)
    N = cfg.shared_prefix
    # the slot layout's rows, and a page to copy a received prompt's partial last page into
    # before its own goes back (examples/pd_decode.py)
    hp = HostPages(R * (-(-max_len // PAGE_TOKENS)) + 1, PAGE_TOKENS)
    need = 4 * layers * ROW * (hp.n_rows + R * W) + 8 * R * max_len
    fits(need, f"--layers {layers} --batch {R} --context {context} (the host pool and the "
               f"device rows, float32)")
    if not cfg.quiet:
        print(f"setting up: {R} prompts of {context} tokens x {layers} layers into a host pool "
              f"of {need / 1e9:.2f} GB (NumPy; the first step follows)", flush=True)
    host = np.zeros((layers, hp.n_rows, ROW), np.float32)  # the pinned pool
    host_locs = np.full((R, max_len), -1, np.int64)
    admit(cfg, hp, host, host_locs)
    device = np.zeros((layers, R * W, ROW), np.float32)
    if not cfg.quiet:
        print(f"set up in {time.perf_counter() - t_start:.1f} s", flush=True)
    slot_locs = (np.arange(R)[:, None] * W + np.arange(W)).astype(np.int32)
    tokens = np.full((layers, R, W), -1, np.int32)
    tokens[:, :, hot] = context - 1  # admission: the newest token in slot H
    device[:, slot_locs[:, hot]] = host[:, host_locs[:, context - 1]]
    lru = np.tile(np.arange(hot, dtype=np.int16), (layers, R, 1))
    perm = np.stack([rng.permutation(context) for _ in range(len(pattern.full_layers))])
    stream, drawn = _stream(cfg, len(pattern.full_layers), rng), []
    req = np.arange(R)
    record = []
    for t in range(steps):
        lens = np.full(R, context + t + 1)
        newest = lens - 1
        for r in range(R):  # the newest token's page, taken before the step writes it
            hp.grow(r, int(lens[r]))
            if newest[r] < hp.own_from(r):
                raise SystemExit(f"step {t}: request {r} would write a shared host page")
            host_locs[r, newest[r]] = hp.rows(r, int(newest[r]), int(lens[r]))[0]
        for layer in range(layers):  # the step's KV: its device row (slot H) and its backup
            kv = kv_rows(layer, req, newest)
            device[layer, slot_locs[req, hot]] = kv
            host[layer, host_locs[req, newest]] = kv
        q = rng.standard_normal((R, HEADS, ROW)).astype(np.float32)
        q /= np.linalg.norm(q, axis=2, keepdims=True)
        misses = 0
        if stream is not None:
            drawn.append(stream.step(lens))
        for layer in range(layers):
            if full[layer]:
                j = pattern.full_layers.index(layer)
                nrec = min(recent, t + 1)
                win = (t * M + 7919 * req[:, None] + np.arange(top_k - nrec)) % context
                topk = np.concatenate([perm[j][win], newest[:, None] - np.arange(nrec)[::-1]],
                                      axis=1).astype(np.int32) if stream is None else drawn[-1][j]
            res = ref.swap_in(topk, req, lens, host_locs=host_locs, slot_tokens=tokens[layer],
                              slot_locs=slot_locs, lru=lru[layer], hot_size=hot,
                              n_host_rows=hp.n_rows)
            if res.status.any() or (res.device_locs < 0).any():
                raise SystemExit(f"step {t} layer {layer}: the swap reported {res.status}")
            for b in range(R):  # the planned copy
                n = res.plan_count[b]
                device[layer, res.plan_dst[b, :n]] = host[layer, res.plan_src[b, :n]]
            misses += int(res.plan_count.sum())
            ref.check_invariants(tokens[layer], slot_locs, lru[layer], hot)
            for b in range(R):  # gpu-only: the true KV of the selected tokens (its owner's)
                owner = np.where((b > 0) & (topk[b] < N), 0, b)
                direct = attention(q[b], kv_rows(layer, owner, topk[b]))
                offload = attention(q[b], device[layer, res.device_locs[b]])
                if not np.array_equal(direct.view(np.uint32), offload.view(np.uint32)):
                    raise SystemExit(f"SELF-CHECK FAILED: step {t}, layer {layer}, request {b}: "
                                     f"the offloaded attention output differs from gpu-only")
        record.append({"step": t, "seq_len": int(lens[0]),
                       "misses_per_layer_and_request": misses / (layers * R)})
        if not cfg.quiet:
            print(f"step {t:3d}  seq_len {lens[0]}  misses per layer and request "
                  f"{misses / (layers * R):6.1f} of {top_k}  invariants hold, attention outputs "
                  f"bit-identical to gpu-only")
    wall = time.perf_counter() - t_start
    used = hp.n_pages - hp.free_pages
    print(f"{steps} steps x {layers} layers x {R} requests on the NumPy reference backend in "
          f"{wall:.1f} s: self-check passed; host pool: {used} pages of {PAGE_TOKENS} tokens in "
          f"use ({used * PAGE_TOKENS} rows per layer; the slot layout takes {R * max_len})")
    hp.check()
    result = {"backend": "numpy", "config": dataclasses.asdict(cfg), "wall_s": wall,
              "self_check": "passed", "steps": record, "host_pages_used": used}
    if stream is not None:
        from ._topk_model import shape_report

        result["topk_shape"] = shape_report(stream.shape, drawn, stream.initial, cfg.hot)
    if cfg.json:
        with open(cfg.json, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {cfg.json}")
    return result
