"""transformers' GLM-5 (``GlmMoeDsaForCausalLM``) and DeepSeek-V3.2 (``DeepseekV32ForCausalLM``)
decoding through the cache: the model's own weights, its own DSA indexer and its own top-k,
attention over the selected compressed MLA rows only.

::

    from hisparse_cupy.integrations.transformers import SparseMLA

    sparse = SparseMLA(model, hot_size=4096, max_len=40_000)    # patches the model in place
    out = sparse.generate(input_ids, max_new_tokens=128)        # model.generate's arguments
    sparse.remove()                                             # the model's own attention back

What changes, per attention layer (``_mla.py`` has the math): the new tokens' rows ``[c |
k_rope]`` (``kv_lora_rank + qk_rope_head_dim`` values, 576 in both models, as engines cache
MLA) go to the cache instead of the model's dense K/V; the model's indexer (or, on GLM-5's
"shared" layers, ``config.indexer_types``, the previous full layer's top-k) picks each query's
tokens; attention reads those rows only. Prefill runs as the model's own attention would (its
selected rows, from the prompt's rows on the device, queries in chunks); its rows are then
admitted (host pool, hot buffer). Each decode step, per layer: the new token's row is written
where the step's swaps find it, the top-k is swapped into the request's hot buffer (misses
copied from pinned host memory), and attention gathers from the hot buffer; after the last layer
the new token's rows are backed up to the host pool. The indexer's keys (``index_head_dim``
values a token, full layers only) stay whole on the device: it scores every past token.

Backends: ``"cuda"`` (:class:`hisparse_cupy.HotBufferCache`, ``device_budget`` rows of residency
or every request sparse) and ``"oracle"`` (the NumPy oracle's tables and CPU tensors: the same
calls, no GPU). Batches of requests of one length (no padding); one token a decode step.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types

try:
    import torch
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as e:
    raise ImportError(f"hisparse_cupy.integrations.transformers needs torch and transformers "
                      f"(from a checkout: pip install -e '.[transformers]'; or pip install torch "
                      f"transformers): {e}") from e

from .._checks import integer
from . import _mla
from ._rows import CacheRows, OracleRows

__all__ = ["RowCache", "SparseMLA"]

_BACKENDS = ("cuda", "oracle")


class _RowLayer(DynamicLayer):
    """One layer's view for transformers: its length, the prompt's rows while it prefills, and
    the indexer's keys (grown in place, doubling)."""

    is_croppable = False  # (its rows live in the cache's request slots, not in this layer)

    def __init__(self):
        super().__init__()
        self.n = self._nkeys = 0
        self.prompt: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None

    def lazy_initialization(self, *args) -> None:
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.n

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length
        return self.n + int(q), 0

    def update_indexer(self, k: torch.Tensor) -> torch.Tensor:
        B, S, D = k.shape
        n = self._nkeys
        if self.keys is None or n + S > self.keys.shape[1]:
            grown = torch.empty((B, max(2 * (n + S), 64), D), dtype=k.dtype, device=k.device)
            if self.keys is not None:
                grown[:, :n] = self.keys[:, :n]
            self.keys = grown
        self.keys[:, n:n + S] = k
        self._nkeys = n + S
        return self.keys[:, :n + S]


class RowCache(Cache):
    """The ``Cache`` a :class:`SparseMLA` model generates with: its requests' slots in the
    backend, admitted after the prefill and released by :meth:`close` (``SparseMLA.generate``
    closes it)."""

    def __init__(self, sparse: SparseMLA):
        super().__init__(layers=[_RowLayer() for _ in range(sparse.n_layers)])
        self.sparse, self.rids = sparse, None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].n

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def update_indexer(self, k: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.layers[layer_idx].update_indexer(k)

    # What transformers does to a cache for beam search, assisted decoding and the like: the
    # rows live in the cache's request slots, which these would have to move; refused by name
    # (before: an AttributeError from inside transformers, one layer's keys already moved).
    def _unsupported(self, what: str):
        raise NotImplementedError(f"SparseMLA's cache does not support {what} (beam search, "
                                  f"contrastive or assisted decoding): decode greedily or "
                                  f"sample, one sequence per request")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("reorder_cache")

    def crop(self, max_length: int) -> None:
        self._unsupported("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch_select_indices")

    def close(self) -> None:
        """Give the requests' slots back (their host rows and hot buffers); idempotent."""
        if self.rids is not None:
            for rid in self.rids:
                self.sparse.rows.release(rid)
            self.rids = None


def _forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
             position_ids=None, prev_topk_indices=None, past_key_values=None, **kwargs):
    """The attention of a layer of a :class:`SparseMLA` model (its own weights and indexer)."""
    cache = cache if cache is not None else past_key_values
    if not isinstance(cache, RowCache):
        raise TypeError("a SparseMLA model generates with its own cache: use sparse.generate() "
                        "or pass sparse.new_cache() as the model's cache")
    sp, layer = cache.sparse, self.layer_idx
    entry = cache.layers[layer]
    B, S, _ = hidden_states.shape
    decode = cache.rids is not None
    if decode and S != 1:
        raise NotImplementedError(f"SparseMLA decodes one token a step; got {S} new tokens "
                                  f"after the prefill (speculative or chunked input)")
    q_resid, q_nope, q_rope, rows = _mla.project(self, hidden_states, position_embeddings,
                                                 sp.rope)
    if decode:
        if layer == 0:
            sp.rows.begin(cache.rids, entry.n + 1)
        sp.rows.write_newest(layer, rows[:, 0].to(sp.dtype))
    else:
        if entry.n:
            raise NotImplementedError("SparseMLA prefills an empty cache once (no chunked or "
                                      "second prefill)")
        if layer == 0 and _padded(attention_mask):
            raise ValueError("the prompt is padded (the model's attention mask hides some of "
                             "a query's earlier tokens: pad_token_id in input_ids, or an "
                             "attention_mask): SparseMLA takes requests of one length, no "
                             "padding")
        entry.prompt = rows.to(sp.dtype)
    entry.n += S
    if getattr(self, "indexer", None) is not None:
        top_k = self.indexer(hidden_states, q_resid, position_embeddings,
                             attention_mask[:, 0, :, :], position_ids, cache)
    else:
        top_k = prev_topk_indices
    if decode:
        shared = sp.prefetcher_shared[layer]
        got, valid = sp.rows.select(layer, None if shared else top_k[:, 0])
        out = _mla.attend(self, q_nope, q_rope, got[:, None].to(rows.dtype), valid[:, None],
                          sp.form)
        if layer == sp.n_layers - 1:
            sp.rows.end()
    else:
        out = _prefill(self, sp, q_nope, q_rope, entry.prompt, top_k)
        if layer == sp.n_layers - 1:
            rids: list[int] = []
            try:
                for b in range(B):
                    rids.append(sp.rows.admit(torch.stack([e.prompt[b] for e in cache.layers])))
            except BaseException:  # (no slot kept by a batch that did not get in whole)
                for rid in rids:
                    sp.rows.release(rid)
                raise
            cache.rids = rids
            for e in cache.layers:
                e.prompt = None
    return (out, None, top_k) if sp.returns_top_k else (out, None)


def _padded(mask) -> bool:
    """Whether the model's prefill mask shows padding: a 4-D ``[B, 1, S, T]`` one hiding a
    key at or before its query (a causal mask hides only later keys), a 2-D ``[B, T]`` one
    (flash attention's) with a zero; None: no mask, no padding. Another kind (flex
    attention's block mask) cannot be read here: refused by name."""
    if mask is None:
        return False
    if not isinstance(mask, torch.Tensor) or mask.ndim not in (2, 4):
        raise TypeError(f"SparseMLA reads the model's attention mask as a 2-D or 4-D tensor, "
                        f"got {type(mask).__name__}: load the model with "
                        f"attn_implementation='eager' or 'sdpa'")
    if mask.ndim == 2:
        return not bool(mask.bool().all())
    m = mask[:, 0]
    hidden = ~m if m.dtype == torch.bool else m < torch.finfo(m.dtype).min / 2
    S, T = m.shape[-2:]
    earlier = torch.ones(S, T, dtype=torch.bool, device=m.device).tril(T - S)
    return bool((hidden & earlier).any())


def _prefill(attn, sp, q_nope, q_rope, prompt, top_k):
    """The prompt's attention over each query's selected rows of the prompt, queries in chunks
    of ``sp.prefill_chunk`` (a chunk's rows: chunk x K x 576 values)."""
    B, S = prompt.shape[:2]
    # the causal bound is the cache index (the model's mask is), not position_ids: a prefill
    # starts from an empty cache, so query i sees keys 0..i whatever positions the caller gave
    pos = torch.arange(S, device=prompt.device)
    outs = []
    batch = torch.arange(B, device=prompt.device)[:, None, None]
    for a in range(0, S, sp.prefill_chunk):
        z = slice(a, a + sp.prefill_chunk)
        idx = top_k[:, z].long()
        valid = (idx >= 0) & (idx <= pos[z].view(1, -1, 1))
        got = prompt[batch, idx.clamp(min=0)].to(q_nope.dtype)
        outs.append(_mla.attend(attn, q_nope[:, :, z], q_rope[:, :, z], got, valid, sp.form))
    return torch.cat(outs, dim=1)


class SparseMLA:
    """``model`` (a transformers GLM-5 or DeepSeek-V3.2 causal LM) decoding through the cache.

    Parameters
    ----------
    model : ``GlmMoeDsaForCausalLM`` or ``DeepseekV32ForCausalLM``
        Patched in place (each attention module's forward, on the instance): :meth:`remove`
        undoes it.
    hot_size : int
        Hot rows a request per layer (H); ``top_k <= H``.
    max_len : int
        Longest sequence (prompt and generated tokens).
    max_requests : int
        Requests at once (a batch's rows; default 1).
    top_k : int, optional
        K of the swaps (default ``config.index_topk``; the indexer's picks at most K).
    device_budget : int, optional
        ``"cuda"``: device rows a layer for residency (requests resident while it holds them,
        sparse beyond); None: every request sparse, its hot buffer H + extra_page rows.
    backend : ``"cuda"`` or ``"oracle"`` (NumPy tables, CPU tensors).
    form : ``"absorbed"`` (default) or ``"expanded"``: MLA's two forms (``_mla.py``).
    overlap : bool
        GLM-5: shared layers through a :class:`hisparse_cupy.Prefetcher` by
        ``config.indexer_types`` (their copies on a side stream), ``"cuda"`` only.
    prefill_chunk : int
        Prefill queries a chunk (memory: chunk x top_k x row values).
    """

    def __init__(self, model, *, hot_size: int, max_len: int, max_requests: int = 1,
                 top_k: int | None = None, extra_page: int = 64,
                 device_budget: int | None = None, backend: str = "cuda",
                 form: str = "absorbed", overlap: bool = False, prefill_chunk: int = 256):
        layers = getattr(getattr(model, "model", None), "layers", None)
        attn = [getattr(x, "self_attn", None) for x in layers or ()]
        if not attn or not all(hasattr(a, "kv_lora_rank") and hasattr(a, "q_a_proj")
                                for a in attn):
            raise TypeError(f"model must be a transformers GLM-5 or DeepSeek-V3.2 causal LM "
                            f"(MLA attention with q_lora_rank set), got {type(model).__name__}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if form not in _mla.FORMS:
            raise ValueError(f"form must be one of {_mla.FORMS}, got {form!r}")
        cfg = model.config
        self.model, self.attn, self.form = model, attn, form
        self.n_layers = len(attn)
        self.top_k = integer("top_k", cfg.index_topk if top_k is None else top_k, 1)
        self.prefill_chunk = integer("prefill_chunk", prefill_chunk, 1)
        self.dtype = next(model.parameters()).dtype
        self.rope = importlib.import_module(type(attn[0]).__module__) \
            .apply_rotary_pos_emb_interleave
        self.returns_top_k = "prev_topk_indices" in \
            inspect.signature(type(attn[0]).forward).parameters
        types_ = getattr(cfg, "indexer_types", None) or ["full"] * self.n_layers
        pattern = None
        if overlap:
            if backend != "cuda":
                raise ValueError("overlap=True needs the cuda backend (a Prefetcher)")
            if "shared" not in types_:
                raise ValueError("overlap=True needs shared layers (config.indexer_types)")
            from ..streams import layer_pattern

            pattern = layer_pattern([t == "full" for t in types_], self.n_layers)
        self.overlap = overlap
        self.prefetcher_shared = [overlap and t == "shared" for t in types_]
        self.max_requests = integer("max_requests", max_requests, 1)
        sizes = dict(n_layers=self.n_layers, row_values=_mla.row_values(attn[0]),
                     dtype=self.dtype, max_requests=self.max_requests,
                     max_len=integer("max_len", max_len, 2),
                     hot_size=integer("hot_size", hot_size, self.top_k),
                     top_k=self.top_k, extra_page=integer("extra_page", extra_page, 1))
        if backend == "oracle":
            if device_budget is not None:
                raise ValueError("device_budget needs the cuda backend")
            self.rows = OracleRows(**sizes)
        else:
            self.rows = CacheRows(**sizes, device_budget=device_budget, pattern=pattern)
        for a in attn:
            a.forward = types.MethodType(_forward, a)

    def new_cache(self) -> RowCache:
        """A cache for one ``model.generate`` call (close it after, or use :meth:`generate`)."""
        return RowCache(self)

    def generate(self, input_ids: torch.Tensor, **kwargs):
        """``model.generate(input_ids, **kwargs)`` through the cache (a new one, closed after).
        ``input_ids`` ``[B, n]``: B requests of one length, no padding."""
        if input_ids.ndim != 2 or not 1 <= input_ids.shape[0] <= self.max_requests:
            raise ValueError(f"input_ids must be [B, n] with B <= max_requests "
                             f"({self.max_requests}), got shape {list(input_ids.shape)}")
        cache = self.new_cache()  # (padding, however the mask arrives: refused at the prefill)
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters \
            else "past_key_values"  # (renamed after transformers 5.17)
        side = None
        if self.overlap and input_ids.is_cuda and \
                torch.cuda.current_stream() == torch.cuda.default_stream():
            side = torch.cuda.Stream()  # (a Prefetcher forks from and joins a stream of its own)
            side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                return self.model.generate(input_ids, **{name: cache}, **kwargs)
        finally:
            cache.close()
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)

    def counters(self) -> dict:
        """Per-layer swap counts since the start: ``selected``, ``misses``, ``hit_rate``."""
        return self.rows.counters()

    def remove(self) -> None:
        """The model's own attention back (its forward on each module)."""
        for a in self.attn:
            a.__dict__.pop("forward", None)
