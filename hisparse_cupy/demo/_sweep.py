"""The load sweep's plan: which concurrencies fit which memory, in each mode.

A sweep decodes ``n`` requests of one context at a time, for ``n`` from 1 up to what the host
memory holds, and compares three modes under one GPU budget for KV (the bytes an engine leaves
for KV after the model):

- **gpu-only**: every layer's KV and the indexer's key cache on the GPU;
- **managed**: the indexer's key cache and the always-resident layers on the GPU, and a
  :class:`~hisparse_cupy.HotBufferCache` device budget of the rest: the first ``k`` requests
  resident, the others sparse (:meth:`~hisparse_cupy.residency.DeviceBudget.max_resident`);
- **sparse**: the same with every request sparse (a hot buffer each).

The indexer's key cache (``indexer_bytes`` per token, FP8 keys and a scale) is kept on the GPU
for the full layers only: the shared layers reuse their full layer's top-k. Every request
grows to ``context + steps`` tokens, and the plan holds room for that. This module plans; it
measures nothing and needs no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _checks
from .._cli.usage import UsageError

GB = 1e9


@dataclass(frozen=True)
class Shape:
    """The model's memory per token: ``layers`` layers of ``row_bytes`` KV rows, of which
    ``full_layers`` run the indexer (``indexer_bytes`` of key cache per token each) and the
    first ``resident_layers`` keep their KV on the GPU in every mode; the hot buffer's sizes;
    ``page_tokens`` rows a device page."""

    layers: int = 78
    full_layers: int = 21
    row_bytes: int = 656
    indexer_bytes: int = 132
    resident_layers: int = 0
    hot: int = 4096
    top_k: int = 2048
    extra_page: int = 64
    max_steps: int = 1
    page_tokens: int = 64

    def __post_init__(self):
        L = _checks.integer("layers", self.layers, 1)
        _checks.integer("full_layers", self.full_layers, 0, L)
        _checks.integer("resident_layers", self.resident_layers, 0, L - 1)
        for name in ("row_bytes", "hot", "top_k", "extra_page", "max_steps", "page_tokens"):
            _checks.integer(name, getattr(self, name), 1)
        _checks.integer("indexer_bytes", self.indexer_bytes, 0)

    @property
    def cached_layers(self) -> int:
        """Layers whose KV the cache holds (the host pool and the device budget)."""
        return self.layers - self.resident_layers

    def block_rows(self) -> int:
        """Device rows a sparse request holds (hot slots, extra page, scratch)."""
        from .._tables import rows_needed  # (the demo's parser imports this module: no CuPy)

        return rows_needed(max_requests=1, hot_size=self.hot, top_k=self.top_k,
                           extra_page=self.extra_page, max_steps=self.max_steps)


def demo_shape(cfg) -> Shape:
    """The :class:`Shape` of the decode loop a demo :class:`~hisparse_cupy.demo._config.Config`
    runs: its layers and pattern's full layers, its rows (``cfg.row_bytes``: FP8 or bf16),
    resident layers, hot buffer and device pages, and its indexer's key cache (132 B a token,
    none with ``--no-indexer``)."""
    from ._config import DEVICE_PAGE, INDEXER_ROW

    return Shape(layers=cfg.layers, full_layers=len(cfg.pattern_obj().full_layers),
                 row_bytes=cfg.row_bytes, indexer_bytes=INDEXER_ROW if cfg.indexer else 0,
                 resident_layers=cfg.resident_layers, hot=cfg.hot,
                 top_k=cfg.top_k, extra_page=cfg.extra_page, max_steps=cfg.mtp,
                 page_tokens=DEVICE_PAGE)


def add_arguments(a) -> None:
    """The sweep's flags (``demo --sweep``), each given to ``a`` (the demo parser's
    ``add_argument`` of their group)."""
    a("--sweep", action="store_true",
      help="decode each concurrency of one --context (1, 2, 4, ... up to what --host-gb holds, "
           "and gpu-only's maximum) gpu-only, residency-managed and always sparse under "
           "--gpu-budget, every offloaded run checked against gpu-only; --json and --png "
           "write its rows and plot")
    a("--gpu-budget", type=float, default=40.0, metavar="GB",
      help="--sweep: GPU memory for KV and the indexer's key cache (default: 40, what a "
           "GLM-5.2 H200 at TP8 leaves for them)")
    a("--host-gb", type=float, default=None, metavar="GB",
      help="--sweep: host memory for the pinned pool (default: 80%% of this machine's)")
    a("--concurrency", type=int, action="append", metavar="N",
      help="--sweep: this concurrency (repeatable; default: the plan's rows)")
    a("--sweep-offload", choices=("overlap", "predict"), default="overlap",
      help="--sweep: the mode of the residency-managed and all-sparse rows: overlap "
           "(default) or predict (overlap + the next full layer's likely misses staged; not "
           "with --mtp 2-4)")


def sweep_args(ns, given: set[str]) -> dict | None:
    """``run_sweep``'s keyword arguments from the parsed flags, or None without ``--sweep``;
    ``SystemExit`` naming a flag that does not go with it."""
    if not ns.sweep:
        bad = [f for f in ("gpu_budget", "host_gb", "concurrency", "sweep_offload")
               if f in given]
        if bad:
            raise UsageError(f"demo: --{bad[0].replace('_', '-')} sets up --sweep: add it")
        return None
    if "batch" in given:
        raise UsageError("demo: --sweep runs its own concurrencies: --concurrency N, not --batch")
    for f in ("mode", "device_budget", "resident_requests", "eager", "eager_and_graph", "lean",
              "shared_prefix", "side_sms"):  # what the sweep sets or does not run
        if f in given or f == "device_budget" and ns.device_budget != "auto":  # (0: None)
            flag = "no-lean" if f == "lean" else f.replace("_", "-")
            raise UsageError(f"demo: --sweep runs its own modes and budgets, graphed, without "
                             f"shared prefixes: leave out --{flag}")
    if ns.sweep_offload == "predict" and ns.mtp > 1:
        raise UsageError("demo: --sweep-offload predict stages for single-step swaps: not with "
                         "--mtp 2-4")
    from ._config import host_memory_bytes

    host = ns.host_gb if ns.host_gb is not None else 0.8 * host_memory_bytes() / GB
    try:
        _gb("--host-gb", host)
        _gb("--gpu-budget", ns.gpu_budget)
        for n in ns.concurrency or ():
            _checks.integer("--concurrency", n, 1)
    except ValueError as e:
        raise UsageError(f"demo: {e}") from None
    return {"gpu_budget_gb": ns.gpu_budget, "host_gb": host,
            "concurrencies": sorted(set(ns.concurrency)) if ns.concurrency else None,
            "offload": ns.sweep_offload}


@dataclass(frozen=True)
class PlanRow:
    """One concurrency: GPU GB each mode needs (gpu-only, managed at its ``resident`` count,
    sparse) and whether it fits the budget; the host pool's GB and whether it fits."""

    concurrency: int
    gpu_only_gb: float
    gpu_only_fits: bool
    resident: int  # requests the managed mode keeps resident; -1: no split fits
    managed_gb: float  # at ``resident`` (at all sparse where nothing fits)
    sparse_gb: float
    sparse_fits: bool
    host_gb: float
    host_fits: bool


def _per_request(T: int, s: Shape) -> tuple[int, int, int, int]:
    """Bytes one request of ``T`` tokens needs: gpu-only (every layer's KV and the indexer's
    key cache), fixed on the GPU in the cache's modes (the key cache, the resident layers),
    the host pool's pages; and one device row of every cached layer."""
    row_layer = s.cached_layers * s.row_bytes
    pages = -(-T // s.page_tokens)
    gpu_only = T * (s.layers * s.row_bytes + s.full_layers * s.indexer_bytes)
    fixed = T * (s.full_layers * s.indexer_bytes + s.resident_layers * s.row_bytes)
    return gpu_only, fixed, pages * s.page_tokens * row_layer, row_layer


def plan(context: int, steps: int, concurrencies, *, gpu_budget_gb: float, host_gb: float,
         shape: Shape = Shape()) -> list[PlanRow]:
    """The plan of each concurrency (see the module docstring)."""
    from ..residency import DeviceBudget

    T = _tokens(context, steps)
    budget, host_cap = _gb("gpu_budget_gb", gpu_budget_gb), _gb("host_gb", host_gb)
    gpu_only, fixed, host, row_layer = _per_request(T, shape)
    sizes = dict(page_tokens=shape.page_tokens, block_rows=shape.block_rows())
    out = []
    for n in concurrencies:
        n = _checks.integer("concurrency", n, 1)
        room = max(0, budget - n * fixed) // row_layer  # device rows the budget leaves
        k = DeviceBudget.max_resident([T] * n, room, **sizes)
        k0 = max(k, 0)
        managed = n * fixed + DeviceBudget.rows_needed([T] * k0, n - k0, **sizes) * row_layer
        sparse = n * fixed + DeviceBudget.rows_needed([], n, **sizes) * row_layer
        out.append(PlanRow(n, n * gpu_only / GB, n * gpu_only <= budget, k, managed / GB,
                           sparse / GB, sparse <= budget, n * host / GB, n * host <= host_cap))
    return out


def host_max(context: int, steps: int, *, host_gb: float, shape: Shape = Shape()) -> int:
    """The most requests of ``context + steps`` tokens whose cached layers' KV the host
    memory holds (pages of ``page_tokens``)."""
    return _gb("host_gb", host_gb) // _per_request(_tokens(context, steps), shape)[2]


def gpu_only_max(context: int, steps: int, *, gpu_budget_gb: float,
                 shape: Shape = Shape()) -> int:
    """The most requests gpu-only fits in the budget (KV and the indexer's key cache)."""
    return _gb("gpu_budget_gb", gpu_budget_gb) // _per_request(_tokens(context, steps),
                                                                shape)[0]


def concurrencies(context: int, steps: int, *, host_gb: float, gpu_budget_gb: float,
                  shape: Shape = Shape()) -> list[int]:
    """The sweep's rows: 1, 2, 4, ... below :func:`host_max`, then it, and gpu-only's
    maximum (:func:`gpu_only_max`) where it lies below."""
    top = host_max(context, steps, host_gb=host_gb, shape=shape)
    if top < 1:
        raise ValueError(f"host_gb {host_gb}: not even one request of {context} tokens fits")
    ns = {1 << i for i in range(top.bit_length())} | {top}
    g = gpu_only_max(context, steps, gpu_budget_gb=gpu_budget_gb, shape=shape)
    return sorted(n for n in ns | ({g} if g >= 1 else set()) if n <= top)


def _tokens(context: int, steps: int) -> int:
    return _checks.integer("context", context, 1) + _checks.integer("steps", steps, 0)


def _gb(name: str, value: float) -> int:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a number > 0 (GB), got {value!r}")
    return int(value * GB)
