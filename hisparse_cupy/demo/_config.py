"""The decode loop's configuration: every knob a flag, and the memory a configuration needs
(computed before anything is allocated). NumPy-free and CuPy-free."""

from __future__ import annotations

import dataclasses
import os

from .._cli.usage import UsageError

ROW_VALUES, V_VALUES, HEADS = 576, 512, 16  # an MLA row: latent (512, the value) + rope (64)
# --row: a cached row's bytes. fp8: GLM-5.2's (512 e4m3 latent values, 4 float32 scales, one
# per 128 of them, 64 bf16 RoPE values); bf16: 576 bf16 values (model.cu says how each is read)
ROW_FORMATS = {"fp8": 512 + 4 * 4 + 2 * 64, "bf16": 2 * ROW_VALUES}
PAGE_TOKENS = 64  # tokens per page of the host pool (both backends)
GB = 1e9
DEVICE_PAGE = 64  # tokens a device page of the budget holds (--device-budget, --resident-requests)
AUTO_RESERVE = 4 << 30  # --device-budget auto leaves this much GPU memory free (buffers, tables)
MODES = ("gpu-only", "offload", "overlap", "predict")  # predict: overlap + prediction
REPLAY_ROWS_PER_WARP = (1, 2, 4, 8)  # the copy kernel's choices (build.COPY_ROWS_PER_WARP)
# --model: the MLP stand-in's hidden size. glm52: a gpu-only step of about a published GLM-5.2
# per-GPU decode step on an H200 (docs/design.md section 11); light: the earlier, lighter model
MODELS = {"glm52": 27136, "light": 4096}
INDEXER_ROW, INDEXER_QUERY = 132, 64 * 128  # key bytes a token and layer, query bytes (Indexer)


@dataclasses.dataclass
class Config:
    layers: int = 78
    pattern: str | None = None  # F/S string; default: GLM-5.2's rule (freq 4, offset 3)
    batch: int = 32
    context: int = 8192  # prompt tokens per request
    steps: int = 200  # timed steps
    warmup: int = 20
    new_share: float = 0.05  # share of each top-k replaced per step (drift model)
    topk_model: str = "lru"  # demo.topk_model's streams, or "drift"
    seed: int = 0  # the lru streams' generator
    row: str = "fp8"  # the cached rows' format (ROW_FORMATS)
    step_overlap: float | None = None  # lru: the curve's H = K point (None: the curve's own)
    layer_overlap: float | None = None  # lru (None: 0.8)
    recent: int = 8  # newest tokens always selected
    top_k: int = 2048
    hot: int = 4096
    extra_page: int = 64
    model: str = "glm52"  # a name of MODELS, or "custom" (--hidden given)
    hidden: int = MODELS["glm52"]
    indexer: bool = True  # the lightning indexer's cost on every full layer (demo._model.Indexer)
    mtp: int = 1  # draft steps per call (2-4: the multi-step swap)
    modes: tuple[str, ...] = ("gpu-only", "offload", "overlap", "predict")
    execs: tuple[str, ...] = ("graph",)
    side_sms: int = 0  # SMs of the SM partition's side group (0: no partition)
    replay_grid: int | None = None  # Prefetcher(replay_grid=) (None: its default)
    replay_rows_per_warp: int | None = None  # Prefetcher(replay_rows_per_warp=)
    group_replay_batch: int | None = None  # Prefetcher(group_replay_batch=)
    predict_rule: str = "selection"  # the prediction stager's rule (Prefetcher(predict_rule=))
    predict_at: str = "swap"  # when prediction stages (Prefetcher(predict_at=))
    matmul: str = "cublas"  # the layer matmuls: cuBLAS through ctypes, or torch.matmul
    shared_prefix: int = 0  # requests 1.. share request 0's first N tokens (host pages)
    # GB of device rows for the cache, "auto" (every request resident while the GPU holds
    # it: the command line's default) or None (no budget: every request sparse)
    device_budget: float | str | None = None
    lean: bool = True  # steps run lean while every request is resident (begin_step(lean=None))
    resident_requests: int | None = None  # a budget sized for this many resident, the rest sparse
    resident_layers: int = 0  # layers 0 .. N-1 keep their KV on the GPU (from_args: auto)
    sweep: dict | None = None  # --sweep: demo._sweep.sweep_args (None: the modes at --batch)
    json: str | None = None
    png: str | None = None
    quiet: bool = False

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def max_len(self) -> int:
        return self.context + self.total_steps

    @property
    def queries(self) -> int:
        return self.batch * self.mtp

    def pattern_obj(self):
        from ..streams import layer_pattern

        p = layer_pattern(str(self.pattern) if self.pattern else (self.layers, 4, 3))
        p.check_length(self.layers, "--layers")
        return p

    def check(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise UsageError(f"demo: {msg}")

        need(self.layers >= 1, f"--layers must be >= 1, got {self.layers}")
        need(self.row in ROW_FORMATS, f"--row must be one of {sorted(ROW_FORMATS)}, got "
                                      f"{self.row!r}")
        need(self.hidden >= 64 and self.hidden % 64 == 0,
             f"--hidden must be a multiple of 64, >= 64, got {self.hidden}")
        need(self.model == "custom" or MODELS.get(self.model) == self.hidden,
             f"model {self.model!r} has hidden {MODELS.get(self.model)}, got {self.hidden} "
             f"(a hidden size of its own is model 'custom')")
        need(self.batch >= 1, f"--batch must be >= 1, got {self.batch}")
        need(self.device_budget in (None, "auto") or self.device_budget > 0,
             f"--device-budget must be auto, 0 or > 0 GB, got {self.device_budget}")
        need(self.resident_requests is None or 0 <= self.resident_requests <= self.batch,
             f"--resident-requests must be in [0, --batch], got {self.resident_requests}")
        need(self.resident_requests is None or self.device_budget in (None, "auto"),
             "--resident-requests sizes the device budget itself: give it or --device-budget")
        need(self.steps >= 1 and self.warmup >= 0,
             f"--steps must be >= 1 and --warmup >= 0, got {self.steps} and {self.warmup}")
        need(1 <= self.top_k <= self.hot, f"--top-k must be in [1, --hot={self.hot}]")
        need(self.top_k % 16 == 0, f"--top-k must be a multiple of 16, got {self.top_k}")
        need(0 <= self.recent < self.top_k and self.recent >= 1,
             f"--recent must be in [1, --top-k), got {self.recent}")
        need(self.context > self.hot + self.top_k,
             f"--context ({self.context}) must exceed --hot + --top-k ({self.hot + self.top_k})"
             " so that tokens leaving the window are evicted before they return")
        need(0.0 < self.new_share <= 0.5, f"--new-share must be in (0, 0.5], got "
                                          f"{self.new_share}")
        need(1 <= self.mtp <= 4, f"--mtp must be 1 (off) or 2..4, got {self.mtp}")
        need(self.mtp * self.top_k <= 8192, "--mtp x --top-k must be <= 8192")
        need(self.extra_page >= self.recent, "--extra-page must be >= --recent")
        need(self.pattern != "", "--pattern must not be empty")
        need(self.topk_model in ("drift", "lru"),
             f"--topk-model must be drift or lru, got {self.topk_model!r}")
        need(self.step_overlap is None or 0.0 <= self.step_overlap <= 1.0,
             f"--step-overlap must be in [0, 1], got {self.step_overlap}")
        need(self.layer_overlap is None or 0.0 <= self.layer_overlap <= 1.0,
             f"--layer-overlap must be in [0, 1], got {self.layer_overlap}")
        need(self.topk_model == "lru" or (self.step_overlap, self.layer_overlap) == (None, None),
             "--step-overlap and --layer-overlap shape --topk-model lru's streams")
        need(self.mtp == 1 or "predict" not in self.modes,
             "--mode predict is single-step (prediction stages single-step swaps): with --mtp "
             "2-4 leave it out (--no-predict)")
        need(self.side_sms >= 0,
             f"--side-sms must be >= 0, got {self.side_sms}")
        need(self.replay_grid is None or self.replay_grid >= 1,
             f"--replay-grid must be >= 1, got {self.replay_grid}")
        need(self.replay_rows_per_warp is None or
             self.replay_rows_per_warp in REPLAY_ROWS_PER_WARP,
             f"--replay-rows-per-warp must be one of {REPLAY_ROWS_PER_WARP}, got "
             f"{self.replay_rows_per_warp}")
        need(self.group_replay_batch is None or self.group_replay_batch >= 0,
             f"--group-replay-batch must be >= 0, got {self.group_replay_batch}")
        need(self.seed >= 0, f"--seed must be >= 0, got {self.seed}")
        need(0 <= self.shared_prefix <= self.context,
             f"--shared-prefix must be in [0, --context], got {self.shared_prefix}")
        need(0 <= self.resident_layers < self.layers,
             f"--resident-layers must be in [0, --layers), got {self.resident_layers}")
        if self.pattern is not None:
            try:
                self.pattern_obj()
            except ValueError as e:
                need(False, f"--pattern {self.pattern!r}: {e}")
        if 0 < self.resident_layers < self.layers:
            need(self.pattern_obj().full[self.resident_layers],
                 f"--resident-layers {self.resident_layers}: the first offloaded layer must be a "
                 f"full layer (layer {self.resident_layers} is shared)")
        bad = set(self.modes) - set(MODES)
        need(not bad, f"unknown --mode {sorted(bad)}")

    def budget_rows(self, cached_layers: int, free_bytes: int) -> int | None:
        """The offloaded modes' device budget, rows per cached layer (docs/design.md section
        10): for ``--resident-requests`` K, K requests resident at their longest and a block
        for each other; ``--device-budget auto``, every request resident if ``free_bytes``
        (less :data:`AUTO_RESERVE`) holds them, else what they hold (at least a block each);
        GB, that over the cached layers; None: no budget."""
        from .._tables import rows_needed
        from ..residency import DeviceBudget

        block = rows_needed(max_requests=1, hot_size=self.hot, top_k=self.top_k,
                            extra_page=self.extra_page, max_steps=self.mtp)

        def rows(k: int) -> int:
            return DeviceBudget.rows_needed([self.max_len] * k, self.batch - k,
                                            page_tokens=DEVICE_PAGE, block_rows=block)

        row = cached_layers * self.row_bytes  # a row in every cached layer
        if self.resident_requests is not None:
            return rows(self.resident_requests)
        if self.device_budget == "auto":
            return max(rows(0), min(rows(self.batch), (free_bytes - AUTO_RESERVE) // row))
        return None if self.device_budget is None else int(self.device_budget * GB) // row

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's cached row in one layer (:data:`ROW_FORMATS`)."""
        return ROW_FORMATS[self.row]

    @property
    def fp8(self) -> bool:
        """Whether the rows are FP8 (``model.cu``'s ``fp8`` argument)."""
        return self.row == "fp8"

    def scratch(self) -> int:
        from .._abi import default_scratch

        return 0 if self.mtp < 2 else default_scratch(self.hot, self.top_k, self.mtp)

    def memory(self) -> dict[str, float]:
        """Bytes each part needs (before allocating)."""
        L, B, R = self.layers, self.batch, self.resident_layers
        layer = B * self.max_len * self.row_bytes  # one layer's KV, every request
        hot = (L - R) * B * (self.hot + self.extra_page + self.scratch()) * self.row_bytes
        Q = self.queries
        model = 2 * (HEADS * V_VALUES * self.hidden + self.hidden * HEADS * ROW_VALUES) + \
            Q * 2 * (self.hidden + HEADS * ROW_VALUES + HEADS * V_VALUES) + \
            Q * 64 * HEADS * (V_VALUES + 2) * 4
        n_full = len(self.pattern_obj().full_layers)
        if self.topk_model == "lru":  # the streams' table: [steps * S, n_full, B, K] int32
            model += self.total_steps * n_full * Q * self.top_k * 4
        # the indexer's key cache (every mode), its queries and scores
        indexer = (n_full * B * self.max_len * INDEXER_ROW +
                   Q * (INDEXER_QUERY + 4 * self.max_len) if self.indexer else 0)
        offload = any(m != "gpu-only" for m in self.modes)
        return {"host_pinned": (L - R) * layer if offload else 0, "gpu_resident": L * layer,
                "gpu_hot": hot + R * layer if offload else 0, "gpu_model": model,
                "gpu_indexer": indexer}

    def describe_memory(self) -> str:
        m = self.memory()
        what = "the offloaded layers' KV" if self.resident_layers else "the full KV"
        return (f"memory: {m['host_pinned'] / GB:.1f} GB pinned host ({what}), GPU "
                f"{m['gpu_resident'] / GB:.1f} GB resident KV (gpu-only mode) + "
                f"{m['gpu_hot'] / GB:.1f} GB hot buffers (offloaded modes"
                + (f"; with layer{self.resident_span()}'s "
                   f"{self.resident_layers * m['gpu_resident'] / self.layers / GB:.2f} GB "
                   f"resident" if self.resident_layers else "") + ") + "
                f"{m['gpu_model'] / GB:.2f} GB model"
                + (" and top-k streams" if self.topk_model == "lru" else "")
                + (f" + {m['gpu_indexer'] / GB:.2f} GB indexer key cache (every mode)"
                   if self.indexer else "")
                + "; the modes run one after another")

    def resident_span(self) -> str:
        R = self.resident_layers
        return " 0" if R == 1 else f"s 0-{R - 1}"

    def describe_resident(self) -> str:
        """The line that says which layers stay on the GPU and why."""
        R = self.resident_layers
        if not R:
            return ("resident layers: none, every layer offloaded (--resident-layers N keeps "
                    "layers 0..N-1 on the GPU)")
        why = (": the generator's low-overlap layers, whose top-k shares about 1.5 % with the "
               "previous step, so a hot buffer would miss most of it every step"
               if R == auto_resident(self) else "")
        one = R == 1
        return (f"resident layers: layer{self.resident_span()} "
                f"{'keeps its' if one else 'keep their'} KV on the GPU in every mode" + why +
                f"; --resident-layers 0 offloads {'it' if one else 'them'} too")



def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


# the NumPy backend's values for flags not given, and the flags it cannot honour
CPU_DEFAULTS = {"layers": 8, "batch": 2, "context": 1536, "steps": 12, "warmup": 0,
                "top_k": 128, "hot": 512, "extra_page": 8, "recent": 4, "resident_layers": 0,
                "device_budget": None}
CPU_REFUSED = ("--mtp", "--mode", "--graph", "--eager-and-graph", "--png", "--hidden",
               "--model", "--side-sms", "--predict-rule", "--predict-at", "--matmul",
               "--resident-layers", "--replay-grid", "--replay-rows-per-warp",
               "--group-replay-batch", "--device-budget", "--resident-requests", "--sweep",
               "--row")
# (accepted: what the NumPy backend runs, e.g. --mtp 1, --eager, --no-lean, --device-budget 0)


def auto_resident(cfg: Config) -> int:
    """``--resident-layers``' default: with lru streams, the layers before the first full layer
    past the generator's low-overlap ones (GLM-5.2's pattern: layers 0 and 1); else 0."""
    from ._topk_model import StreamShape

    if cfg.topk_model != "lru":
        return 0
    try:
        full = cfg.pattern_obj().full_layers
    except ValueError:
        return 0  # (check() names the bad --pattern)
    low = StreamShape.low_layers
    return full[low] if len(full) > low else 0
