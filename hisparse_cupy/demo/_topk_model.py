"""Top-k streams shaped like published sparse-attention selections, and their measured shape.

Each full layer of each request keeps an LRU recency stack of its tokens, most recent first; a
step's top-k draws its entries by *stack depth*, so an exact LRU hot buffer of H slots misses
exactly the entries drawn at depth >= H. The shape is set by:

- ``curve``: the exact-LRU miss rate at a few hot-buffer sizes, as ``(H / K, miss)`` points.
  The default is the HiSparse paper's GLM-5.1 measurement (K 2048, LongBenchV2): 30 % at H = K,
  13.4 % at 2K, 6.7 % at 4K. Entries are drawn uniformly within each band of depths between two
  points, and past the last point, over the rest of the stack.
- ``layer_overlap``: the share of a full layer's entries that the previous full layer selected
  in the same step (IndexCache measured 70-100 % for adjacent DSA layers; default 0.8), the
  same share of every depth band where the previous layer's tokens suffice, so the misses
  follow the previous layer as the hits do (what prediction stages from).
- ``low_layers`` and ``low_overlap``: the first full layers draw almost nothing from the
  previous step. TensorRT-LLM measured about 1.5 % step-to-step overlap in DeepSeek-V3.2's
  layers 0-1; the default is 2 such layers at 0.015. They copy nothing from another layer.
- ``recent``: the newest tokens every top-k holds (the newest token included).

One consequence of exact LRU: when every step selects K distinct tokens, a hot buffer of H = K
slots holds exactly the previous step's selection. So the step-to-step overlap is
``1 - miss(H = K)``, 70 % with the default curve. TensorRT-LLM's 44 % in DeepSeek-V3.2's middle
layers is another model, and no single stream has both. :meth:`StreamShape.from_overlap` sets
the curve's first point from a step overlap and keeps the rest (e.g. 0.44 -> 56 % at H = K).

:func:`measure` re-derives the statistics from the generated top-k alone: exact-LRU miss rate
per H (from the streams' starting history), step overlap, layer overlap, and the share of the
misses that the previous layer selected (or missed too). The demo prints
them beside its figures, so the shape is checked, not assumed. NumPy only.

The curve holds where the stacks are deep enough: a context of at least twice the last point's
H (16384 tokens for the default at K 2048). A shorter context has no room for the deepest
band; its draws then go to the deepest tokens left (misses at every H the stack can hold), and
fewer of the previous layer's tokens lie deep, so fewer misses follow it (the demo's 8192-token
default: the curve at H = K and 2K holds, 60-65 % of the misses follow).
"""

from __future__ import annotations

import dataclasses

import numpy as np

DEFAULT_CURVE = ((1.0, 0.30), (2.0, 0.134), (4.0, 0.067))


@dataclasses.dataclass(frozen=True)
class StreamShape:
    curve: tuple[tuple[float, float], ...] = DEFAULT_CURVE
    layer_overlap: float = 0.8
    low_layers: int = 2
    low_overlap: float = 0.015
    recent: int = 16

    def __post_init__(self):
        pts = tuple((float(r), float(m)) for r, m in self.curve)
        if not pts or any(r <= 0 for r, _ in pts) or any(
                b[0] <= a[0] for a, b in zip(pts, pts[1:], strict=False)):
            raise ValueError(f"curve must be (H / K, miss) points with H / K > 0 increasing, "
                             f"got {self.curve}")
        if any(not 0.0 <= m <= 1.0 for _, m in pts) or any(
                b[1] > a[1] for a, b in zip(pts, pts[1:], strict=False)):
            raise ValueError(f"curve's miss rates must be in [0, 1] and not increase with H, "
                             f"got {self.curve}")
        for name in ("layer_overlap", "low_overlap"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("low_layers", "recent"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        object.__setattr__(self, "curve", pts)

    @classmethod
    def from_overlap(cls, step_overlap: float, **kw) -> StreamShape:
        """The default curve with its H = K point at ``1 - step_overlap`` (what exact LRU
        implies); the later points are kept, capped at that value."""
        if not 0.0 <= step_overlap <= 1.0:
            raise ValueError(f"step_overlap must be in [0, 1], got {step_overlap}")
        first = 1.0 - step_overlap
        curve = ((1.0, first),) + tuple((r, min(m, first)) for r, m in DEFAULT_CURVE[1:])
        return cls(curve=curve, **kw)

    @property
    def step_overlap(self) -> float | None:
        """The step-to-step overlap the curve implies (its H = K point), if it has one."""
        return next((1.0 - m for r, m in self.curve if r == 1.0), None)

    def bands(self, K: int, low: bool) -> list[tuple[int, float]]:
        """``(depth where the band starts, share of the entries)`` for a layer's draws beside
        the ``recent`` tokens (a low layer's overlap counts the recent tokens in)."""
        r0 = max(0, self.recent - 1)
        if low:
            near = max(0.0, self.low_overlap * K - r0) / (K - self.recent)
            return [(0, near), (K, 1.0 - near)]
        # the recent tokens but the newest were selected last step (hits at every H): the
        # draws make up the rest of each point's hits, so the curve holds over all K entries
        out, start, hit = [], 0, 0.0  # hit: share of the draws at depths before `start`
        for r, m in self.curve:
            h = min(1.0, max(hit, ((1.0 - m) * K - r0) / (K - self.recent)))
            out.append((start, h - hit))
            start, hit = int(round(r * K)), h
        out.append((start, 1.0 - hit))
        return [(s, max(0.0, w)) for s, w in out]


def _member(tokens: np.ndarray, of: np.ndarray, n: int) -> np.ndarray:
    """Which of ``tokens`` (all in ``[0, n)``) are in ``of`` (a mask lookup, not a sort)."""
    mask = np.zeros(n, bool)
    mask[of] = True
    return mask[tokens]


def _counts(n: int, shares: list[float], rng) -> np.ndarray:
    """``n`` split by ``shares`` (largest remainders, ties at random)."""
    w = np.asarray(shares, float)
    w = w / w.sum() if w.sum() > 0 else np.full(len(w), 1.0 / len(w))
    raw = n * w
    c = np.floor(raw).astype(np.int64)
    rest = n - int(c.sum())
    if rest:
        order = np.lexsort((rng.random(len(w)), -(raw - c)))
        c[order[:rest]] += 1
    return c


def _history(rng: np.random.Generator, context: int, recent: int) -> np.ndarray:
    """A warm recency stack of tokens ``[0, context - 1)``: the newest ``recent - 1`` first (every
    earlier step selected them), the rest in random order."""
    top = np.arange(context - 2, max(-1, context - 1 - recent), -1, dtype=np.int64)
    rest = rng.permutation(context - 1 - top.size).astype(np.int64)
    return np.concatenate([top, rest])


class TopKStream:
    """Top-k of ``n_full`` full layers for ``batch`` requests, one step at a time.

    Each request starts with a warm history: its first ``context - 1`` tokens in a random
    recency order but the newest on top (as if it had decoded for a while), one history for all
    but the low layers.
    :meth:`step` returns int32 ``[n_full, batch, K]``; row (j, b) holds K distinct tokens of
    ``[0, lens[b])``, the ``recent`` newest among them, in random order. ``initial`` holds
    every stack as it started (for :func:`measure`).

    ``rng``: a generator, whose ``spawn(batch)`` children draw the requests (each request's
    draws are its own: :func:`generate` makes them in parallel, the same), or one generator per
    request.
    """

    def __init__(self, shape: StreamShape, *, n_full: int, batch: int, top_k: int, context: int,
                 rng):
        if top_k <= shape.recent:
            raise ValueError(f"top_k ({top_k}) must exceed recent ({shape.recent})")
        if context <= top_k:
            raise ValueError(f"context ({context}) must exceed top_k ({top_k})")
        self.shape, self.n_full, self.batch, self.K = shape, n_full, batch, top_k
        self.context = context
        self.rngs = list(rng.spawn(batch)) if isinstance(rng, np.random.Generator) else list(rng)
        if len(self.rngs) != batch:
            raise ValueError(f"rng must be a Generator or {batch} of them, got {len(self.rngs)}")
        # low layers: histories of their own; the others start from one history, which each
        # then follows at layer_overlap (a steady state from the first step)
        perm = [[_history(g, context, shape.recent) for _ in range(1 + shape.low_layers)]
                for g in self.rngs]
        self.stacks = [[perm[b][1 + j].copy() if j < shape.low_layers else perm[b][0].copy()
                        for b in range(batch)] for j in range(n_full)]
        self.initial = [[s.copy() for s in layer] for layer in self.stacks]

    def step(self, lens) -> np.ndarray:
        lens = np.asarray(lens, np.int64)
        if lens.shape != (self.batch,):
            raise ValueError(f"lens must have shape ({self.batch},), got {lens.shape}")
        if (lens < self.context).any():
            raise ValueError(f"lens must be >= context ({self.context}): the history holds "
                             f"tokens up to context - 2, got {lens.tolist()}")
        K, sh = self.K, self.shape
        out = np.empty((self.n_full, self.batch, K), np.int32)
        for b in range(self.batch):
            n = int(lens[b])
            recent = np.arange(n - 1, max(-1, n - 1 - sh.recent), -1, dtype=np.int64)
            prev = None  # the previous full layer's draws of this step
            for j in range(self.n_full):
                low = j < sh.low_layers
                stack = self.stacks[j][b]
                free = stack[~_member(stack, recent, n)]
                want = K - recent.size
                liked, share = None, 0.0  # a following layer: the previous one's tokens
                if prev is not None and not low and j - 1 >= sh.low_layers:
                    liked = _member(free, prev, n)
                    share = max(0.0, sh.layer_overlap * K - recent.size) / want
                drawn = self._draw(free, want, sh.bands(K, low), recent.size, liked, share,
                                   self.rngs[b])
                sel = np.concatenate([recent, drawn])
                sel = self.rngs[b].permutation(sel)  # the order ties in recency are taken in
                out[j, b] = sel
                self.stacks[j][b] = np.concatenate([sel, stack[~_member(stack, sel, n)]])
                prev = drawn
        return out

    @staticmethod
    def _draw(free: np.ndarray, n: int, bands, shift: int, liked, share: float,
              rng: np.random.Generator):
        """``n`` distinct tokens of ``free`` (a stack without the recent tokens: a depth ``d``
        here is about ``d + shift`` in the whole stack) by the bands' shares. ``liked`` (a mask
        over ``free``, or None): the previous full layer's tokens, ``share`` of the ``n`` taken
        among them, the same share of every band where it can (so a layer follows the
        previous one in its misses as in its hits, without leaving its own depth curve)."""
        starts = [max(0, s - shift) for s, _ in bands] + [free.size]
        counts = _counts(n, [w for _, w in bands], rng)
        spans = [(min(starts[i], free.size), min(max(starts[i + 1], starts[i]), free.size))
                 for i in range(len(counts))]
        follow = [0] * len(counts)  # per band: draws among the liked tokens
        if liked is not None:  # share of every band where it holds enough of them; what a
            # band lacks, from the deepest bands that hold more
            have = [min(int(c), int(liked[lo:hi].sum())) for (lo, hi), c in zip(
                spans, counts, strict=True)]
            follow = [min(h, int(round(share * c))) for h, c in zip(have, counts, strict=True)]
            left = int(round(share * n)) - sum(follow)
            for i in reversed(range(len(counts))):
                add = max(0, min(left, have[i] - follow[i]))
                follow[i] += add
                left -= add
        picked, carry = [], 0
        for (lo, hi), c, k in zip(spans, counts, follow, strict=True):
            take = min(int(c) + carry, hi - lo)
            carry += int(c) - take
            if not take:
                continue
            pos = np.arange(lo, hi)
            if liked is None:
                picked.append(rng.choice(pos, size=take, replace=False))
                continue
            yes, no = pos[liked[lo:hi]], pos[~liked[lo:hi]]
            k = max(min(k, take), take - no.size)
            picked += [rng.choice(yes, size=k, replace=False),
                       rng.choice(no, size=take - k, replace=False)]
        idx = np.concatenate(picked) if picked else np.empty(0, np.int64)
        if carry:  # bands beyond the stack (a short request): the rest among the deepest
            # tokens left (misses at every H the stack can hold, as the curve wants them)
            rest = np.ones(free.size, bool)
            rest[idx] = False
            deep = np.nonzero(rest)[0][-2 * carry:]
            idx = np.concatenate([idx, rng.choice(deep, size=carry, replace=False)])
        return free[idx]


def _one_request(args) -> tuple[np.ndarray, list[np.ndarray]]:
    shape, n_full, top_k, context, lens, rng = args
    st = TopKStream(shape, n_full=n_full, batch=1, top_k=top_k, context=context, rng=[rng])
    initial = [layer[0].copy() for layer in st.initial]
    return np.stack([st.step(n[None])[:, 0] for n in lens]), initial


def generate(shape: StreamShape, *, n_full: int, top_k: int, context: int, lens,
             rng: np.random.Generator, workers: int | None = None):
    """Every step at once, the requests in parallel processes (they draw independently):
    ``lens`` int ``[steps, batch]`` -> (int32 ``[steps, n_full, batch, K]``, the initial stacks
    as :attr:`TopKStream.initial` holds them). Equal to a :class:`TopKStream` of the same
    ``rng`` stepped through ``lens``. ``workers``: processes (None: one per CPU; 1: none),
    started by a fork server (a CUDA context of the caller is never forked), which imports the
    caller's main module: call it under ``if __name__ == "__main__":`` in a script."""
    lens = np.asarray(lens, np.int64)
    if lens.ndim != 2:
        raise ValueError(f"lens must be [steps, batch], got shape {lens.shape}")
    jobs = [(shape, n_full, top_k, context, lens[:, b], g)
            for b, g in enumerate(rng.spawn(lens.shape[1]))]
    if workers == 1 or len(jobs) == 1:
        parts = [_one_request(j) for j in jobs]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # forkserver: the caller may hold a CUDA context, which a forked child must not inherit
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver")) \
                as ex:
            parts = list(ex.map(_one_request, jobs))
    out = np.stack([p[0] for p in parts], axis=2)
    return out, [[p[1][j] for p in parts] for j in range(n_full)]


def measure(steps: list[np.ndarray], initial, hots: tuple[int, ...]) -> dict:
    """The shape of generated top-k ``steps`` (each ``[n_full, B, K]``), from the stacks they
    started from (``TopKStream.initial``; empty stacks: a cold hot buffer): per full layer, the
    exact-LRU miss rate at each H of ``hots`` (``miss[H]``, ``[n_full]``), the step-to-step
    overlap (``step_overlap``) and the overlap with the previous full layer (``layer_overlap``,
    NaN for layer 0), and the share of the misses at each H that the previous full layer
    selected in the same step (``miss_followed[H]``) and that it missed too
    (``miss_predictable[H]``: what a prediction that stages the previous layer's misses, as the
    Prefetcher's does, can catch at best); both NaN for layer 0."""
    n_full, B, K = steps[0].shape
    n = 1 + max(int(s.max()) for s in steps)
    n = max(n, 1 + max(int(st.max(initial=-1)) for layer in initial for st in layer))
    miss = {H: np.zeros(n_full) for H in hots}
    followed = {H: np.zeros(n_full) for H in hots}
    predictable = {H: np.zeros(n_full) for H in hots}
    step_ov, layer_ov = np.zeros(n_full), np.zeros(n_full)
    missed = {}  # (b, t, H) -> the tokens the previous full layer missed
    for j in range(n_full):
        now = {}
        for b in range(B):
            stack = initial[j][b].copy()
            last = None
            for t, s in enumerate(steps):
                sel = s[j, b].astype(np.int64)
                rank = np.full(n, np.iinfo(np.int64).max)
                rank[stack] = np.arange(stack.size)
                depth = rank[sel]  # tokens never used: deeper than any H
                prev = _member(sel, steps[t][j - 1, b], n) if j else None
                for H in hots:
                    m = depth >= H
                    miss[H][j] += m.sum()
                    now[b, t, H] = sel[m]
                    if j:
                        followed[H][j] += (prev & m).sum()
                        predictable[H][j] += _member(sel[m], missed[b, t, H], n).sum()
                if last is not None:
                    step_ov[j] += _member(sel, last, n).sum()
                if j:
                    layer_ov[j] += prev.sum()
                stack = np.concatenate([sel, stack[~_member(stack, sel, n)]])
                last = sel
        missed = now
    T = len(steps)
    out = {"miss": {H: m / (T * B * K) for H, m in miss.items()},
           "step_overlap": step_ov / (max(1, T - 1) * B * K),
           "layer_overlap": layer_ov / (T * B * K)}
    out["layer_overlap"][0] = np.nan
    with np.errstate(invalid="ignore", divide="ignore"):
        out["miss_followed"] = {H: followed[H] / miss[H] for H in hots}
        out["miss_predictable"] = {H: predictable[H] / miss[H] for H in hots}
    for v in (*out["miss_followed"].values(), *out["miss_predictable"].values()):
        v[0] = np.nan
    return out


def draft_lens(context: int, steps: int, drafts: int, batch: int) -> np.ndarray:
    """The generator's ``lens`` (int64 ``[steps * drafts, batch]``) for multi-token prediction:
    decode step ``t`` (length ``context + t``) draws ``drafts`` consecutive selections of each
    full layer, all within its tokens (a draft token has no KV before its step writes it), one
    LRU stack advancing through them: a call's draft steps overlap as consecutive steps do."""
    t = np.repeat(np.arange(steps, dtype=np.int64), drafts)
    return np.broadcast_to((context + t)[:, None], (steps * drafts, batch)).copy()


def draft_union(table: np.ndarray, drafts: int) -> float:
    """Of ``table`` (int ``[steps * drafts, n_full, batch, K]``, :func:`draft_lens`' steps),
    the mean over calls, layers and requests of the distinct tokens of a call's ``drafts``
    selections per ``drafts * K`` entries: what a multi-step swap resolves once (1 / drafts
    when the drafts select alike, 1 when they share nothing)."""
    T, n_full, B, K = table.shape
    if drafts < 1 or T % drafts:
        raise ValueError(f"table has {T} steps, not a multiple of drafts={drafts}")
    calls = table.reshape(T // drafts, drafts, n_full, B, K).transpose(0, 2, 3, 1, 4)
    flat = calls.reshape(-1, drafts * K)
    srt = np.sort(flat, axis=1)
    distinct = 1 + (srt[:, 1:] != srt[:, :-1]).sum(axis=1)
    return float(distinct.mean() / (drafts * K))


def shape_for(step_overlap: float | None, layer_overlap: float | None,
              recent: int) -> StreamShape:
    """The demo's stream shape from its flags (None: the default)."""
    kw = dict(layer_overlap=0.8 if layer_overlap is None else layer_overlap, recent=recent)
    return StreamShape(**kw) if step_overlap is None else \
        StreamShape.from_overlap(step_overlap, **kw)


def shape_report(shape: StreamShape, drawn: list[np.ndarray], initial, hot: int,
                 requests: int | None = None, log=print) -> dict:
    """The shape of ``drawn`` (steps of ``[n_full, B, K]``) as :func:`measure` finds it at H =
    K, 2K, 4K and ``hot`` (the cache's, where the misses that follow the previous layer are
    reported), over the full layers past the low ones, logged in one line and returned;
    ``requests``: measure the first that many requests only (the line says so)."""
    n_full, B, K = drawn[0].shape
    hots = sorted({K, 2 * K, 4 * K, int(hot)})
    low = shape.low_layers
    if n_full <= low + 1:
        log(f"top-k streams: {n_full} full layers, none past the {low} low-overlap ones and "
            f"their first: no shape to report")
        return {}
    n = B if requests is None else min(B, requests)
    m = measure([d[:, :n] for d in drawn], [layer[:n] for layer in initial], tuple(hots))
    rest = slice(low, None)
    miss = {int(H): float(np.nanmean(v[rest])) for H, v in m["miss"].items()}
    rep = {"exact_lru_miss": miss, "step_overlap": float(np.mean(m["step_overlap"][rest])),
           "layer_overlap": float(np.nanmean(m["layer_overlap"][low + 1:])),
           "low_layers_step_overlap": [float(v) for v in m["step_overlap"][:low]],
           "miss_followed": {int(H): float(np.nanmean(v[low + 1:]))
                             for H, v in m["miss_followed"].items()},
           "miss_predictable": {int(H): float(np.nanmean(v[low + 1:]))
                                for H, v in m["miss_predictable"].items()},
           "requests_measured": n, "asked": dataclasses.asdict(shape)}
    log(f"top-k streams as generated (exact LRU from their starting history; full layers past "
        f"the {low} low-overlap ones{'' if n == B else f'; requests 0-{n - 1} of {B}'}): miss "
        + ", ".join(f"{100 * v:.1f} % at H {H}" for H, v in miss.items())
        + f"; step overlap {100 * rep['step_overlap']:.1f} %; layer overlap "
        f"{100 * rep['layer_overlap']:.1f} % (of the misses at H {hot}: "
        f"{100 * rep['miss_followed'][hot]:.1f} %, missed there too "
        f"{100 * rep['miss_predictable'][hot]:.1f} %); low layers' step overlap "
        + ", ".join(f"{100 * v:.1f} %" for v in rep["low_layers_step_overlap"]))
    return rep
