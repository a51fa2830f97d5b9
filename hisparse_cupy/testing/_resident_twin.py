"""The stand-alone twins with resident requests (issue 47's resident path; ``docs/design.md``
section 10): :meth:`ResidentTwin.single_resident` and :meth:`ResidentTwin.multi_resident` are
:meth:`Twin.single` and :meth:`Twin.multi` plus device pages.

About ``share`` of the request slots are resident. Their tokens' rows lie in device pages after
the hot buffers' rows, named by a shuffled page table; 2 % of its entries are -1, a page the
engine did not take. Every resident page row holds its token's bytes; the other rows are 0xEE.
The oracle of a call is :func:`hisparse_cupy.reference.resident_swap` for the resident rows and
:func:`hisparse_cupy.reference.swap_in` / :func:`~hisparse_cupy.reference.multistep_swap_in`
for the others. Given the resident rows as bad rows, the sparse oracles leave them and their
state as the kernels do.
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
        """:meth:`Twin.single` with ``share`` of its requests resident."""
        import cupy

        from .._kernels.swap import SwapState

        self = cls.single(rng, **single)
        flags, table = self._add_pages(rng, share, page_tokens)
        st = self._single
        self._single = SwapState.validated(st.host_locs, st.slot_tokens, st.slot_locs, st.lru,
                                           token_slot=st.token_slot,
                                           resident=cupy.asarray(flags),
                                           page_table=cupy.asarray(table),
                                           page_tokens=page_tokens)
        return self

    @classmethod
    def multi_resident(cls, rng, *, share: float = 0.5, page_tokens: int = 8,
                       **multi) -> ResidentTwin:
        """:meth:`Twin.multi` with ``share`` of its requests resident."""
        import cupy

        self = cls.multi(rng, **multi)
        flags, table = self._add_pages(rng, share, page_tokens)
        self._multi.set_residency(cupy.asarray(flags), cupy.asarray(table), page_tokens)
        return self

    def _add_pages(self, rng, share: float, P: int):
        """The resident flags and page table; the device rows grown by the pages, each
        resident request's pages filled with its tokens' bytes."""
        import cupy

        R, max_len, rb = self.R, self.max_len, self.row_bytes
        n_pages = -(-max_len // P)
        first = -(-self.device.shape[1] // P)  # the first page after the hot buffers' rows
        table = (rng.permutation(R * n_pages).reshape(R, n_pages) + first).astype(np.int32)
        table[rng.random(table.shape) < 0.02] = -1
        flags = (rng.random(R) < share).astype(np.uint8)
        dev = np.full((1, (first + R * n_pages) * P, rb), 0xEE, np.uint8)
        dev[0, : self.device.shape[1]] = cupy.asnumpy(self.device[0])
        t = np.arange(max_len)
        for r in np.flatnonzero(flags):
            pg = table[r, t // P]
            ok = pg >= 0
            dev[0, (pg * P + t % P)[ok]] = pattern(0, r * max_len + t[ok], rb)
        self.device = cupy.asarray(dev)
        self.flags, self.table, self.page_tokens = flags.astype(bool), table, P
        return flags, table

    def _resident_rows(self, topk, req, seq, nr):
        req = np.asarray(req)
        seq = self.lens[req] if seq is None else np.asarray(seq)
        res = ref.resident_swap(topk, req, seq, resident=self.flags, page_table=self.table,
                                page_tokens=self.page_tokens, hot_size=self.H,
                                max_len=self.max_len, host_locs=self.host_locs, num_real=nr)
        return res, np.where(res.served, -1, req), seq

    def expect_single(self, layer, topk, req, seq=None, nr=None):
        res, others, seq = self._resident_rows(topk, req, seq, nr)
        exp = super().expect_single(layer, topk, others, seq, nr)
        exp.device_locs[res.served] = res.device_locs[res.served]
        exp.status[res.served] = res.status[res.served]
        return exp

    def expect_multi(self, layer, topk, req, seq=None, nr=None):
        res, others, seq = self._resident_rows(topk, req, seq, nr)
        exp = super().expect_multi(layer, topk, others, seq, nr)
        s = res.served
        exp.device_locs[s] = res.device_locs[s]
        exp.status[s] = res.status[s]
        exp.tokens[s] = np.where(res.device_locs[s] >= 0, np.asarray(topk)[s], -1)
        return exp
