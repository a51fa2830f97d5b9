"""The decode loop's command line: every knob a flag, in groups (``--help`` describes the
common ones and names the others; ``--help-all`` describes every one), and the configuration it
makes (:func:`from_args` for the GPU loop, :func:`cpu_config` for the NumPy backend).
NumPy-free and CuPy-free."""

from __future__ import annotations

import argparse
import shutil
import textwrap

from .._cli.usage import EXIT_STATUSES, UsageError, output_file
from ._config import (
    CPU_DEFAULTS,
    CPU_REFUSED,
    MODELS,
    MODES,
    REPLAY_ROWS_PER_WARP,
    ROW_FORMATS,
    Config,
    auto_resident,
)
from ._sweep import add_arguments, sweep_args

__all__ = ["cpu_config", "from_args", "given", "parser"]

class _Defaults(argparse.RawDescriptionHelpFormatter):
    """Help with ``(default: X)`` appended where it says something: not for flags (their
    default is off), an unset option, or a help that names its default itself; an
    ``--x/--no-x`` pair names the one that is the default. The description and epilog are
    wrapped by :func:`parser` (they hold lists)."""

    def _get_help_string(self, action):
        h = action.help or ""
        if isinstance(action, argparse.BooleanOptionalAction):
            h = h.replace(" (default: %(default)s)", "")  # (what Python 3.10-3.12 append)
            on, off = action.option_strings[:2]
            return f"{h} (default: {on if action.default else off})"
        if "default" in h or action.default in (None, False, argparse.SUPPRESS) or \
                not action.option_strings:
            return h
        return h + " (default: %(default)s)"


class _HelpAll(argparse.Action):
    """``--help-all``: every option, described, then exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, ap, namespace, values, option_string=None):
        parser(full=True).print_help()
        ap.exit()


def _fill(text: str, indent: str = "") -> str:
    """``text`` wrapped as argparse wraps the options' help (the terminal's width less 2)."""
    width = max(min(shutil.get_terminal_size().columns, 102) - 2, 40)
    return textwrap.fill(text, width, subsequent_indent=indent, break_on_hyphens=False)


def _budget(value: str) -> float | str | None:
    """``--device-budget``: "auto", 0 (None: no budget) or GB > 0."""
    if value == "auto":
        return value
    try:
        gb = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"auto or a number of GB, got {value!r}") from None
    if gb < 0:
        raise argparse.ArgumentTypeError(f"must be auto, 0 or > 0 GB, got {value}")
    return gb or None


def parser(full: bool = False) -> argparse.ArgumentParser:
    """The demo's parser. Every flag parses either way; ``full=False`` (what ``--help`` shows)
    describes the common groups and lists the other groups' flags by name."""
    d = Config()
    ap = argparse.ArgumentParser(prog="python -m hisparse_cupy demo", formatter_class=_Defaults,
                                 usage="%(prog)s [options]")
    hidden: dict[str, list[str]] = {}

    def group(title: str, common: bool):
        g = ap.add_argument_group(title)

        def add(*flags, **kw):
            if not (common or full):
                kw["help"] = argparse.SUPPRESS
                hidden.setdefault(title, []).append(
                    "/".join(flags + (("--no-" + flags[0][2:],) if kw.get("action") is
                                      argparse.BooleanOptionalAction else ())))
            return g.add_argument(*flags, **kw)

        return add

    ap.add_argument("--help-all", action=_HelpAll, help="describe every option and exit")
    a = group("size", common=True)
    a("--layers", type=int, default=d.layers, help="layers (GLM-5.2 has 78)")
    a("--batch", type=int, default=d.batch, help="requests decoded together")
    a("--context", type=int, default=d.context, help="prompt tokens per request")
    a("--steps", type=int, default=d.steps, help="timed decode steps")
    a("--warmup", type=int, default=d.warmup, help="decode steps before timing")
    a("--top-k", type=int, default=d.top_k, help="entries of each layer's top-k (K)")
    a("--hot", type=int, default=d.hot, help="hot slots per request (H)")
    a = group("what runs", common=True)
    a("--mode", action="append", choices=MODES,
      help="modes to run (repeatable; default all, without predict at --mtp 2-4; gpu-only "
           "always runs as the reference; predict = overlap + prediction)")
    a("--eager", action="store_true", help="run each step eagerly (a Python loop; default: "
                                           "each step a captured CUDA graph)")
    a = group("output", common=True)
    a("--json", default=None, metavar="FILE", help="write the results as JSON to this file")
    a("--png", default=None, metavar="FILE",
      help="plot ITL per step per mode to this PNG (needs matplotlib)")
    a("--quiet", action="store_true", help="no progress lines")

    a = group("top-k lists", common=False)
    a("--pattern", default=None, help="full/shared layers as F/S characters (default: GLM-5.2's "
                                      "IndexCache rule, every 4th layer full from layer 2)")
    a("--topk-model", choices=("drift", "lru"), default=d.topk_model,
      help="drift: each full layer's top-k keeps its tokens but --new-share a step; lru: drawn "
           "by LRU stack depth on the published miss curve (30 / 13.4 / 6.7 %% at H = K / 2K / "
           "4K), --layer-overlap between full layers (hisparse_cupy.demo._topk_model)")
    a("--seed", type=int, default=None, help=f"lru: the streams' random seed (default {d.seed})")
    a("--new-share", type=float, default=None,
      help=f"drift: share of each top-k replaced by new tokens per step (0.01 = 1%%; default "
           f"{d.new_share})")
    a("--recent", type=int, default=d.recent, help="newest tokens every top-k holds")
    a("--step-overlap", type=float, default=d.step_overlap,
      help="lru: share of a top-k the previous step selected (sets the curve at H = K; "
           "default: the curve's 0.70)")
    a("--layer-overlap", type=float, default=d.layer_overlap,
      help="lru: share of a full layer's top-k the previous full layer selected (default 0.8)")
    a = group("model", common=False)
    a("--model", choices=tuple(MODELS), default=d.model,
      help=f"the MLP stand-in's size: glm52 (hidden {MODELS['glm52']}: a gpu-only step of "
           f"about a published GLM-5.2 per-GPU decode step on an H200, docs/design.md section "
           f"11) or light (hidden {MODELS['light']}, the earlier model)")
    a("--hidden", type=int, default=None,
      help="hidden size of the MLP stand-in (default: --model's; given: model custom)")
    a("--indexer", action=argparse.BooleanOptionalAction, default=d.indexer,
      help="the lightning indexer's cost (64 heads x 128 dims over every token's 132-byte key "
           "on every full layer, its key cache on the GPU in every mode)")
    a("--matmul", choices=("cublas", "torch"), default=d.matmul,
      help="the layer matmuls: cuBLAS called directly (default) or torch.matmul on the step's "
           "stream (what an engine written in PyTorch runs; needs torch)")
    a = group("modes and execution", common=False)
    a("--row", choices=sorted(ROW_FORMATS), default=d.row,
      help="the cached KV rows: fp8, GLM-5.2's (656 B: 512 e4m3 latent values, 4 float32 "
           "scales, 64 bf16 RoPE values), or bf16 (576 values, 1152 B)")
    a("--mtp", type=int, default=d.mtp,
      help="draft steps per swap (2-4: multi-step swap; on the lru streams a call's drafts are "
           "consecutive draws of each full layer's stream)")
    a("--no-predict", action="store_true", help="leave the predict mode out")
    a("--predict-rule", choices=("selection", "misses"), default=d.predict_rule,
      help="what the predict mode stages of a full layer's top-k that the next one does not "
           "hold: all it selected (default) or only the tokens it missed")
    a("--predict-at", choices=("swap", "indexer"), default=d.predict_at,
      help="predict mode stages after the swap (default) or in the next indexer's window")
    a("--graph", action="store_true", help="run each step as a captured CUDA graph (default)")
    a("--eager-and-graph", action="store_true", help="run both eager and graphed")
    a("--side-sms", type=int, default=d.side_sms,
      help="SMs of an SM partition for the side streams (green contexts, rounded up to the "
           "device's groups: 8 on Hopper; the step runs on the rest, its matmuls told to leave "
           "them); 0: no partition (benchmarks/NOTES.md says why that is the default)")
    a("--no-partition", action="store_true", help="no SM partition (the default; --side-sms 0)")
    a("--replay-grid", type=int, default=d.replay_grid, metavar="G",
      help="copy blocks of each side-stream replay and of the prediction stager (default: "
           "the Prefetcher's, an eighth of the SMs, or the partition's side SMs)")
    a("--replay-rows-per-warp", type=int, default=d.replay_rows_per_warp, metavar="R",
      choices=REPLAY_ROWS_PER_WARP,
      help="rows each replay warp keeps in flight (default: the Prefetcher's, 4; 8 on a "
           "partition)")
    a("--group-replay-batch", type=int, default=d.group_replay_batch, metavar="N",
      help="batches of at most N rows replay each group of shared layers in one launch and "
           "wait once (default: the Prefetcher's, 2); 0: layer by layer")
    a = group("device memory", common=False)
    a("--device-budget", type=_budget, default="auto", metavar="GB",
      help="the offloaded modes' device rows as a budget (docs/design.md section 10): requests "
           "resident (all their KV on the GPU) while it holds them, sparse beyond; auto (the "
           "default): every request resident if the GPU's free memory holds them, else as "
           "many as it holds; GB: that many; 0: no budget, every request sparse (the hot "
           "buffer path alone)")
    a("--resident-requests", type=int, default=d.resident_requests, metavar="K",
      help="a device budget sized for K requests resident at their longest and a sparse "
           "block for each of the others (DeviceBudget.rows_needed): K = --batch runs every "
           "request resident, K = 0 every one sparse")
    a("--lean", action=argparse.BooleanOptionalAction, default=d.lean,
      help="with a device budget holding every request resident, run the steps lean; "
           "--no-lean runs them as a mixed batch would (begin_step(lean=False): full layers' "
           "copy launches, shared layers' replays)")
    a("--resident-layers", type=int, default=None, metavar="N",
      help="layers 0 .. N-1 keep their whole KV on the GPU in every mode, the cache holds the "
           "rest (default: lru, the generator's low-overlap layers, whose top-k shares about "
           "1.5 %% with the previous step so that no hot buffer holds it; drift, 0)")
    a("--extra-page", type=int, default=d.extra_page, help="slots after the hot slots (P)")
    a("--shared-prefix", type=int, default=d.shared_prefix, metavar="N",
      help="requests 1.. are forks of request 0 sharing the host pages of its first N tokens")
    add_arguments(group("load sweep (--sweep; docs/design.md section 11)", common=False))
    ap.description = _fill(
        "A decode loop over a hierarchical sparse KV cache: a synthetic sparse-attention model "
        "(MLA rows of 576 values, FP8 as GLM-5.2 caches them or bf16; 16 heads) run GPU-only, "
        "offloaded, offloaded with IndexCache overlap, and with overlap and prediction; the "
        "offloaded modes must reproduce the GPU-only attention outputs bit for bit. By default "
        "each step is a CUDA graph.")
    more = ["more options (--help-all describes them):"] + [
        _fill(f"  {title}: {' '.join(flags)}", "    ") for title, flags in hidden.items()]
    cpu = _fill("Without a GPU the same algorithm runs on the NumPy reference backend: flags "
                "not given take small values there (" + ", ".join(
                    f"--{k.replace('_', '-')} {0 if v is None else v}"
                    for k, v in CPU_DEFAULTS.items()) + "); "
                f"{', '.join(CPU_REFUSED)} need the GPU loop and are refused.")
    ap.epilog = "\n\n".join(([] if full else ["\n".join(more)]) + [cpu, EXIT_STATUSES])
    return ap


def given(argv=None) -> set[str]:
    """The destinations of the flags ``argv`` sets (whatever their values)."""
    ap = parser()
    # a namespace that has every destination already, so no default is applied: a marker, or
    # None where a flag appends to what is there
    unset = object()
    ns = argparse.Namespace(**{k: None if v is None or isinstance(v, list) else unset
                               for k, v in vars(ap.parse_args([])).items()})
    return {k for k, v in vars(ap.parse_args(argv, namespace=ns)).items()
            if v is not unset and v is not None}


def cpu_config(argv=None) -> Config:
    """The NumPy backend's configuration: the flags given, small values for the others;
    :class:`UsageError` naming a flag it cannot honour."""
    cfg = from_args(argv, check=False)  # first: --help and bad values as for the GPU loop
    ns = given(argv)
    refused = [f for f in CPU_REFUSED if f[2:].replace("-", "_") in ns
               and (f != "--mtp" or cfg.mtp > 1)
               and (f != "--mode" or bool({"overlap", "predict"} & set(cfg.modes)))
               and (f != "--side-sms" or bool(cfg.side_sms))
               and (f != "--predict-rule" or cfg.predict_rule != "selection")
               and (f != "--predict-at" or cfg.predict_at != "swap")
               and (f != "--matmul" or cfg.matmul != "cublas")
               and (f != "--model" or cfg.model != Config.model)
               and (f != "--resident-layers" or cfg.resident_layers > 0)
               and (f != "--device-budget" or cfg.device_budget is not None)]
    if refused:
        raise UsageError(f"demo: {' and '.join(refused)} need{'s' if len(refused) == 1 else ''} "
                         f"the GPU decode loop; the NumPy reference backend runs single-step "
                         f"offload against gpu-only, eager, without a GPU")
    for k, v in CPU_DEFAULTS.items():
        if k not in ns:
            setattr(cfg, k, v)
    # the small values give way to the flags given
    if "layers" not in ns and cfg.pattern:
        cfg.layers = len(cfg.pattern)
    if "extra_page" not in ns:
        cfg.extra_page = max(cfg.extra_page, cfg.recent)
    if "hot" not in ns:
        cfg.hot = max(cfg.hot, cfg.top_k)
    if "context" not in ns:
        cfg.context = max(cfg.context, cfg.hot + cfg.top_k + 256)
    cfg.check()
    return cfg


def from_args(argv=None, *, check: bool = True) -> Config:
    ns = parser().parse_args(argv)
    for option, path in (("--json", ns.json), ("--png", ns.png)):
        if path is not None:  # before any work: a run's results are not lost at its end
            output_file("demo", option, path)
    if ns.eager and (ns.graph or ns.eager_and_graph):
        raise UsageError("demo: --eager runs eagerly only: leave out --graph / --eager-and-graph")
    if ns.mode and "predict" in ns.mode and ns.no_predict:
        raise UsageError("demo: --mode predict and --no-predict contradict each other")
    if ns.new_share is not None and ns.topk_model != "drift":
        raise UsageError("demo: --new-share shapes the drift model: add --topk-model drift")
    if ns.seed is not None and ns.topk_model != "lru":
        raise UsageError("demo: --seed draws the lru streams (the drift model has none)")
    if ns.hidden is not None and ns.model != Config.model:
        raise UsageError("demo: --hidden sets the model's size itself: give --model or --hidden")
    if ns.no_partition and ns.side_sms:
        raise UsageError("demo: --no-partition and --side-sms N contradict each other")
    # prediction stages single-step swaps: the default modes leave it out at --mtp 2-4
    modes = ns.mode or [m for m in MODES[1:]
                        if m != "predict" or not (ns.no_predict or ns.mtp > 1)]
    modes = tuple(dict.fromkeys(["gpu-only"] + modes))
    execs = ("eager", "graph") if ns.eager_and_graph else (("eager",) if ns.eager else ("graph",))
    side = 0 if ns.no_partition else ns.side_sms
    cfg = Config(layers=ns.layers, pattern=ns.pattern, batch=ns.batch, context=ns.context,
                 steps=ns.steps, warmup=ns.warmup,
                 new_share=Config.new_share if ns.new_share is None else ns.new_share,
                 recent=ns.recent,
                 topk_model=ns.topk_model, step_overlap=ns.step_overlap,
                 layer_overlap=ns.layer_overlap,
                 top_k=ns.top_k, hot=ns.hot, extra_page=ns.extra_page,
                 model=ns.model if ns.hidden is None else "custom",
                 hidden=MODELS[ns.model] if ns.hidden is None else ns.hidden,
                 indexer=ns.indexer,
                 mtp=ns.mtp, row=ns.row, modes=modes,
                 seed=Config.seed if ns.seed is None else ns.seed,
                 side_sms=side, replay_grid=ns.replay_grid,
                 replay_rows_per_warp=ns.replay_rows_per_warp,
                 group_replay_batch=ns.group_replay_batch, predict_rule=ns.predict_rule,
                 predict_at=ns.predict_at, matmul=ns.matmul,
                 shared_prefix=ns.shared_prefix, device_budget=ns.device_budget,
                 resident_requests=ns.resident_requests, lean=ns.lean,
                 execs=execs, json=ns.json, png=ns.png, quiet=ns.quiet)
    cfg.resident_layers = auto_resident(cfg) if ns.resident_layers is None else \
        ns.resident_layers
    cfg.sweep = sweep_args(ns, given(argv))
    if check:
        cfg.check()
    return cfg
