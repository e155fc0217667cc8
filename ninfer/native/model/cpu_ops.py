"""Fast CPU forms of the chunk ops (``paths.CPU``: a model on the CPU in fp32 / bf16 / fp16).

Each op has the contract of the reference beside which it is tested (fla's habit): the same
signature, the same result to the dtype's rounding — not bit for bit, which is why the float64
oracle keeps the references (``paths.BATCHED``; ``paths.for_device``).

* ``chunk_attention`` — ``attention.paged_attention`` through torch's fused CPU attention
  (``scaled_dot_product_attention``: blocked, online softmax, masked blocks skipped, GQA without
  repeating K/V). The reference builds the whole [H, Tq, L] score matrix: at a 2,048-token chunk
  that was 2/3 of the forward.
* ``delta_rule_step`` — ``gdn.recurrent_gated_delta_rule`` for one step of N decode rows as
  batched matrix products over (row, head) — k^T S, S + k delta^T, q^T S — instead of broadcast
  products summed over [N, Hv, Dk, Dv] temporaries, and key heads shared by view, not repeated.
* ``rms_norm`` — ``ops.rms_norm`` through torch's one fused op (the reference is ~10 ops).
* ``dense_moe`` — ``moe.sparse_moe`` for a few rows (decode, short chunks): every expert over
  every row as two matmuls over the experts' weights side by side, the unchosen experts' rows
  zeroed by the routing weights — no per-expert loop, sort or gather. It reads all E experts'
  weights for each row, so it pays only while rows x experts is small (``DENSE_MOE_MAX_PAIRS``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.fp8 import linear
from ninfer.native.model.moe import MoeWeights, with_shared
from ninfer.native.model.ops import acc_dtype, l2norm

# rows x experts up to which ``dense_moe`` beats the grouped loop (tiny model, fp32, one thread:
# 8 rows 0.19 -> 0.10 ms, 64 rows 0.35 -> 0.29 ms a layer; 256 rows 0.70 vs 0.94 ms)
DENSE_MOE_MAX_PAIRS = 512


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """``paged_attention``'s contract (``base`` = 0). q: [Tq, H, D] at positions
    start .. start+Tq-1; k_cache, v_cache: [P, 64, Hkv, D]; page_table: [n_pages].
    Returns [Tq, H, D] in q's dtype; the softmax accumulates in fp32 inside the fused op.

        keys 0 .. start+Tq-1, query i attends keys 0 .. start+i   (lower-right causal)
    """
    tq = q.shape[0]
    kv_len = start + tq
    pages = page_table[:(kv_len + PAGE_SIZE - 1) // PAGE_SIZE]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, pages).view(-1, hkv, d)[:kv_len]             # [L, Hkv, D]
    v = v_cache.index_select(0, pages).view(-1, hkv, d)[:kv_len]
    qh, kh, vh = q.transpose(0, 1)[None], k.to(q.dtype).transpose(0, 1)[None], v.to(q.dtype).transpose(0, 1)[None]
    mask = None
    if start:      # the cached prefix visible to every query, the chunk's own keys causally
        mask = torch.ones(tq, kv_len, dtype=torch.bool, device=q.device)
        mask[:, start:] = torch.ones(tq, tq, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=not start, scale=scale,
                                         enable_gqa=kh.shape[1] != qh.shape[1])
    return out[0].transpose(0, 1)


def dense_moe_fits(x: torch.Tensor, w: MoeWeights) -> bool:
    """``dense_moe`` pays here: few rows x experts, and few experts per chosen one (it does
    E / top_k times the grouped form's arithmetic)."""
    e = w.gate_up.shape[0]
    return x.shape[0] * e <= DENSE_MOE_MAX_PAIRS and e <= 8 * w.top_k


def _plain(t, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a tensor: as it is, or an FP8 one dequantised to ``dtype`` (the values the
    grouped form's ``fp8.linear`` multiplies by, so an FP8 model stays its dequantised twin)."""
    return t if isinstance(t, torch.Tensor) else t.dequantize(dtype)


def _down_side_by_side(w: MoeWeights, dtype: torch.dtype) -> torch.Tensor:
    """The experts' down projections side by side, [H, E*I] (built once per layer, kept on ``w``)."""
    down = w.down_cat
    if down is None or down.dtype != dtype:
        e, h, i = w.down.shape
        down = _plain(w.down, dtype).permute(1, 0, 2).reshape(h, e * i).contiguous()
        w.down_cat = down                     # derived from w.down, never saved or moved
    return down


def dense_moe(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """``sparse_moe``'s contract (x: [T, H] -> [T, H]): the same routing (softmax in the
    accumulation dtype, top-k, optional renormalisation), then

        gate_up = x @ [W_gu(0); ...; W_gu(E-1)]^T          [T, E, 2I]   (one matmul)
        h       = silu(gate) * up * route                  [T, E, I]    route[t, e] = 0 unless chosen
        out     = h @ [W_d(0) ... W_d(E-1)]^T               [T, H]       (one matmul over E*I)

    plus the gated shared expert. The sum over a row's experts happens inside the second
    matmul (another order than the grouped form's: equal to rounding)."""
    acc = acc_dtype(x.dtype)
    e, two_i, hidden = w.gate_up.shape
    inter = two_i // 2
    probs = torch.softmax(linear(x, w.router).to(acc), dim=-1)
    top_w, top_i = torch.topk(probs, w.top_k, dim=-1)
    if w.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    route = torch.zeros(x.shape[0], e, dtype=x.dtype, device=x.device).scatter_(1, top_i, top_w.to(x.dtype))
    gate_up = F.linear(x, _plain(w.gate_up, x.dtype).reshape(e * two_i, hidden)).view(-1, e, 2, inter)
    h = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1] * route[:, :, None]
    out = F.linear(h.reshape(-1, e * inter), _down_side_by_side(w, x.dtype))
    return with_shared(out, x, w)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_gated_delta_rule`` for T = 1: q, k: [N, Hk, Dk]; v: [N, Hv, Dv]; g, beta:
    [N, Hv]; state: [N, Hv, Dk, Dv]. Returns o: [N, Hv, Dv] (dtype of v) and the new state
    (accumulation dtype). Per (row, value head), with S: [Dk, Dv]::

        S <- exp(g) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q
    """
    acc = acc_dtype(v.dtype)
    n, hv, dv = v.shape
    hk, dk = k.shape[1], k.shape[2]
    rows = n * hv

    def per_value_head(x: torch.Tensor) -> torch.Tensor:        # [N, Hk, D] -> [N*Hv, 1, D]
        return x[:, :, None].expand(n, hk, hv // hk, x.shape[-1]).reshape(rows, 1, x.shape[-1])

    q = per_value_head(l2norm(q.to(acc)) * (dk ** -0.5))
    k = per_value_head(l2norm(k.to(acc)))
    s = state.to(acc).reshape(rows, dk, dv) * g.to(acc).exp().reshape(rows, 1, 1)
    delta = (v.to(acc).reshape(rows, 1, dv) - torch.bmm(k, s)) * beta.to(acc).reshape(rows, 1, 1)
    s = torch.baddbmm(s, k.transpose(1, 2), delta)
    o = torch.bmm(q, s)
    return o.view(n, hv, dv).to(v.dtype), s.view(n, hv, dk, dv)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """``ops.rms_norm``'s contract (x: [..., D]; weight: [D]) through ``F.rms_norm``: the same
    precision policy — zero-centered scales by (1 + w) in the accumulation dtype and casts,
    plain casts and then scales by w."""
    acc = acc_dtype(x.dtype)
    if zero_centered:
        return F.rms_norm(x.to(acc), (x.shape[-1],), 1.0 + weight.to(acc), eps).to(x.dtype)
    return weight * F.rms_norm(x.to(acc), (x.shape[-1],), None, eps).to(x.dtype)
