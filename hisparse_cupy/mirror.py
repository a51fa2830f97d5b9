"""Layer ``dst``'s device rows rearranged into layer ``src``'s slot layout
(:meth:`HotBufferCache.mirror_layer`'s first half): the row where ``src`` holds token t gets
``dst``'s own bytes of t, from the row where ``dst`` held it or else from its host row."""

from __future__ import annotations

import cupy

from .plan import copy_params, default_copy_grid, launch_copy


def mirror_rows(cache, src: int, dst: int, s) -> None:
    """Queued on stream ``s`` (CuPy's current stream must be ``s``): one layer's rows of
    scratch memory, no host synchronization."""
    R, W, n = cache.max_requests, cache.slots, cache.max_len
    span = max(n, W) + 1  # above every token a slot can name (positional ones < H)
    base = cupy.arange(R, dtype=cupy.int64).reshape(R, 1) * span
    tok_s, loc_s = cache.slot_tokens[src], cache.slot_locs[src]
    tok_d, loc_d = cache.slot_tokens[dst], cache.slot_locs[dst]
    # where dst holds each (request, token): its keys sorted, src's keys searched
    key_d = cupy.where(tok_d >= 0, base + tok_d, -1).reshape(-1)
    order = cupy.argsort(key_d)  # stable: a token held twice matches its first slot
    key_s = (base + tok_s).reshape(-1)
    at = cupy.minimum(cupy.searchsorted(key_d[order], key_s), key_s.size - 1)
    wanted = tok_s.reshape(-1) >= 0
    held = wanted & (key_d[order[at]] == key_s)
    to = loc_s.reshape(-1)
    dev = cache.device[dst]
    dev[to] = dev[cupy.where(held, loc_d.reshape(-1)[order[at]], to)]  # gathered first
    # the tokens dst did not hold: its host rows (the copy skips -1 sources)
    tok = cupy.clip(tok_s, 0, n - 1)
    hl = cache.host_locs[cupy.arange(R).reshape(R, 1), tok]
    hl = cupy.where((wanted & ~held).reshape(R, W) & (tok_s < n), hl, -1)
    cnt = cupy.full(R, W, cupy.int32)
    p = copy_params(hl, loc_s, cnt, R, None, src_base=cache.pool.device_ptr(dst),
                    src_layer_bytes=0, n_src_rows=cache.pool.n_rows,
                    dst_base=dev.data.ptr, dst_layer_bytes=0,
                    n_dst_rows=cache.device.shape[1], row_bytes=cache.row_bytes)
    launch_copy(p, grid=default_copy_grid(R, W), stream=s)
