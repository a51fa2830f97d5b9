"""Single-step swap-in: resolve (hash + LRU, a cluster of blocks per request) then the
planned copy.

See ``cu/swap.cu`` for the exact semantics; :func:`hisparse_cupy.reference.swap_in` is the
same algorithm in NumPy.

The resolve runs C blocks per batch row, a thread-block cluster sharing the row's hash through
distributed shared memory (sm_90+): :func:`resolve_cluster` picks the largest C of 1, 2, 4, 8
for which every row's cluster runs at once on the device, so a small batch is not resolved on
one SM per request. ``HISPARSE_CUPY_RESOLVE_CLUSTER=N`` (or
:func:`hisparse_cupy.testing.knobs.resolve_cluster`) fixes C instead (measuring); the result
does not depend on C.

A state with a token -> slot table (``SwapState.token_slot``, the cache's default) runs the
table instance instead, one block per row: K lookups replace the hash of the top-k and its probe
by every hot slot (benchmarks/NOTES.md, "A token -> slot table").
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import cupy
import numpy as np

from .. import _abi, _checks
from .._checks import ArrayLike, StreamLike
from .._device import Ptr
from . import build
from .launch import (
    CallWriter,
    Launcher,
    Params,
    Structs,
    as_stream,
    compute_capability,
    field_words,
    launcher,
    max_active_clusters,
    max_shared_memory,
    ptr,
    resolve_pdl,
)
from .plan import (
    CopyLaunch,
    MissPlan,
    Rows,
    array_rows,
    copy_launcher,
    copy_rows,
    default_copy_grid,
)


def resolve_smem_bytes(top_k: int, hot_size: int, block: int = _abi.RESOLVE_BLOCK) -> int:
    """Dynamic shared memory of a resolve block of ``block`` threads (``_abi.SMEM``)."""
    return _abi.smem_bytes("SWAP_RESOLVE", **_abi.resolve_sizes(top_k, hot_size, block))


def cluster_arg(n) -> int | None:
    """A fixed cluster size checked: 1, 2, 4 or 8, or None (``"auto"``, ``""``): automatic."""
    if n is None or n == "" or n == "auto":
        return None
    try:
        c = int(n)
    except (TypeError, ValueError):
        c = 0
    if c not in (1, 2, 4, 8):
        raise ValueError(f"resolve cluster must be 1, 2, 4 or 8 blocks (or None: automatic), "
                         f"got {n!r}")
    return c


# Measuring overrides, data only (hisparse_cupy.testing.knobs sets them, engines never do):
# "cluster", the resolve's blocks per batch row (None: resolve_cluster chooses).
FIXED: dict[str, int | None] = {
    "cluster": cluster_arg(os.environ.get("HISPARSE_CUPY_RESOLVE_CLUSTER"))}


def resolve_cluster(key, batch: int, top_k: int, hot_size: int) -> int:
    """Blocks per batch row of the resolve for ``batch`` rows on this device: 8 or 4 when that
    many clusters of them run at once, else 1 (``key``: the (req, len) dtypes of the call).

    Measured on the H200 (benchmarks/NOTES.md, "The resolve over a cluster of blocks"): a
    cluster of 2 never beat one block, and a cluster that does not fit in one wave loses to
    one block per row.
    """
    if compute_capability() < 90:
        return 1
    if FIXED["cluster"] is not None:
        return FIXED["cluster"]
    kernel = build.kernel(build.RESOLVE[_abi.RESOLVE_CLUSTER_BLOCK][key])
    smem = resolve_smem_bytes(top_k, hot_size, _abi.RESOLVE_CLUSTER_BLOCK)
    for c in (8, 4):
        if max_active_clusters(kernel, _abi.RESOLVE_CLUSTER_BLOCK, smem, c) >= batch:
            return c
    return 1


_launches: dict[tuple, tuple[Launcher, tuple[int, int, int]]] = {}


def resolve_launch(key, B: int, K: int, H: int,
                   table: bool = False) -> tuple[Launcher, tuple[int, int, int]]:
    """The resolve's launcher and grid for B rows of K entries, H hot slots (``key``: the
    (req, len) dtypes of the call; ``table``: the state has a token -> slot table, read by one
    block per row); chosen once per shape, device and fixed cluster size, so an eager call pays
    one dictionary lookup."""
    ck = (key, B, K, H, table, cupy.cuda.runtime.getDevice(), FIXED["cluster"])
    got = _launches.get(ck)
    if got is None:
        c = 1 if table else resolve_cluster(key, B, K, H)
        block = _abi.RESOLVE_BLOCK if c == 1 else _abi.RESOLVE_CLUSTER_BLOCK
        name = build.RESOLVE_TABLE[key] if table else build.RESOLVE[block][key]
        la = launcher(build.kernel(name), block, resolve_smem_bytes(K, H, block), False, c)
        got = _launches[ck] = (la, (B * c, 1, 1))
    return got


def check_sizes(top_k: int, hot_size: int) -> None:
    """Raise ``ValueError`` if the resolve kernel cannot run K = top_k, H = hot_size here."""
    _check_sizes(top_k, hot_size, cupy.cuda.runtime.getDevice())


@functools.lru_cache(maxsize=256)
def _check_sizes(top_k: int, hot_size: int, device_id: int) -> None:
    if top_k > hot_size:
        raise ValueError(f"top_k={top_k} must not exceed hot_size={hot_size}")
    if not 1 <= hot_size <= _abi.MAX_HOT:
        raise ValueError(f"hot_size must be in [1, {_abi.MAX_HOT}], got {hot_size}")
    need, limit = resolve_smem_bytes(top_k, hot_size), max_shared_memory()
    if need > limit:
        raise ValueError(f"top_k={top_k} with hot_size={hot_size} needs {need} bytes of shared "
                         f"memory per block; this device allows {limit}: lower top_k or hot_size")


@dataclass
class SwapState:
    """The device tables of one layer's hot buffers (validated views, see docs/design.md §3).

    host_locs : int64 ``[R, max_len]``; slot_tokens, slot_locs : int32 ``[R, H + P]`` (one row
    stride); lru : int16 ``[R, H]``.

    ``token_slot`` (optional): int16 ``[R, max_len]``, contiguous, any initial contents: the hot
    slot each token was last admitted to. With it the resolve looks each selected token up
    there instead of hashing the top-k and probing it with every hot slot (one block per batch
    row). An entry counts only while its slot still holds its token, so stale entries are
    harmless. A held token the table does not name (slot_tokens written by something else, or
    restored) is still found: when some selected token is not in the table, the call scans the
    slots for it, as the hash resolve does, and repairs the entry. It costs 2 bytes per token
    of ``host_locs``. Any initial contents do for single-step calls alone. A
    :class:`hisparse_cupy.MultiStepState` over the same slot tables has its own table, which
    must be this one (build the state with ``MultiStepState.swap_state(lru)``): the multi-step
    lookups rely on every admission being recorded in it.
    """

    host_locs: cupy.ndarray
    slot_tokens: cupy.ndarray
    slot_locs: cupy.ndarray
    lru: cupy.ndarray
    token_slot: cupy.ndarray | None = None
    # residency (docs/design.md section 10): a request with resident[r] != 0 has every token's
    # row in the device page table (uint8 [R]; int32 [R, n], rows contiguous; P tokens a page)
    resident: cupy.ndarray | None = None
    page_table: cupy.ndarray | None = None
    page_tokens: int = 0

    @property
    def hot_size(self) -> int:
        return self.lru.shape[1]

    @classmethod
    def validated(cls, host_locs: ArrayLike, slot_tokens: ArrayLike, slot_locs: ArrayLike,
                  lru: ArrayLike, *, token_slot: ArrayLike | None = None,
                  resident: ArrayLike | None = None, page_table: ArrayLike | None = None,
                  page_tokens: int | None = None) -> SwapState:
        host_locs = _checks.array("host_locs", host_locs, np.int64, ndim=2)
        lru = _checks.array("lru", lru, np.int16, ndim=2, contiguous=False, inner_contiguous=True)
        R, H = lru.shape
        if not 1 <= H <= _abi.MAX_HOT:
            raise ValueError(f"lru width (hot_size) must be in [1, {_abi.MAX_HOT}], got {H}")
        if host_locs.shape[0] != R:
            raise ValueError(f"host_locs must have {R} rows (one per request slot, like lru), "
                             f"got {host_locs.shape[0]}")
        slot_tokens = _checks.array("slot_tokens", slot_tokens, np.int32, ndim=2,
                                    contiguous=False, inner_contiguous=True)
        slot_locs = _checks.array("slot_locs", slot_locs, np.int32, ndim=2, contiguous=False,
                                  inner_contiguous=True)
        for name, a in (("slot_tokens", slot_tokens), ("slot_locs", slot_locs)):
            if a.shape[0] != R or a.shape[1] < H + 1:
                raise ValueError(f"{name} must have shape ({R}, >= {H + 1}) (hot slots plus the "
                                 f"newest-token slot), got {tuple(a.shape)}")
        if slot_tokens.strides != slot_locs.strides:
            raise ValueError("slot_tokens and slot_locs must share one row stride, got "
                             f"{slot_tokens.strides} and {slot_locs.strides}")
        if token_slot is not None:
            token_slot = _checks.array("token_slot", token_slot, np.int16,
                                       shape=host_locs.shape)
        res = _checks.residency(resident, page_table, page_tokens, R, host_locs.shape[1])
        return cls(host_locs, slot_tokens, slot_locs, lru, token_slot, *res)

    def params(self, p: Params | None = None) -> Params:
        """The layer's fields of the resolve struct (the batch's and the call's come later)."""
        p = p or Params(_abi.SWAP_RESOLVE)
        return p.set(
            host_locs=ptr(self.host_locs), host_stride=_checks.row_stride(self.host_locs),
            slot_tokens=ptr(self.slot_tokens), slot_locs=ptr(self.slot_locs),
            slot_stride=_checks.row_stride(self.slot_locs), lru=ptr(self.lru),
            lru_stride=_checks.row_stride(self.lru), R=self.lru.shape[0], H=self.hot_size,
            token_slot=ptr(self.token_slot), **residency_fields(self))

    def check_on_host(self, n_device_rows: int) -> None:
        """Raise ``ValueError`` if the tables are not a valid state (synchronizes).

        ``slot_locs`` of every hot slot and of slot H must lie in ``[0, n_device_rows)``, and
        :func:`hisparse_cupy.reference.check_invariants` must hold (``lru`` a permutation of
        ``0 .. H-1``, hot tokens held once, device rows owned once). A resident request's
        slot tables are not read by the swaps and are not checked.
        """
        from .. import reference

        H = self.hot_size
        locs = cupy.asnumpy(self.slot_locs[:, : H + 1])
        sparse = np.ones(locs.shape[0], bool)
        if self.resident is not None:  # resident requests' slot rows are unused
            sparse = cupy.asnumpy(self.resident) == 0
            locs[~sparse] = -1
        bad = np.argwhere(((locs < 0) | (locs >= n_device_rows)) & sparse[:, None])
        if bad.size:
            r, s = bad[0]
            raise ValueError(f"invalid state: slot_locs[{r}, {s}] = {locs[r, s]} is outside the "
                             f"{n_device_rows} device rows ({len(bad)} such slot(s))")
        try:
            reference.check_invariants(cupy.asnumpy(self.slot_tokens), locs,
                                       cupy.asnumpy(self.lru), H,
                                       requests=np.flatnonzero(sparse))
        except reference.InvariantError as e:
            raise ValueError(f"invalid state: {e}") from None


def residency_fields(state) -> dict:
    """A state's residency fields of its kernel struct (the resolve's or the multi-step one's:
    the same names)."""
    t = state.page_table
    return dict(resident=ptr(state.resident), page_table=ptr(t), page_tokens=state.page_tokens,
                page_stride=0 if t is None else _checks.row_stride(t))


# ------------------------------------------------------------------ the struct, in stages
# The resolve's struct is filled in three stages: per layer (the layer's tables, the outputs'
# buffers: once, when a cache is built), per batch (all layers at once, at begin_step) and per
# call (the top-k and the output: a few word writes). The stateless op runs the three on one
# struct; a Step runs the last one per layer.

def layer_structs(states, *, status: cupy.ndarray, plan: MissPlan,
                  n_host_rows: int, counters=()) -> Structs:
    """One resolve struct per layer (``states``: each layer's :class:`SwapState`) with every
    field that does not depend on the batch or the call; ``counters``: each layer's counters
    address (none: not counted)."""
    st = Structs.zeros(_abi.SWAP_RESOLVE, len(states))
    for i, state in enumerate(states):
        state.params(st.row(i))
    for i, c in enumerate(counters):
        st.put(i, counters=c)
    st.put_all(status=ptr(status), plan_src=ptr(plan.src), plan_dst=ptr(plan.dst),
               plan_count=ptr(plan.count), plan_stride=_checks.row_stride(plan.src),
               n_host_rows=n_host_rows)
    return st


def for_batch(layers: Structs, req: cupy.ndarray, lens: cupy.ndarray, lens_stride: int, B: int,
              num_real: cupy.ndarray | None, *, lean: bool = False) -> Structs:
    """A copy of the per-layer structs with the batch's fields in every layer (``lean``: a
    lean step's, which refuses a row whose request is not resident)."""
    st = layers.copy()
    st.put_all(req=ptr(req), lens=ptr(lens), lens_stride=lens_stride, B=B, num_real=ptr(num_real),
               lean=int(lean))
    return st


_RW = field_words(_abi.SWAP_RESOLVE)


class CallFields(CallWriter):
    """Writes a call's fields (top-k, output, K) into struct ``layer`` of a :class:`Structs`."""

    __slots__ = ()
    TOPK, OUT, TOPK_STRIDE = _RW["topk"][1], _RW["out"][1], _RW["topk_stride"][1]
    OUT_STRIDE, K, HASH = _RW["out_stride"][1], _RW["K"][1], _RW["hash_size"][1]

    def fill(self, layer: int, topk: cupy.ndarray, out: cupy.ndarray) -> None:
        i8, i4 = self.i8, self.i4
        b8, b4 = layer * self.n8, layer * self.n4
        i8[b8 + self.TOPK] = topk.data.ptr
        i8[b8 + self.OUT] = out.data.ptr
        i4[b4 + self.TOPK_STRIDE] = topk.strides[0] // 4
        i4[b4 + self.OUT_STRIDE] = out.strides[0] // 4
        K = topk.shape[1]
        if i4[b4 + self.K] != K:
            i4[b4 + self.K] = K
            i4[b4 + self.HASH] = _abi.hash_size(K)


class SwapLaunch(NamedTuple):
    """A swap's launches: the resolve's launcher and grid, then its planned copy's."""

    resolve: Launcher
    resolve_grid: tuple[int, int, int]
    copy: CopyLaunch


_calls: dict[tuple, SwapLaunch] = {}


def launches(key, B: int, K: int, H: int, table: bool, copy_grid: int | None,
             pdl: bool) -> SwapLaunch:
    """The launches of a swap of B rows of K entries (cached: an eager call pays one
    dictionary lookup)."""
    ck = (key, B, K, H, table, copy_grid, pdl, cupy.cuda.runtime.getDevice(), FIXED["cluster"])
    got = _calls.get(ck)
    if got is None:
        la, grid = resolve_launch(key, B, K, H, table)
        got = _calls[ck] = SwapLaunch(la, grid, CopyLaunch(
            copy_launcher(B, pdl=pdl), (copy_grid or default_copy_grid(B, K), 1, 1)))
    return got


def run(resolve: Structs, layer: int, copy: Structs | None, launch: SwapLaunch,
        stream_ptr: int) -> None:
    """Queue the resolve of struct ``layer`` and its planned copy (PDL) on a stream; without
    ``copy`` (a lean step: nothing is planned) the resolve alone."""
    launch.resolve(launch.resolve_grid, stream_ptr, resolve.addr(layer))
    if copy is not None:
        launch.copy.launcher(launch.copy.grid, stream_ptr, copy.addr(layer))


def swap_in(
    top_k_tokens: ArrayLike,
    req_indices: ArrayLike,
    seq_lens: ArrayLike,
    state: SwapState,
    *,
    host_rows: Ptr,
    n_host_rows: int,
    device_rows: ArrayLike,
    plan: MissPlan,
    out: ArrayLike | None = None,
    status: ArrayLike | None = None,
    num_real: ArrayLike | None = None,
    copy_grid: int | None = None,
    check: bool = False,
    validate_state: bool = False,
    counters: ArrayLike | None = None,
    stream: StreamLike | None = None,
    pdl: bool | None = None,
) -> cupy.ndarray:
    """Resolve one step's top-k for a batch and move the misses into the hot buffer.

    Parameters
    ----------
    top_k_tokens : int32 ``[B, K]`` device array (rows may be strided), token positions, -1 =
        unused. ``B >= 1``, ``1 <= K <= H``.
    req_indices : int32 or int64 ``[B]``, batch row -> request slot (unique among real rows).
    seq_lens : int32 or int64 ``[B]`` (or ``[B, S]``: column 0 is used), the request's length
        including the newest token.
    state : :class:`SwapState` of the layer.
    host_rows : device address of the layer's host rows (``HostKVPool.device_ptr(layer)``).
    n_host_rows : rows in that layer (host rows outside ``[0, n_host_rows)`` count as missing).
    device_rows : uint8 ``[D, row_bytes]`` device array, the layer's hot-buffer storage.
    plan : :class:`MissPlan` with ``>= B`` rows of ``>= K`` entries; receives this step's plan
        (the copy reads it, and IndexCache replays it for shared layers).
    out : int32 ``[B, K]`` device array for the result (allocated when None).
    status : int32 ``[B, 3]`` device array: per row, entries out of range, misses without a
        host row, bad request slot / length (allocated when None).
    num_real : int32 device scalar; rows ``>= num_real`` are CUDA-graph padding.
    copy_grid : blocks of the copy kernel (default: enough for every entry, at most a full GPU).
    check : reject repeated valid request slots first (synchronizes), then run the call, then
        synchronize and raise ``ValueError`` naming rows and entries if any status is set.
        When it raises, the call has **completed**: valid entries were resolved, the state was
        updated and their bytes copied; the flagged entries are -1 and touched nothing.
    validate_state : before launching, copy the layer's tables to the host and raise
        ``ValueError`` if they are not a valid state (``slot_locs`` outside ``device_rows``,
        ``lru`` not a permutation, a token held twice): a debugging mode, it synchronizes.
        Without it the state is trusted (as every kernel of this package leaves it valid).
    counters : uint64 ``[N_LAYER_COUNTERS]`` device array the call adds to
        (:mod:`hisparse_cupy.counters`), or None.
    stream : CuPy, PyTorch or ``__cuda_stream__`` stream, or an int handle (default: CuPy's
        current stream).
    pdl : launch the copy with Programmatic Dependent Launch (default: where supported).

    Returns
    -------
    cupy.ndarray
        ``out``: int32 ``[B, K]``, the device row of each entry, -1 for unused or invalid.
    """
    H = state.hot_size

    def sizes_ok(shape) -> None:
        if shape[1] > H:
            raise ValueError(f"top_k_tokens has K={shape[1]} entries per row, more than "
                             f"hot_size H={H}")
        check_sizes(shape[1], H)

    s = as_stream(stream)
    with s:  # DLPack imports order on the stream the kernels run on
        a = _checks.op_args(top_k_tokens, req_indices, seq_lens, dims="BK", sizes_ok=sizes_ok,
                            host_rows=host_rows, n_host_rows=n_host_rows,
                            device_rows=device_rows, plan=plan, plan_cls=MissPlan,
                            plan_required=True, out=out, status=status, num_real=num_real,
                            counters=counters)
    topk, req, lens, dev, nr, out, status = a.topk, a.req, a.lens, a.dev, a.num_real, a.out, \
        a.status
    (B, K), row_bytes, n_host_rows = topk.shape, a.row_bytes, a.n_host_rows
    if validate_state:
        s.synchronize()
        state.check_on_host(dev.shape[0])
    if check:
        _checks.unique_requests(req, nr, state.lru.shape[0], s)

    resolve = for_batch(layer_structs([state], status=status, plan=plan,
                                      n_host_rows=n_host_rows, counters=a.counters),
                        req, lens, a.lens_stride, B, nr)
    CallFields(resolve).fill(0, topk, out)
    pdl = resolve_pdl(pdl)
    go = launches((req.dtype, lens.dtype), B, K, H, state.token_slot is not None, copy_grid, pdl)
    go.resolve(go.resolve_grid, s.ptr, resolve.addr(0))
    # through launch_copy, so a measuring probe (hisparse_cupy.testing.probe) sees this copy
    copy_rows(plan.src, plan.dst, plan.count, src=Rows(int(host_rows), 0, n_host_rows),
              dst=array_rows(dev), row_bytes=row_bytes, batch=B, num_real=nr,
              grid=go.copy.grid[0], stream=s, pdl=pdl)
    if check:
        _checks.raise_on_status(status, topk, lens, max_len=state.host_locs.shape[1], stream=s)
    return out
