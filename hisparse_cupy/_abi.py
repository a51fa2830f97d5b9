"""The kernel ABI: parameter structs, shared-memory layouts and constants, defined once.

Every kernel takes one parameter struct by value (``cu/abi.cuh`` declares them). This module
mirrors each struct as a NumPy structured dtype (``align=True``: C layout), and is the single
definition of the constants kernels, ops and the oracle share (status columns, sentinels,
limits, block sizes) and of every kernel's dynamic shared-memory layout. It imports NumPy only,
so the oracle (:mod:`hisparse_cupy.reference`) can use it without CuPy.

How the two sides are kept equal: :func:`defines` turns everything here into ``-D`` macros
that every compile passes (the runtime's and :func:`hisparse_cupy.compile_check`'s):

- ``HS_ABI_<STRUCT>_SIZE`` and ``HS_ABI_<STRUCT>_FIELDS(X)`` (every field's name, size and
  whether it is a float, in order): ``cu/abi.cuh`` ``static_assert``s the struct's size and
  each field's size and kind (a float written as an int of the same size reads as a
  different number), and checks the
  order with a C++20 designated initializer, so a field added, dropped, reordered or retyped
  on one side fails the CPU compile check (NVRTC has no ``offsetof``; with the sizes and the
  order fixed, and no tail padding, the offsets are fixed too). The demo model's structs
  (:data:`DEMO_STRUCTS`, checked by ``demo/model.cu`` with the same macro) get the same;
- ``HS_<CONSTANT>``: the constants, which the header turns into ``constexpr`` values (a
  missing one is an ``#error``);
- ``HS_SMEM_<KERNEL>(X)``: an X-macro listing the kernel's shared-memory regions (element
  type, name, element count as an expression of the kernel's sizes). The device carve
  (``HS_SMEM_CARVE`` in ``cu/abi.cuh``) lays them out with the same 16-byte alignment rule
  that :func:`smem_bytes` uses to size the launch.
"""

from __future__ import annotations

import functools

import numpy as np

# ------------------------------------------------------------------------------- constants
# status columns (per batch row, int32 [B, N_STATUS]), shared by both swaps
ST_RANGE = 0  # entries outside [0, seq_len) (or beyond the host_locs width)
ST_NOHOST = 1  # misses whose token has no valid host row
ST_BADROW = 2  # request slot outside [0, R), a negative seq_len, or no room (multi-step);
#               the value BADROW_NOT_RESIDENT: a sparse request in a lean step (docs/design.md 10)
BADROW_NOT_RESIDENT = 2
N_STATUS = 3
STATUS_NAMES = ("range", "nohost", "badrow")

# per-layer counters (uint64 [n_layers, N_LAYER_COUNTERS]: HotBufferCache.counters), added by
# the last kernel of every swap for each real batch row it resolved (bad rows count nowhere)
LC_ROWS = 0  # batch rows swapped (a multi-step call of a row counts once)
LC_SELECTED = 1  # top-k entries they selected: K a row, S * K a multi-step row (-1 included)
LC_MISSES = 2  # unique misses (the miss plan's entries; a staged prediction's row counts too)
LC_FLAGGED = 3  # entries the status flagged (out of range, no host row)
N_LAYER_COUNTERS = 4
LAYER_COUNTERS = ("rows", "selected", "misses", "flagged")

MAX_HOT = 32767  # single-step LRU entries are int16
RESOLVE_BLOCK = 1024  # threads of the single-step resolve with one block per batch row
RESOLVE_CLUSTER_BLOCK = 512  # threads of each block when a cluster of blocks resolves a row
RESOLVE_MAX_CLUSTER = 8  # most resolve blocks per batch row (a thread-block cluster, sm_90+)
COPY_WARPS = 8  # warps per block of the planned copy
PREDICT_BLOCK = 512  # threads of a prediction stager block (it takes requests in turn)
NEWEST_BLOCK = 128
NEWEST_LAYERS = 8  # layers whose token -> slot entries a newest_rows thread loads at once

# multi-step (MTP) swap
MS_MIN_STEPS, MS_MAX_STEPS = 2, 4
MS_MAX_TOKENS = 8192  # S * K per row
MS_META_INIT = 0x7FFFFFFF  # meta entry of no occurrence (above every reverse rank)
MS_EMPTY = 0xFFFFFFFFFFFFFFFF  # empty dedup-table entry
MS_NONE = 0xFFFFFFFF  # dedup-table value: not yet published / no row
# per batch row counters (int32 [B, MS_N_COUNTERS], the gather -> commit workspace)
MS_C_MISS = 0  # unique misses claimed
MS_C_RANGE = 1  # entries out of range
MS_C_NOHOST = 2  # misses without a valid host row (per occurrence)
MS_C_PENDING = 3  # placeholders listed for the commit
MS_C_DONE = 4  # gather blocks of the row done (copy blocks only)
MS_C_COPY = 5  # rows for the commit grid's copy blocks: min(misses, C)
MS_N_COUNTERS = 8
# per batch row statistics of the last call (int32 [B, MS_N_STATS]), named by MS_STATS
MS_X_MISS, MS_X_ADMIT, MS_X_EVICTABLE, MS_X_PARTIAL = range(4)
MS_N_STATS = 4
MS_STATS = ("misses", "admitted", "evictable", "partial")
# the commit's eviction key of an unreferenced slot (0: referenced this call, not evictable)
MS_KEY_EMPTY = 0xFFFFFFFF  # the slot holds no token
MS_KEY_NEVER = 0xFFFFFFFE  # never referenced
MS_KEY_AGE_MAX = 0xFFFFFFFD  # ages (epoch - ref) are clamped to it
GATHER_BLOCK = 128
COMMIT_BLOCK = 512
INIT_BLOCK = 256

# single-step resolve: values of its shared hash of the top-k (the first entry that selected
# the token | RESOLVE_VAL_CLAIMED once an LRU slot holding it claimed that entry)
RESOLVE_VAL_ENTRY = 0x3FFFFFFF  # mask of the entry
RESOLVE_VAL_CLAIMED = 0x40000000
RESOLVE_VAL_EMPTY = 0x3FFFFFFF  # an empty bucket's value (above every entry)
RESOLVE_KEY_EMPTY = -1  # an empty bucket's key (tokens are >= 0)
# prediction stager: an empty bucket of its shared hash of a row's misses (host rows are >= 0)
PREDICT_KEY_EMPTY = -1
# the stager's rule: the tokens the full layer missed (0), or every token it selected (1), that
# the next full layer does not hold
PREDICT_RULES = {"misses": 0, "selection": 1}

CONSTANTS = {
    "ST_RANGE": ST_RANGE, "ST_NOHOST": ST_NOHOST, "ST_BADROW": ST_BADROW, "N_STATUS": N_STATUS,
    "BADROW_NOT_RESIDENT": BADROW_NOT_RESIDENT,
    "LC_ROWS": LC_ROWS, "LC_SELECTED": LC_SELECTED, "LC_MISSES": LC_MISSES,
    "LC_FLAGGED": LC_FLAGGED, "N_LAYER_COUNTERS": N_LAYER_COUNTERS,
    "MAX_HOT": MAX_HOT, "RESOLVE_BLOCK": RESOLVE_BLOCK,
    "RESOLVE_CLUSTER_BLOCK": RESOLVE_CLUSTER_BLOCK, "RESOLVE_MAX_CLUSTER": RESOLVE_MAX_CLUSTER,
    "RESOLVE_VAL_ENTRY": RESOLVE_VAL_ENTRY, "RESOLVE_VAL_CLAIMED": RESOLVE_VAL_CLAIMED,
    "RESOLVE_VAL_EMPTY": RESOLVE_VAL_EMPTY, "RESOLVE_KEY_EMPTY": RESOLVE_KEY_EMPTY,
    "PREDICT_KEY_EMPTY": PREDICT_KEY_EMPTY, "PREDICT_RULE_SELECTION": PREDICT_RULES["selection"],
    "COPY_WARPS": COPY_WARPS, "PREDICT_BLOCK": PREDICT_BLOCK, "NEWEST_BLOCK": NEWEST_BLOCK,
    "NEWEST_LAYERS": NEWEST_LAYERS,
    "MS_MAX_TOKENS": MS_MAX_TOKENS, "MS_MAX_STEPS": MS_MAX_STEPS,
    "MS_META_INIT": MS_META_INIT, "MS_EMPTY": MS_EMPTY, "MS_NONE": MS_NONE,
    "MS_C_MISS": MS_C_MISS, "MS_C_RANGE": MS_C_RANGE, "MS_C_NOHOST": MS_C_NOHOST,
    "MS_C_PENDING": MS_C_PENDING, "MS_C_DONE": MS_C_DONE, "MS_C_COPY": MS_C_COPY,
    "MS_N_COUNTERS": MS_N_COUNTERS,
    "MS_X_MISS": MS_X_MISS, "MS_X_ADMIT": MS_X_ADMIT, "MS_X_EVICTABLE": MS_X_EVICTABLE,
    "MS_X_PARTIAL": MS_X_PARTIAL, "MS_N_STATS": MS_N_STATS,
    "MS_KEY_EMPTY": MS_KEY_EMPTY, "MS_KEY_NEVER": MS_KEY_NEVER, "MS_KEY_AGE_MAX": MS_KEY_AGE_MAX,
    "GATHER_BLOCK": GATHER_BLOCK, "COMMIT_BLOCK": COMMIT_BLOCK, "INIT_BLOCK": INIT_BLOCK,
}

# ------------------------------------------------------------------------------- structs
_P = "u8"  # a device pointer (or a device-mapped host address) as a 64-bit word


def default_scratch(hot_size: int, top_k: int, max_steps: int) -> int:
    """Default scratch rows per request: ``max(S*K - H, min(S*K, 1024))``.

    ``S*K - H`` is the minimum (every miss beyond the scratch rows must find an unreferenced
    victim); more scratch rows let more misses be admitted by rotation instead of a direct copy.
    """
    t = top_k * max_steps
    return max(t - hot_size, min(t, 1024))


def _struct(fields: list[tuple[str, str]]) -> np.dtype:
    dt = np.dtype(fields, align=True)
    last = dt.names[-1]
    if dt.fields[last][1] + dt[last].itemsize != dt.itemsize:  # see the C++ checks
        raise AssertionError(f"struct {fields[:2]}... has tail padding: add an explicit field")
    return dt


# One entry per kernel parameter struct: C++ name -> dtype. Field order and types must equal the
# C++ declaration in cu/abi.cuh (the static_asserts check it). Pointers first, then 64-bit
# scalars, then 32-bit ones.
SWAP_RESOLVE = _struct([
    ("topk", _P), ("req", _P), ("lens", _P), ("num_real", _P), ("host_locs", _P),
    ("slot_tokens", _P), ("slot_locs", _P), ("lru", _P), ("out", _P), ("plan_src", _P),
    ("plan_dst", _P), ("plan_count", _P), ("status", _P), ("token_slot", _P), ("counters", _P),
    ("resident", _P), ("page_table", _P),
    ("n_host_rows", "i8"),
    ("topk_stride", "i4"), ("K", "i4"), ("B", "i4"), ("R", "i4"), ("host_stride", "i4"),
    ("slot_stride", "i4"), ("lru_stride", "i4"), ("H", "i4"), ("hash_size", "i4"),
    ("out_stride", "i4"), ("plan_stride", "i4"), ("lens_stride", "i4"),
    ("page_stride", "i4"), ("page_tokens", "i4"), ("lean", "i4"), ("pad", "i4"),
])

PLANNED_COPY = _struct([
    ("src_idx", _P), ("dst_idx", _P), ("count", _P), ("num_real", _P), ("src_base", _P),
    ("dst_base", _P),
    ("stage_map", _P), ("stage_src", _P), ("stage_count", _P), ("stage_base", _P),
    ("stage_stats", _P),
    ("src_layer_bytes", "i8"), ("n_src_rows", "i8"), ("dst_layer_bytes", "i8"),
    ("n_dst_rows", "i8"),
    ("plan_stride", "i4"), ("B", "i4"), ("row_bytes", "i4"), ("n_layers", "i4"),
    ("stage_width", "i4"), ("pad", "i4"),
])

# the measuring instance of the planned copy (hisparse_cupy.testing.probe): the copy's struct,
# then the
# probe's settings
PLANNED_COPY_PROBE = _struct([
    ("copy", PLANNED_COPY),
    ("bad", _P),
    ("spin_cycles", "i8"),
    ("dry_run", "i4"), ("pad", "i4"),
])

PREDICT_STAGE = _struct([
    ("topk", _P), ("plan_src", _P), ("plan_count", _P), ("req", _P), ("lens", _P),
    ("num_real", _P), ("host_locs", _P), ("slot_tokens", _P), ("token_slot", _P),
    ("stage_map", _P), ("stage_src", _P), ("stage_count", _P), ("stage_stats", _P),
    ("resident", _P),
    ("n_host_rows", "i8"),
    ("topk_stride", "i4"), ("K", "i4"), ("B", "i4"), ("R", "i4"), ("host_stride", "i4"),
    ("slot_stride", "i4"), ("H", "i4"), ("stage_width", "i4"),
    ("lens_stride", "i4"), ("plan_stride", "i4"), ("miss_hash_size", "i4"), ("rule", "i4"),
])

NEWEST_ROWS = _struct([
    ("req", _P), ("lens", _P), ("num_real", _P), ("slot_locs", _P), ("slot_tokens", _P),
    ("host_locs", _P), ("rows_out", _P), ("plan_src", _P), ("plan_dst", _P),
    ("plan_count", _P), ("host_pages", _P), ("own_from", _P), ("resident", _P),
    ("dev_pages", _P), ("written", _P), ("token_slot", _P),
    ("slot_layer_stride", "i8"), ("n_host_rows", "i8"), ("table_layer_stride", "i8"),
    ("B", "i4"), ("R", "i4"), ("max_len", "i4"), ("slot_stride", "i4"), ("H", "i4"),
    ("host_stride", "i4"), ("lens_stride", "i4"), ("n_layers", "i4"), ("record", "i4"),
    ("page_tokens", "i4"), ("pages_stride", "i4"), ("dev_page_tokens", "i4"),
    ("dev_page_stride", "i4"), ("table_stride", "i4"),
])

MULTISTEP = _struct([  # gather and commit take the same struct
    ("topk", _P), ("req", _P), ("lens", _P), ("num_real", _P), ("host_locs", _P),
    ("slot_tokens", _P), ("slot_locs", _P), ("scratch_locs", _P), ("token_slot", _P),
    ("ref", _P), ("clock", _P), ("table", _P), ("meta", _P), ("compact", _P),
    ("pending", _P), ("miss_src", _P), ("miss_dst", _P), ("counters", _P), ("out", _P),
    ("host_base", _P), ("dev_base", _P),
    ("plan_src", _P), ("plan_dst", _P), ("plan_count", _P), ("status", _P), ("stats", _P),
    ("layer_counters", _P), ("resident", _P), ("page_table", _P),
    ("n_host_rows", "i8"),
    ("topk_stride", "i4"), ("S", "i4"), ("K", "i4"), ("B", "i4"), ("R", "i4"),
    ("host_stride", "i4"), ("slot_stride", "i4"), ("H", "i4"), ("P", "i4"),
    ("scratch_stride", "i4"), ("C", "i4"), ("ref_stride", "i4"),
    ("table_size", "i4"), ("compact_stride", "i4"), ("out_stride", "i4"), ("row_bytes", "i4"),
    ("plan_stride", "i4"), ("lens_stride", "i4"), ("lens_step", "i4"), ("copy_blocks", "i4"),
    ("page_stride", "i4"), ("page_tokens", "i4"),
])

MULTISTEP_INIT = _struct([
    ("rows", _P), ("num_real", _P), ("slot_tokens", _P), ("token_slot", _P), ("ref", _P),
    ("clock", _P),
    ("slot_layer_stride", "i8"), ("table_layer_stride", "i8"), ("ref_layer_stride", "i8"),
    ("R", "i4"), ("B", "i4"), ("slot_stride", "i4"), ("H", "i4"), ("table_stride", "i4"),
    ("ref_stride", "i4"),
])

STRUCTS = {
    "SwapResolveParams": SWAP_RESOLVE,
    "PlannedCopyParams": PLANNED_COPY,
    "PlannedCopyProbeParams": PLANNED_COPY_PROBE,
    "PredictStageParams": PREDICT_STAGE,
    "NewestRowsParams": NEWEST_ROWS,
    "MultiStepParams": MULTISTEP,
    "MultiStepInitParams": MULTISTEP_INIT,
}


# The decode loop's synthetic model (demo/model.cu, namespace demo; hisparse_cupy.demo._model
# launches it): one struct per kernel, checked in model.cu as the package's are in cu/abi.cuh.
# The demo's own, not the library's interface; here so that one table, one set of -D macros and
# one compile check cover every kernel the package builds. A float field is a float32 word.
DEMO_STRUCTS = {
    "KvPrefillParams": _struct([
        ("base", _P), ("reqs", _P),
        ("layer_bytes", "i8"), ("req_rows", "i8"),
        ("p0", "i4"), ("p1", "i4"), ("shared", "i4"), ("first", "i4"),
    ]),
    "KvNewestParams": _struct([
        ("base", _P), ("req", _P), ("lens", _P), ("rows", _P),
        ("layer_bytes", "i8"),
        ("max_len", "i4"), ("first", "i4"),
    ]),
    "TopkDriftParams": _struct([
        ("topk", _P), ("step", _P), ("lens", _P),
        ("a", "i8"), ("salt", "i8"),
        ("S", "i4"), ("K", "i4"), ("M", "i4"), ("Md", "i4"), ("U", "i4"), ("recent", "i4"),
    ]),
    "TopkTableParams": _struct([
        ("table", _P), ("step", _P), ("topk", _P),
        ("n_full", "i4"), ("j", "i4"), ("BK", "i4"), ("K", "i4"), ("S", "i4"), ("pad", "i4"),
    ]),
    "DirectLocsParams": _struct([
        ("topk", _P), ("req", _P), ("locs", _P),
        ("SK", "i4"), ("max_len", "i4"), ("n", "i4"), ("pad", "i4"),
    ]),
    "EmbedParams": _struct([("h", _P), ("step", _P), ("n", "i4"), ("pad", "i4")]),
    "WeightsParams": _struct([
        ("w", _P), ("n", "i8"), ("seed", "u8"), ("scale", "f4"), ("pad", "i4"),
    ]),
    "AttnPartialParams": _struct([
        ("qraw", _P), ("locs", _P), ("rows", _P), ("part_m", _P), ("part_l", _P),
        ("part_acc", _P),
        ("ld_b", "i8"), ("ld_s", "i8"),
        ("S", "i4"), ("K", "i4"), ("chunk", "i4"), ("temp", "f4"),
    ]),
    "AttnCombineParams": _struct([
        ("part_m", _P), ("part_l", _P), ("part_acc", _P), ("out", _P), ("digest", _P),
        ("step", _P),
        ("nsplit", "i4"), ("n_layers", "i4"), ("layer", "i4"), ("pad", "i4"),
    ]),
    "IndexFillParams": _struct([("keys", _P), ("n_rows", "i8"), ("layer", "i4"), ("pad", "i4")]),
    "IndexQueryParams": _struct([("q", _P), ("step", _P), ("n_words", "i4"), ("pad", "i4")]),
    "IndexerParams": _struct([
        ("keys", _P), ("q", _P), ("req", _P), ("lens", _P), ("scores", _P),
        ("S", "i4"), ("max_len", "i4"),
    ]),
    "TallyParams": _struct([
        ("counters", _P), ("weight", _P), ("full", _P), ("acc", _P), ("step", _P),
        ("n_layers", "i4"), ("stride", "i4"), ("col", "i4"), ("pad", "i4"),
    ]),
    "TickParams": _struct([("step", _P), ("lens", _P), ("B", "i4"), ("pad", "i4")]),
    "GemmBf16Params": _struct([
        ("A", _P), ("B", _P), ("C", _P),
        ("lda", "i8"),
        ("M", "i4"), ("N", "i4"), ("Kd", "i4"), ("pad", "i4"),
    ]),
}


def new(dtype: np.dtype, n: int = 1) -> np.ndarray:
    """Zeroed parameter structs: a ``(n,)`` array (CuPy passes element 0 by value)."""
    return np.zeros(n, dtype)


# ------------------------------------------------------------------------------- shared memory
# Per kernel: (C type, region name, element count as an expression of the kernel's sizes). The
# same expressions are evaluated here (with the sizes as Python ints) and in the kernel (where
# each name is a local variable), and every region starts on a 16-byte boundary.
_CTYPE_BYTES = {"i64": 8, "i32": 4, "u32": 4, "i16": 2, "u16": 2, "u8": 1}

SMEM = {
    # single-step resolve; NW = warps per block, HS = hash slots (power of two >= 4 K)
    "SWAP_RESOLVE": (
        ("i64", "host_row", "K"),  # host row of each entry's token (misses use it)
        ("i32", "hkey", "HS"),  # hash of the top-k: token
        ("i32", "hval", "HS"),  # hash: first entry that selected it
        ("i32", "tok", "K"),  # entry -> token
        ("i32", "res", "K"),  # entry -> output (written to global once, coalesced)
        ("i32", "hpos", "K"),  # entry -> its token's hash slot (duplicates: O(1))
        ("i32", "loc", "H+1"),  # device rows of slots 0..H (token-table instance: hit flags)
        ("i32", "warp_hits", "NW+1"),  # per-warp counts, then offsets
        ("i32", "warp_evict", "NW+1"),
        ("i32", "warp_miss", "NW+1"),
        ("i32", "count", "4"),  # status counters, indexed by ST_*
        ("i32", "cluster_tot", "3*(RESOLVE_MAX_CLUSTER+1)"),  # the row's counts before each block
        ("i16", "evict", "H"),  # evictable slots, old LRU order
        ("i16", "hit", "H"),  # hit slots, old LRU order
        ("u16", "order", "H"),  # slot | hit << 15, by LRU position (between passes)
        ("u8", "kind", "K"),  # entry classification
    ),
    # prediction stager; MS = miss hash slots (a power of two >= 2 K; a row's misses beyond
    # MS / 2 are not staged)
    "PREDICT_STAGE": (
        ("i64", "mkey", "MS"),  # F's misses (host rows; PREDICT_KEY_EMPTY: empty)
        ("i32", "mclaim", "MS"),  # 1: a top-k entry took this miss (repeats stage once)
        ("i32", "count", "4"),  # [0]: predicted misses
    ),
    # planned copy: the exclusive prefix of the clamped counts, the block scan's scratch, and
    # the block's prediction counters
    "PLANNED_COPY": (
        ("i32", "prefix", "B+1"),
        ("i32", "scan", "COPY_WARPS+1"),
        ("u32", "stats", "2"),  # prediction's counters of the block's rows (stage_stats set)
    ),
    # multi-step commit; NW = ceil(S K / 32)
    "MULTISTEP_COMMIT": (
        ("u32", "key", "H"),  # eviction key of each ring position (0 = referenced)
        ("u32", "bits", "NW"),  # bitmap over reverse ranks of the misses
        ("u32", "admit", "NW"),  # bitmap over miss ordinals: admitted (partial admission)
        ("i32", "prefix", "NW+1"),  # popcount prefix of `bits`
        ("i32", "hist", "256"),  # radix-select histogram (phase 1: per-warp key OR / AND)
        ("i32", "scan", "NS"),  # block scan scratch, NS = COMMIT_BLOCK / 32 + 1
        ("i32", "radix_digit", "1"),  # radix select: the digit of this pass
        ("i32", "radix_rest", "1"),  # radix select: keys still wanted at that digit
        ("i32", "last_victim", "1"),  # largest ring position taken (the new cursor)
        ("i32", "no_room", "1"),  # a miss without a scratch row found no victim
        ("i16", "victim", "H"),  # victims in ring order
    ),
}


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def smem_bytes(kernel: str, **sizes: int) -> int:
    """Dynamic shared memory of ``kernel`` (a key of :data:`SMEM`) for the given sizes."""
    return _smem_bytes(kernel, tuple(sorted(sizes.items())))


@functools.lru_cache(maxsize=1024)
def _smem_bytes(kernel: str, sizes: tuple) -> int:
    env = {**CONSTANTS, **dict(sizes)}
    total = 0
    for ctype, _name, count in SMEM[kernel]:
        n = eval(count, {"__builtins__": {}}, env)  # noqa: S307 - fixed expressions above
        total += _align16(_CTYPE_BYTES[ctype] * int(n))
    return total


@functools.lru_cache(maxsize=256)
def resolve_sizes(top_k: int, hot_size: int, block: int = RESOLVE_BLOCK) -> dict[str, int]:
    """The sizes the resolve kernel's shared memory depends on (``block`` threads a block)."""
    return {"K": top_k, "H": hot_size, "HS": hash_size(top_k), "NW": block // 32}


def hash_size(top_k: int, spread: int = 4) -> int:
    """Shared hash slots for a top-k of ``top_k`` entries (power of two, load <= 1/spread).

    A warp waits for its longest probe sequence; at load 1/2 that tail made the lookups
    dominate the resolve, at 1/4 it is a few probes (benchmarks/NOTES.md). The prediction
    stager, off the critical path, uses spread 2 (half the shared memory).
    """
    return max(64, 1 << (spread * top_k - 1).bit_length())


# ------------------------------------------------------------------------------- -D macros
def _literal(value: int) -> str:
    """A C++ integer literal of ``value``: decimal, or hex (an unsigned type where the value
    needs one) from 2**31 on, where a decimal literal would be a wider signed type or none."""
    return str(value) if value < 2**31 else hex(value)


def defines() -> list[tuple[str, str]]:
    """``(name, value)`` pairs every compile defines (see the module docstring)."""
    out: list[tuple[str, str]] = []
    for struct, dt in {**STRUCTS, **DEMO_STRUCTS}.items():
        out.append((f"HS_ABI_{struct}_SIZE", str(dt.itemsize)))
        fields = "".join(f"X({struct},{f},{dt[f].itemsize},{int(dt[f].kind == 'f')})"
                         for f in dt.names)
        out.append((f"HS_ABI_{struct}_FIELDS(X)", fields))
    for name, value in CONSTANTS.items():
        out.append((f"HS_{name}", _literal(value)))
    for kernel, regions in SMEM.items():
        body = "".join(f"X({t},{n},({c}))" for t, n, c in regions)
        out.append((f"HS_SMEM_{kernel}(X)", body))
    return out
