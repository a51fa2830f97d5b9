"""Multi-head latent attention (MLA) over the compressed rows a top-k selected, in the
conventions of transformers' GLM-5 (``GlmMoeDsaAttention``) and DeepSeek-V3.2
(``DeepseekV32Attention``), with their weights (torch only; no CuPy).

A token's cached row, per layer, is what engines cache for MLA: ``[c | k_rope]``, the
``kv_lora_rank`` values ``c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:r])`` and the
``qk_rope_head_dim`` values of the key's RoPE part, rotated at the token's position (the model's
interleaved RoPE). For head ``h``, with ``kv_b_proj.weight`` viewed as ``[H, nope + v, r]``
(``W_UK = [:, :nope]``, ``W_UV = [:, nope:]``) and ``S`` the selected tokens:

- score ``s_t = scaling * (q_nope . (W_UK c_t) + q_rope . k_rope_t)`` (``scaling`` the model's:
  YaRN's mscale squared included), ``p = softmax over t in S`` in float32;
- output ``o = W_UV (sum_t p_t c_t)`` (the absorbed form: ``q_nope`` is moved into the latent
  space once, ``W_UK^T q_nope``, and the weighted sum stays there), or, expanded,
  ``sum_t p_t (W_UV c_t)`` after ``W_UK c_t`` per selected row (``form="expanded"``).

The model's own attention computes the same scores over every cached token with the top-k as a
mask (``finfo.min`` outside it, which the softmax takes to exactly 0), so restricting the softmax
to the selected rows is exact; selected entries past a query's position (a prefill query with
fewer than ``index_topk`` tokens before it) are dropped, as the model's causal mask drops them.
"""

from __future__ import annotations

import torch

FORMS = ("absorbed", "expanded")


def row_values(attn) -> int:
    """Values in one cached row: ``kv_lora_rank + qk_rope_head_dim`` (576 for GLM-5 and
    DeepSeek-V3.2)."""
    return attn.kv_lora_rank + attn.qk_rope_head_dim


def project(attn, hidden, position_embeddings, rope):
    """The queries and the new tokens' rows of ``hidden`` ``[B, S, hidden]``:
    ``(q_resid, q_nope [B, H, S, nope], q_rope [B, H, S, rope], rows [B, S, r + rope])``;
    ``q_resid`` is what the model's indexer takes; ``rope`` the model's MLA RoPE function."""
    B, S, _ = hidden.shape
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    q = attn.q_b_proj(q_resid).view(B, S, attn.num_heads, attn.qk_head_dim).transpose(1, 2)
    q_nope, q_rope = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    c, k_rope = torch.split(attn.kv_a_proj_with_mqa(hidden),
                            [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    c = attn.kv_a_layernorm(c)
    cos, sin = position_embeddings
    q_rope, k_rope = rope(q_rope, k_rope.view(B, 1, S, attn.qk_rope_head_dim), cos, sin)
    return q_resid, q_nope, q_rope, torch.cat([c, k_rope[:, 0]], dim=-1)


def attend(attn, q_nope, q_rope, rows, valid, form: str = "absorbed"):
    """MLA of queries ``q_nope``/``q_rope`` (``[B, H, S, *]``) over their selected rows
    ``rows [B, S, K, r + rope]`` where ``valid [B, S, K]``: the ``o_proj`` output ``[B, S,
    hidden]``. No softmax row is empty: the indexer's causal mask ranks a query's own and earlier
    tokens first, so its top-k holds at least one of them."""
    H, r = attn.num_heads, attn.kv_lora_rank
    nope, v = attn.qk_nope_head_dim, attn.v_head_dim
    c, k_rope = rows[..., :r], rows[..., r:]
    w = attn.kv_b_proj.weight.view(H, nope + v, r)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    scores = torch.einsum("bhsd,bskd->bhsk", q_rope, k_rope)
    if form == "absorbed":
        scores = scores + torch.einsum("bhsr,bskr->bhsk",
                                       torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk), c)
    elif form == "expanded":
        scores = scores + torch.einsum("bhsn,bshkn->bhsk", q_nope,
                                       torch.einsum("bskr,hnr->bshkn", c, w_uk))
    else:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    scores = (scores * attn.scaling).masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
    if form == "absorbed":
        out = torch.einsum("bhsr,hvr->bshv", torch.einsum("bhsk,bskr->bhsr", p, c), w_uv)
    else:
        out = torch.einsum("bhsk,bshkv->bshv", p, torch.einsum("bskr,hvr->bshkv", c, w_uv))
    B, S = out.shape[:2]
    return attn.o_proj(out.reshape(B, S, H * v))
