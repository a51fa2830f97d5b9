"""The newest token's device rows, and its backup plan (``cu/newest.cu``, ``newest_rows``).

This module alone knows the kernel's instance, block and grid; :class:`hisparse_cupy.Step`
calls :func:`newest_rows` once per decode step.
"""

from __future__ import annotations

import cupy

from .. import _abi
from . import build
from .launch import Params, launch, ptr


class NewestBuffers:
    """The kernel's outputs for up to ``max_batch`` rows: ``rows`` (int32 ``[max_batch]``, the
    newest token's device row), and the one-entry device -> host plan of each row
    (``src``/``dst``/``count``) the backup copy runs for every layer."""

    def __init__(self, max_batch: int):
        self.rows = cupy.empty(max_batch, cupy.int32)
        self.src = cupy.empty((max_batch, 1), cupy.int32)
        self.dst = cupy.empty((max_batch, 1), cupy.int64)
        self.count = cupy.zeros(max_batch, cupy.int32)


def newest_rows(out: NewestBuffers, *, req, lens, lens_stride: int, num_real, key, slot_locs,
                slot_tokens, host_locs, host, hot_size: int, record: bool,
                stream, resident=None, dev_pages=None, dev_page_tokens: int = 0,
                written=None, token_slot=None) -> cupy.ndarray:
    """Queue the kernel for ``B = req.shape[0]`` rows on ``stream``; ``slot_locs`` is one
    layer's (slot H's row is the same in every layer), ``slot_tokens`` all layers'
    (``record``: slot H of every layer is marked as holding the newest token past H, and the
    backup plan to the token's host row, from ``host``'s page table
    (:class:`~hisparse_cupy._cache_rows.CacheRows`), is written). ``resident`` / ``dev_pages``
    (uint8 ``[R]``, int32 ``[R, n]`` contiguous, ``dev_page_tokens`` a page): a resident
    request's newest row is its device page's row; ``written`` (int32 ``[R]``, ``record``):
    each real row's request gets its length there (the count of tokens written that a device
    budget's moves work from). ``token_slot`` (int16 ``[L, R, n]``, ``record``): the token ->
    slot table, through which a hot slot still holding the newest token (an MTP draft
    admitted before its position got this token) is emptied. Returns ``out.rows[:B]``."""
    B = req.shape[0]
    L, R, W = slot_tokens.shape
    p = Params(_abi.NEWEST_ROWS).set(
        req=ptr(req), lens=ptr(lens), num_real=ptr(num_real), slot_locs=ptr(slot_locs),
        slot_tokens=ptr(slot_tokens), host_locs=ptr(host_locs), rows_out=ptr(out.rows),
        plan_src=ptr(out.src), plan_dst=ptr(out.dst), plan_count=ptr(out.count),
        host_pages=ptr(host.table), own_from=ptr(host.own_from), n_host_rows=host.n_rows,
        page_tokens=host.page_tokens, pages_stride=host.table.shape[1],
        slot_layer_stride=slot_tokens.strides[0] // 4, B=B, R=R, max_len=host_locs.shape[1],
        slot_stride=W, H=hot_size, host_stride=host_locs.strides[0] // 8,
        lens_stride=lens_stride, n_layers=L, record=1 if record else 0,
        resident=ptr(resident), dev_pages=ptr(dev_pages), dev_page_tokens=dev_page_tokens,
        written=ptr(written), token_slot=ptr(token_slot),
        table_layer_stride=0 if token_slot is None else token_slot.strides[0] // 2,
        table_stride=0 if token_slot is None else token_slot.strides[1] // 2,
        dev_page_stride=0 if dev_pages is None else dev_pages.shape[1])
    launch(build.kernel(build.NEWEST[key]), -(-B // _abi.NEWEST_BLOCK), _abi.NEWEST_BLOCK, p,
           stream=stream)
    return out.rows[:B]
