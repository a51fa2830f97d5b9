"""The single-step twin with resident requests (issue 47's resident path; ``docs/design.md``
section 10): :meth:`ResidentTwin.single_resident` is :meth:`Twin.single` plus device pages.

About ``share`` of the request slots are resident. Their tokens' rows lie in device pages after
the hot buffers' rows, named by a shuffled page table; 2 % of its entries are -1, a page the
engine did not take. Every resident page row holds its token's bytes; the other rows are 0xEE.
The oracle of a call is :func:`hisparse_cupy.reference.resident_swap` for the resident rows and
:func:`hisparse_cupy.reference.swap_in` for the others. Given the resident rows as bad rows,
the sparse oracle leaves them as the kernels do.
"""

from __future__ import annotations

import numpy as np

from .. import reference as ref
from .twin import Twin, pattern

__all__ = ["ResidentTwin"]


class ResidentTwin(Twin):
    @classmethod
    def single_resident(cls, rng, *, share: float = 0.5, page_tokens: int = 8,
                        **single) -> ResidentTwin:
        import cupy

        from .._kernels.swap import SwapState

        self = cls.single(rng, **single)
        R, max_len, rb, P = self.R, self.max_len, self.row_bytes, page_tokens
        n_pages = -(-max_len // P)
        first = -(-self.device.shape[1] // P)  # the first page after the hot buffers' rows
        table = (rng.permutation(R * n_pages).reshape(R, n_pages) + first).astype(np.int32)
        table[rng.random(table.shape) < 0.02] = -1
        flags = (rng.random(R) < share).astype(np.uint8)
        dev = np.full((1, (first + R * n_pages) * P, rb), 0xEE, np.uint8)
        dev[0, : self.device.shape[1]] = cupy.asnumpy(self.device[0])
        for r in np.flatnonzero(flags):
            t = np.arange(max_len)
            pg = table[r, t // P]
            ok = pg >= 0
            dev[0, (pg * P + t % P)[ok]] = pattern(0, r * max_len + t[ok], rb)
        self.device = cupy.asarray(dev)
        st = self._single
        self._single = SwapState.validated(st.host_locs, st.slot_tokens, st.slot_locs, st.lru,
                                           token_slot=st.token_slot,
                                           resident=cupy.asarray(flags),
                                           page_table=cupy.asarray(table), page_tokens=P)
        self.flags, self.table, self.page_tokens = flags.astype(bool), table, P
        return self

    def expect_single(self, layer, topk, req, seq=None, nr=None):
        req = np.asarray(req)
        seq = self.lens[req] if seq is None else np.asarray(seq)
        res = ref.resident_swap(topk, req, seq, resident=self.flags, page_table=self.table,
                                page_tokens=self.page_tokens, hot_size=self.H,
                                max_len=self.max_len, num_real=nr)
        exp = super().expect_single(layer, topk, np.where(res.served, -1, req), seq, nr)
        exp.device_locs[res.served] = res.device_locs[res.served]
        exp.status[res.served] = res.status[res.served]
        return exp
