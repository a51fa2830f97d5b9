"""transformers' GLM-5 and DeepSeek-V3.2 decoding through the cache
(:mod:`hisparse_cupy.integrations.transformers`), token for token the model's own greedy decode.

Tiny random-initialized configs (fp32, 4 layers; GLM-5 with full and shared indexer layers,
DeepSeek-V3.2 with YaRN so the softmax scale carries its mscale), prompts longer than the hot
buffer so that every decode step misses. The oracle backend (CPU, the NumPy oracle's tables)
runs wherever torch and transformers are installed; the CUDA backend (HotBufferCache) on a GPU,
sparse and under a device budget. The check can fail: a hot buffer that serves a wrong row
differs from the model's own decode."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs torch")
transformers = pytest.importorskip("transformers", reason="the integration needs transformers")

from hisparse_cupy.integrations import _mla  # noqa: E402
from hisparse_cupy.integrations.transformers import SparseMLA  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = importlib.util.spec_from_file_location(
    "transformers_decode", ROOT / "examples" / "transformers_decode.py")
example = importlib.util.module_from_spec(EXAMPLE)
EXAMPLE.loader.exec_module(example)  # its configs: the published row and indexer, "tiny" sizes
KINDS = example.KINDS
PROMPT, NEW, HOT = 96, 16, 32  # the prompt outgrows the hot buffer: misses every step


def model_of(kind: str, device="cpu"):
    """The example's tiny model of ``kind`` (4 layers; GLM-5's alternate full and shared)."""
    try:
        return example.build(kind, "tiny", 4, PROMPT + NEW + 1, device)
    except (KeyError, ValueError) as e:
        pytest.skip(f"transformers {transformers.__version__} has no {kind} ({e})")


def greedy(model, ids, sparse=None, **extra):
    kw = dict(max_new_tokens=NEW, do_sample=False, output_logits=True,
              return_dict_in_generate=True, **extra)
    with torch.no_grad():
        out = model.generate(ids, **kw) if sparse is None else sparse.generate(ids, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def prompt(model, batch=1, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, model.config.vocab_size, (batch, PROMPT), generator=g).to(device)


def decodes_as_the_model(model, ids, *, generate=None, **sparse_kw) -> dict:
    """``ids`` through the model's own greedy decode and through a ``SparseMLA`` of
    ``sparse_kw``: the same tokens, logits within 1e-4; the cache's counters."""
    generate = generate or {}
    want_tokens, want_logits = greedy(model, ids, **generate)
    sparse = SparseMLA(model, hot_size=HOT, max_len=PROMPT + NEW + 1, **sparse_kw)
    try:
        tokens, logits = greedy(model, ids, sparse, **generate)
        c = sparse.counters()
    finally:
        sparse.remove()
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-4
    return c


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", _mla.FORMS)
def test_the_oracle_backend_decodes_as_the_model_does(kind, form):
    model = model_of(kind)
    ids = prompt(model, batch=2)
    want_tokens, want_logits = greedy(model, ids)
    sparse = SparseMLA(model, hot_size=HOT, max_len=PROMPT + NEW + 1, max_requests=2,
                       backend="oracle", form=form)
    try:
        tokens, logits = greedy(model, ids, sparse)
    finally:
        sparse.remove()
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 1e-4
    c = sparse.counters()
    # every layer's every decode step selected K tokens a request, and some missed
    assert (c["selected"] == 2 * (NEW - 1) * model.config.index_topk).all(), c
    assert (c["misses"] > 0).all(), c
    assert not sparse.rows.free == [] and sorted(sparse.rows.free) == [0, 1]  # released
    # the model's own attention is back
    assert torch.equal(greedy(model, ids)[0], want_tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefill_given_other_positions_decodes_as_the_model_does(kind):
    """``position_ids`` offset from the cache indices: the model's causal mask goes by cache
    index, and so must the prefill's selected rows (bounded by the positions, a query saw
    later tokens the indexer picked among masked ties: other tokens, logits off by 0.7)."""
    model = model_of(kind)
    decodes_as_the_model(model, prompt(model), backend="oracle",
                         generate=dict(position_ids=torch.arange(PROMPT)[None] + 90))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("padded_row", [1, 0])
def test_a_padded_prompt_is_refused_however_its_mask_arrives(kind, padded_row):
    """Padding transformers finds itself (``pad_token_id`` in the input, no attention_mask
    given) reached the prefill: padded queries attended nothing (NaN logits), and with row 0
    padded every row took row 0's positions. Refused before anything is admitted."""
    model = model_of(kind)
    ids = prompt(model, batch=2)
    ids[padded_row, :10] = 1
    model.generation_config.pad_token_id = 1
    sparse = SparseMLA(model, hot_size=HOT, max_len=PROMPT + NEW + 1, max_requests=2,
                       backend="oracle")
    try:
        with pytest.raises(ValueError, match="the prompt is padded"):
            greedy(model, ids, sparse)
        assert sorted(sparse.rows.free) == [0, 1]
        tokens, _ = greedy(model, ids[1 - padded_row:2 - padded_row], sparse)  # unpadded: fine
        assert tokens.shape == (1, NEW)
    finally:
        sparse.remove()
        model.generation_config.pad_token_id = None


def test_the_padding_check_reads_every_mask_the_attentions_pass():
    """The eager and sdpa attentions pass a 4-D mask (bool or additive), flash attention a 2-D
    one, flex attention a block mask the check cannot read (refused by name)."""
    from hisparse_cupy.integrations.transformers import _padded

    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].expand(2, 1, 4, 4)
    assert not _padded(causal) and not _padded(None)
    pad = causal.clone()
    pad[1, 0, :, 0] = False  # row 1's first key hidden from every query: padding
    assert _padded(pad)
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert not _padded(additive)
    assert _padded(additive.masked_fill(~pad, torch.finfo(torch.float32).min))
    assert not _padded(torch.ones(2, 4, dtype=torch.long))
    assert _padded(torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))
    with pytest.raises(TypeError, match="attn_implementation"):
        _padded(object())


def test_beam_search_is_refused_by_name_and_frees_its_slots():
    """Beam search reorders the cache between steps, which would have to move rows between
    request slots: refused with a NotImplementedError that names it (before: an AttributeError
    from inside transformers), and the slots it took are free again."""
    model = model_of(KINDS[0])
    sparse = SparseMLA(model, hot_size=HOT, max_len=PROMPT + NEW + 1, max_requests=2,
                       backend="oracle")
    try:
        with pytest.raises(NotImplementedError, match="beam search"):
            sparse.generate(prompt(model), max_new_tokens=4, num_beams=2, do_sample=False)
        assert sorted(sparse.rows.free) == [0, 1]
    finally:
        sparse.remove()


def test_a_hot_buffer_that_serves_a_wrong_row_differs():
    """The comparison above can fail: a swap that hands back token t - 1's row for token t
    moves the logits far past the tolerance."""
    model = model_of("glm_moe_dsa")
    ids = prompt(model)
    want_tokens, want_logits = greedy(model, ids)
    sparse = SparseMLA(model, hot_size=HOT, max_len=PROMPT + NEW + 1, backend="oracle")
    real = sparse.rows.select

    def off_by_one(layer, top_k):
        return real(layer, torch.where(top_k > 0, top_k - 1, top_k))

    try:
        sparse.rows.select = off_by_one
        _, logits = greedy(model, ids, sparse)
    finally:
        sparse.remove()
    assert (logits - want_logits).abs().max().item() > 1e-2


def test_bad_arguments_are_refused_by_name():
    model = model_of("deepseek_v32")
    with pytest.raises(ValueError, match="backend must be one of"):
        SparseMLA(model, hot_size=HOT, max_len=200, backend="tpu")
    with pytest.raises(ValueError, match="form must be one of"):
        SparseMLA(model, hot_size=HOT, max_len=200, backend="oracle", form="dense")
    with pytest.raises(ValueError, match="hot_size"):
        SparseMLA(model, hot_size=8, max_len=200, backend="oracle")  # below top_k 16
    with pytest.raises(ValueError, match="overlap=True needs the cuda backend"):
        SparseMLA(model, hot_size=HOT, max_len=200, backend="oracle", overlap=True)
    with pytest.raises(ValueError, match="device_budget needs the cuda backend"):
        SparseMLA(model, hot_size=HOT, max_len=200, backend="oracle", device_budget=1000)
    with pytest.raises(TypeError, match="GLM-5 or DeepSeek-V3.2"):
        SparseMLA(torch.nn.Linear(2, 2), hot_size=HOT, max_len=200, backend="oracle")
    sparse = SparseMLA(model, hot_size=HOT, max_len=200, max_requests=2, backend="oracle")
    try:
        ids = prompt(model, batch=2)
        with pytest.raises(ValueError, match=r"B <= max_requests \(2\), got shape \[3, 96\]"):
            sparse.generate(prompt(model, batch=3))
        held = sparse.rows.admit(torch.zeros(4, 8, 48))  # one slot taken elsewhere
        with torch.no_grad(), pytest.raises(RuntimeError, match="every request slot is taken"):
            sparse.generate(ids, max_new_tokens=2)
        assert sparse.rows.free == [1 - held]  # the batch that did not get in kept no slot
        sparse.rows.release(held)
        with pytest.raises(ValueError, match="padding"):
            sparse.generate(ids, attention_mask=torch.tensor([[1] * PROMPT, [0] + [1] * 95]))
        with torch.no_grad(), pytest.raises(TypeError, match="its own cache"):
            model(ids[:1])  # (the model's own DynamicCache)
    finally:
        sparse.remove()


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "budget", "overlap"), [
    (kind, budget, False) for kind in KINDS for budget in (None, 4096)] + [
    ("glm_moe_dsa", None, True)])
def test_the_cuda_backend_decodes_as_the_model_does(kind, budget, overlap):
    """On the GPU: every request sparse (misses every step), resident under a device budget
    (``budget`` rows a layer hold both requests whole), or GLM-5's shared layers through a
    Prefetcher."""
    model = model_of(kind, "cuda")
    c = decodes_as_the_model(model, prompt(model, batch=2, device="cuda"), max_requests=2,
                             device_budget=budget, overlap=overlap)
    if budget is None:
        full = np.asarray(c["selected"]) > 0  # (a prefetcher's shared layers run no swap)
        assert (np.asarray(c["misses"])[full] > 0).all(), c


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_the_cuda_backend_decodes_a_prompt_shorter_than_the_top_k(kind):
    """A sequence shorter than the indexer's top-k (K 16 here; 2048 in the published models):
    the model's indexer returns that many picks, and the swap's output is as wide."""
    model = model_of(kind, "cuda")
    decodes_as_the_model(model, prompt(model, batch=2, device="cuda")[:, :6], max_requests=2)


def test_the_topk_stream_tool_measures_the_indexers_picks_beside_the_generator(tmp_path):
    """benchmarks/topk_stream.py on the tiny model: every decode step's picks of each full
    layer (GLM-5's 2 of 4 layers), hit rates at H = K, 2K, 4K between 0 and 1 and rising with
    H, for the model's indexer and the demo's generator."""
    import json

    spec = importlib.util.spec_from_file_location("topk_stream",
                                                  ROOT / "benchmarks" / "topk_stream.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "t.json"
    assert tool.main(["--size", "tiny", "--prompt", str(PROMPT), "--new", str(NEW),
                      "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    for stream in ("indexer", "generator"):
        hit = np.array([[1 - v for v in doc[stream]["miss"][str(H)]] for H in doc["hots"]])
        assert hit.shape == (3, 2) and ((hit >= 0) & (hit <= 1)).all()
        assert (np.diff(hit, axis=0) >= 0).all(), hit  # more rows, no fewer hits
