"""A token's KV rewritten after a multi-step swap took it into a hot slot (an MTP draft the
verify step rejected: its position gets a new token, whose KV the engine writes with
``write_host``): the next swap must serve the new bytes, not the hot slot's old ones.

The CPU test runs the step API's NumPy model (``tests/_stepmodel.py``: the specification the
step fuzz checks the cache against); the GPU test runs :class:`HotBufferCache`.
"""

from __future__ import annotations

import numpy as np
import pytest

L, H, K, P, S, MAX_LEN, ROW = 2, 4, 4, 2, 3, 64, 16


def _kv(tokens, version: int) -> np.ndarray:
    """Rows whose bytes name their token and its version: ``2 * token + version`` (mod 256)."""
    t = np.asarray(list(tokens), np.int64)
    return np.broadcast_to(((2 * t + version) % 256).astype(np.uint8)[None, :, None],
                           (L, t.size, ROW)).copy()


SIZES = dict(n_layers=L, max_requests=1, max_len=MAX_LEN, row_bytes=ROW, hot_size=H, top_k=K,
             extra_page=P, max_steps=S)


def _step(c, xp, rid: int, lens: list, tk: list, version: int = 0) -> list:
    """One decode step of request ``rid`` at ``lens`` (several: a multi-step call, ``tk`` its
    ``[S, K]`` top-k; one: single-step, ``tk`` ``[1, K]``): the newest token's row written as
    the model writes it (at ``version``), backed up, every layer swapped. Returns the swaps'
    outputs."""
    multi = len(lens) > 1
    step = c.begin_step(xp.asarray([rid], xp.int32),
                        xp.asarray([lens] if multi else lens, xp.int32))
    rows = step.newest_rows()
    for layer in range(L):
        c.device_rows(layer)[rows] = xp.asarray(_kv([lens[0] - 1], version)[layer])
    step.backup_newest()
    top = xp.asarray(np.asarray([tk] if multi else tk, np.int32))
    out = [step.swap(layer, top) for layer in range(L)]
    step.finish()
    return out


def _drafts_then_rewrite(c, xp, rows_of):
    """Request of 10 tokens. Call 1 (lengths 11, 12, 13): drafts 11 and 12 written to the host
    (version 0) and selected, so the swap takes them into hot slots. Draft 12 is rejected: the
    engine writes position 12's new token (version 1). Call 2 (lengths 12, 13, 14) selects 12:
    it must read version 1. Returns the bytes call 2 served for token 12, per layer."""
    rid = c.admit(10, kv=_kv(range(10), 0))
    c.write_host(rid, 11, _kv([11, 12], 0))
    _step(c, xp, rid, [11, 12, 13], [[0, 1, 2, 3], [0, 1, 2, 3], [12, 11, 1, 2]])
    c.write_host(rid, 11, _kv([11], 0))  # 11 accepted (same bytes), 12 rejected: rewritten
    c.write_host(rid, 12, _kv([12], 1))
    out = _step(c, xp, rid, [12, 13, 14], [[0, 1, 2, 3], [12, 0, 1, 2], [12, 13, 1, 2]])
    return [rows_of(c, layer, out[layer]) for layer in range(L)]


def test_a_rewritten_draft_is_served_new_in_the_model():
    import _stepmodel

    c = _stepmodel.ModelCache(**SIZES)

    def rows_of(c, layer, out):
        return [int(c.device[layer, out[0, s, 0], 0]) for s in (1, 2)]

    for layer, got in enumerate(_drafts_then_rewrite(c, np, rows_of)):
        assert got == [25, 25], (layer, got)  # 2 * 12 + 1: the new token's bytes


@pytest.mark.gpu
def test_a_rewritten_draft_is_served_new():
    cupy = pytest.importorskip("cupy")
    from hisparse_cupy import HotBufferCache

    c = HotBufferCache(**SIZES)

    def rows_of(c, layer, out):
        o = cupy.asnumpy(out)
        rows = cupy.asnumpy(c.device_rows(layer))
        return [int(rows[o[0, s, 0], 0]) for s in (1, 2)]

    for layer, got in enumerate(_drafts_then_rewrite(c, cupy, rows_of)):
        assert got == [25, 25], (layer, got)
    c.close()


def _rejected_as_newest(c, xp, rows_of):
    """The common MTP path: the first rejected draft's position becomes the next step's newest
    token, whose KV the model writes in place (``newest_rows``) and ``backup_newest`` copies to
    the host. Call 1 (lengths 11, 12, 13) takes drafts 11 and 12 into hot slots; draft 11 is
    rejected, and call 2 (lengths 12, 13, 14, no miss: nothing evicted) has its correction token
    (version 1) at 11; call 3, single-step at length 13, selects 11. Returns the bytes served
    for it, per layer."""
    rid = c.admit(10, kv=_kv(range(10), 0))
    c.write_host(rid, 11, _kv([11, 12], 0))
    _step(c, xp, rid, [11, 12, 13], [[0, 1, 2, 3], [0, 1, 2, 3], [12, 11, 1, 2]])
    _step(c, xp, rid, [12, 13, 14], [[1, 2, 11, -1], [1, 2, 11, -1], [1, 2, 11, -1]], 1)
    out = _step(c, xp, rid, [13], [[11, 0, 1, 2]])
    return [rows_of(c, layer, out[layer]) for layer in range(L)]


def test_a_rejected_draft_rewritten_as_the_next_newest_token_in_the_model():
    import _stepmodel

    c = _stepmodel.ModelCache(**SIZES)

    def rows_of(c, layer, out):
        assert out[0, 0] >= 0
        return int(c.device[layer, out[0, 0], 0])

    assert _rejected_as_newest(c, np, rows_of) == [23] * L  # 2 * 11 + 1: the correction's


@pytest.mark.gpu
def test_a_rejected_draft_rewritten_as_the_next_newest_token():
    cupy = pytest.importorskip("cupy")
    from hisparse_cupy import HotBufferCache

    c = HotBufferCache(**SIZES)

    def rows_of(c, layer, out):
        r = int(cupy.asnumpy(out)[0, 0])
        assert r >= 0
        return int(cupy.asnumpy(c.device_rows(layer)[r, 0]))

    assert _rejected_as_newest(c, cupy, rows_of) == [23] * L
    c.close()
