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
* ``chunk_delta_rule`` — ``gdn.chunk_gated_delta_rule`` (a prefill chunk's delta rule) with the
  key heads' products k k^T and q k^T made once per key head, not per value head; the two
  triangular solves as one over [v | k e^G]; blocks first in memory, so each step of the
  block loop reads contiguous slices; the loop doing only the state hand-over (two batched
  products), the outputs of all blocks after it in two batched products. Where the system's C
  compiler can build it, fp32 math runs the compiled recurrence instead (``cpu_kernel``,
  ``KernelGdnOps``, ``gdn_ops``): ~3x faster at 256-2,000 tokens, the chunked form the fallback.
* ``rms_norm`` — ``ops.rms_norm`` through torch's one fused op (the reference is ~10 ops).
* ``dense_moe`` — ``moe.sparse_moe`` for a few rows (decode, short chunks): every expert over
  every row as two matmuls over the experts' weights side by side, the unchosen experts' rows
  zeroed by the routing weights — no per-expert loop, sort or gather. It reads all E experts'
  weights for each row, so it pays only while rows x experts is small (``DENSE_MOE_MAX_PAIRS``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.native.model import attention, cpu_kernel, gdn
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.fp8 import linear
from ninfer.native.model.moe import MoeWeights, route, sparse_moe, with_shared
from ninfer.native.model.ops import acc_dtype, l2norm

# rows x experts up to which ``dense_moe`` beats the grouped loop (tiny model, fp32, one thread:
# 8 rows 0.19 -> 0.10 ms, 64 rows 0.35 -> 0.29 ms a layer; 256 rows 0.70 vs 0.94 ms)
DENSE_MOE_MAX_PAIRS = 512


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """``paged_attention``'s contract (``base`` = 0). q: [Tq, H, D] at positions
    start .. start+Tq-1; k_cache, v_cache: [P, 64, Hkv, D]; page_table: [n_pages].
    Returns [Tq, H, D] in q's dtype; the softmax accumulates in fp32. In fp32 the compiled pass
    (``cpu_kernel.chunk_attention``: no mask tensor, no block of keys past a query's own; 1.3x
    torch's fused op at 2,000 tokens from position 0, 1.9x at 300), else the fused torch op.

        keys 0 .. start+Tq-1, query i attends keys 0 .. start+i   (lower-right causal)
    """
    tq = q.shape[0]
    kv_len = start + tq
    pages = page_table[:(kv_len + PAGE_SIZE - 1) // PAGE_SIZE]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, pages).view(-1, hkv, d)[:kv_len]             # [L, Hkv, D]
    v = v_cache.index_select(0, pages).view(-1, hkv, d)[:kv_len]
    if attention_kernel_fits(q):          # fp32: the compiled pass (no mask tensor, no key past the diagonal)
        return cpu_kernel.chunk_attention(q, k, v, scale)
    qh, kh, vh = q.transpose(0, 1)[None], k.to(q.dtype).transpose(0, 1)[None], v.to(q.dtype).transpose(0, 1)[None]
    mask = None
    if start:      # the cached prefix visible to every query, the chunk's own keys causally
        mask = torch.ones(tq, kv_len, dtype=torch.bool, device=q.device)
        mask[:, start:] = torch.ones(tq, tq, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=not start, scale=scale,
                                         enable_gqa=kh.shape[1] != qh.shape[1])
    return out[0].transpose(0, 1)


def attention_kernel_fits(q: torch.Tensor) -> bool:
    """Whether a chunk's attention takes ``cpu_kernel.chunk_attention``: fp32 queries on the CPU
    with heads it takes, the kernel built; else the fused torch op (float64 — the oracle's dtype —
    and bf16 / fp16 among them)."""
    return (q.dtype == torch.float32 and q.device.type == "cpu" and q.stride(-1) == 1
            and cpu_kernel.attention_fits(q.shape[-1]) and cpu_kernel.available())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float, kv_slots: torch.Tensor | None = None,
                     bases: torch.Tensor | None = None) -> torch.Tensor:
    """``attention.decode_attention``'s contract. In fp32 through the fused CPU attention
    (``scaled_dot_product_attention``: one call where the reference makes ~25, GQA without
    repeats): the keys and values gathered by ``kv_slots`` as there, the keys past a row's length
    (and before its base) masked; equal to rounding. In bf16 / fp16 the reference's products run
    in fp32 on fp32 copies of q and the gathered keys and values, the output cast back: on the CPU
    those dtypes' batched products build a kernel per new shape, and a decode row's key count
    grows every step (bf16, 8 rows: 2.0 ms of attention a step against fp32's 0.44). float64 (a
    test's) keeps the reference."""
    if q.dtype != torch.float32:
        half = q.dtype in (torch.bfloat16, torch.float16)
        return attention.decode_attention(q, k_cache, v_cache, block_table, kv_lens, scale, kv_slots, bases,
                                          compute=torch.float32 if half else None)
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    if kv_slots is None:
        kv_slots = attention.decode_kv_slots(block_table, kv_lens, block_table.shape[1] * PAGE_SIZE)
    flat = kv_slots.reshape(-1)
    k = k_cache.view(-1, hkv * d).index_select(0, flat).view(b, -1, hkv, d)            # [B, L, Hkv, D]
    v = v_cache.view(-1, hkv * d).index_select(0, flat).view(b, -1, hkv, d)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    pos = torch.arange(k.shape[1], device=q.device)[None, :]
    visible = pos < kv_lens[:, None]                                                     # [B, L]
    if bases is not None:
        visible = visible & (pos >= bases[:, None])
    out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=h != hkv)
    return out[:, :, 0]


def conv_step_slots(x: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                    weight: torch.Tensor) -> torch.Tensor:
    """``gdn.causal_conv1d_step`` of N decode rows over their slots of ``conv_states`` [S, C, K-1]:
    the rows' states gathered, the new ones written back from a view of the window. x: [N, C];
    weight: [C, K]. Returns y [N, C]. In fp32 with the compiled kernel, one pass stepping each
    row's state in place — the bits the compiled conv pass gives the same token in a chunk."""
    if x.dtype == torch.float32 and x.stride(-1) == 1 and conv_states.dtype == torch.float32 \
            and conv_states.is_contiguous() and cpu_kernel.fits(x.shape[-1]) and 2 <= weight.shape[1] <= 16 \
            and cpu_kernel.available():
        return cpu_kernel.conv_step_slots(x, conv_states, slots, weight)
    state = conv_states.index_select(0, slots)
    xs = torch.cat([state if state.dtype == x.dtype else state.to(x.dtype), x[:, :, None]], dim=2)   # [N, C, K]
    y = F.silu((xs * weight).sum(-1))
    new = xs[:, :, 1:]
    conv_states.index_copy_(0, slots, new if new.dtype == conv_states.dtype else new.to(conv_states.dtype))
    return y


def dense_moe_fits(x: torch.Tensor, w: MoeWeights) -> bool:
    """``dense_moe`` pays here: few rows x experts, and few experts per chosen one (it does
    E / top_k times the grouped form's arithmetic)."""
    e = w.gate_up.shape[0]
    return x.shape[0] * e <= DENSE_MOE_MAX_PAIRS and e <= 8 * w.top_k


def takes_dense_moe(x: torch.Tensor, w: MoeWeights) -> bool:
    """The CPU path's choice for these rows: the dense form where it fits, unless the routed
    kernel takes the MoE (``routed_kernel_fits``), which is faster at every row count (tiny model,
    fp32, two threads, a layer: 1 row 103 -> 59 us, 8 rows 136 -> 99 us, 64 rows 312 -> 143 us)."""
    return dense_moe_fits(x, w) and not routed_kernel_fits(x, w)


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
    e, two_i, hidden = w.gate_up.shape
    inter = two_i // 2
    top_w, top_i = route(x, w)
    weights = torch.zeros(x.shape[0], e, dtype=x.dtype, device=x.device).scatter_(1, top_i, top_w.to(x.dtype))
    gate_up = linear(x, _plain(w.gate_up, x.dtype).reshape(e * two_i, hidden)).view(-1, e, 2, inter)
    h = F.silu(gate_up[:, :, 0]) * gate_up[:, :, 1] * weights[:, :, None]
    out = linear(h.reshape(-1, e * inter), _down_side_by_side(w, x.dtype))
    return with_shared(out, x, w)


def _shared_side_by_side(w: MoeWeights, dtype: torch.dtype) -> torch.Tensor:
    """The shared expert's gate and up projections and its gate row stacked, [2Is + 1, H]
    (built once per layer, kept on ``w``): one matmul where ``with_shared`` runs three."""
    cat = w.shared_cat
    if cat is None or cat.dtype != dtype:
        cat = torch.cat([_plain(w.shared_gate_proj, dtype), _plain(w.shared_up_proj, dtype),
                         _plain(w.shared_gate, dtype)]).contiguous()
        w.shared_cat = cat                    # derived from the shared weights, never saved or moved
    return cat


def grouped_moe(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """``sparse_moe``'s contract for many rows (a chunk), with fewer passes over [T k, H]
    temporaries: the same routing and grouping (one stable sort of the (token, slot) pairs by
    expert). In fp32 the routed experts take the compiled pass where it is built
    (``cpu_kernel.moe_routed``, ``routed_kernel_fits``; also without a shared expert, over a zero
    base), else every expert's rows at once in two batched products (``_experts_padded``);
    otherwise a loop in which each expert's routing weights scale its [n, I] activations before
    the down projection (not its [n, H] output after) and each expert writes its rows of one
    buffer (no concatenation); the shared expert's three projections are one matmul, and the
    routed rows are added into the shared expert's output (no zero tensor). Equal to rounding
    (the loop's weight multiplies before the down product's sum instead of after it)."""
    kernel = routed_kernel_fits(x, w)
    if (w.shared_gate_proj is None and not kernel) or x.shape[0] == 0:
        return sparse_moe(x, w)
    top_w, top_i = route(x, w)
    if kernel:           # fp32: the routed experts in one compiled pass, added into the shared expert's output
        base = _shared_expert(x, w) if w.shared_gate_proj is not None else torch.zeros_like(x)
        return cpu_kernel.moe_routed(x, top_i, top_w, *_routed_transposed(w), base)
    e, two_i, hidden = w.gate_up.shape
    inter, k = two_i // 2, w.top_k
    flat = top_i.view(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    weights = top_w.view(-1).index_select(0, order).to(x.dtype)[:, None]
    if x.dtype == torch.float32 and isinstance(w.gate_up, torch.Tensor) and isinstance(w.down, torch.Tensor):
        y = _experts_padded(x, w, flat, order, tok, weights)
    else:
        counts = torch.bincount(flat, minlength=e).tolist()
        xs = x.index_select(0, tok)
        y = torch.empty(tok.shape[0], hidden, dtype=x.dtype, device=x.device)
        lo = 0
        for j, n in enumerate(counts):
            if n:
                gate_up = linear(xs[lo:lo + n], w.gate_up[j])
                h = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:]).mul_(weights[lo:lo + n])
                y[lo:lo + n] = linear(h, w.down[j])
                lo += n
    return _shared_expert(x, w).index_add_(0, tok, y)


def _shared_expert(x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """The gated shared expert's output [T, H]: its three projections in one matmul."""
    i_s = w.shared_down_proj.shape[1]
    gs = linear(x, _shared_side_by_side(w, x.dtype))                     # [T, 2Is + 1]
    h = F.silu(gs[:, :i_s]).mul_(gs[:, i_s:2 * i_s]).mul_(torch.sigmoid(gs[:, 2 * i_s:]))
    return linear(h, w.shared_down_proj)


def routed_kernel_fits(x: torch.Tensor, w: MoeWeights) -> bool:
    """Whether ``grouped_moe``'s routed experts take ``cpu_kernel.moe_routed``: fp32 rows, plain
    fp32 weights, widths it takes, the kernel built; else the torch forms (float64 — the oracle's
    dtype — bf16 and FP8 among them)."""
    plain = isinstance(w.gate_up, torch.Tensor) and isinstance(w.down, torch.Tensor)
    return (plain and x.dtype == w.gate_up.dtype == w.down.dtype == torch.float32 and x.device.type == "cpu"
            and x.stride(-1) == 1 and cpu_kernel.moe_fits(w.gate_up.shape[2], w.gate_up.shape[1] // 2)
            and w.top_k <= 64 and cpu_kernel.available())


def _routed_transposed(w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' gate_up [E, H, 2I] and down [E, I, H] transposed, contiguous: the kernel's
    layout (built once per layer, kept on ``w``; built again when either weight is another tensor
    or was changed in place — its version counter moved). A second copy of the routed experts'
    weights, on a CPU fp32 model only (the tiny model's: 0.8 MB a layer)."""
    key = (w.gate_up.data_ptr(), w.gate_up._version, w.down.data_ptr(), w.down._version)
    t = w.routed_t
    if t is None or t[0] != key:
        t = (key, w.gate_up.transpose(1, 2).contiguous(), w.down.transpose(1, 2).contiguous())
        w.routed_t = t                        # derived from the expert weights, never saved or moved
    return t[1], t[2]


def _experts_padded(x: torch.Tensor, w: MoeWeights, flat: torch.Tensor, order: torch.Tensor, tok: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """``grouped_moe``'s routed experts in fp32 as two batched products: each expert's rows
    (in the sorted order) placed in its own band of an [E, n_max, H] buffer, zero-padded to the
    busiest expert's count, then ``bmm`` by every expert's gate-up and down projections at once
    — two calls where the loop makes ~6 per expert (the tiny model's MoE 1.3-1.67x at 65-1,000
    rows; the padded rows' arithmetic is wasted, so at ~2,000 rows the two are even). Padding rows stay zero and are never read back: a row's product reads only its
    own row. The routing weights scale the gathered outputs (``sparse_moe``'s order). Returns
    the routed rows' outputs in the sorted order (``tok``'s, for ``index_add_``)."""
    e, two_i, hidden = w.gate_up.shape
    inter = two_i // 2
    counts = torch.bincount(flat, minlength=e)
    n_max = int(counts.max())
    expert = flat.index_select(0, order)                                   # ascending
    first = torch.cumsum(counts, 0).sub_(counts)                            # each expert's first sorted row
    slot = expert * n_max + torch.arange(order.shape[0], device=x.device) - first.index_select(0, expert)
    xs = x.new_zeros(e * n_max, hidden).index_copy_(0, slot, x.index_select(0, tok))
    gate_up = torch.bmm(xs.view(e, n_max, hidden), w.gate_up.transpose(1, 2))          # [E, n_max, 2I]
    h = F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])
    y = torch.bmm(h, w.down.transpose(1, 2)).view(e * n_max, hidden).index_select(0, slot)
    return y.mul_(weights)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_gated_delta_rule`` for T = 1: q, k: [N, Hk, Dk]; v: [N, Hv, Dv]; g, beta:
    [N, Hv]; state: [N, Hv, Dk, Dv] (not changed). Returns o: [N, Hv, Dv] (dtype of v) and the new
    state (accumulation dtype). Per (row, value head), with S: [Dk, Dv]::

        S <- exp(g) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q
    """
    s = state.to(acc_dtype(v.dtype), copy=True)
    return _delta_step_(torch.cat([q, k], dim=1), v, g, beta, s), s


def delta_rule_step_slots(qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          states: torch.Tensor, slots: torch.Tensor, run: slice | None = None) -> torch.Tensor:
    """``delta_rule_step`` of N decode rows over their slots of ``states`` [S, Hv, Dk, Dv]: each
    row's state stepped where it lives — given ``run``, the slots as one ascending run
    (``forward.slot_run``, read off the host's ints when the batch is built: never off ``slots``,
    which a captured graph replays with other values), and states in the accumulation dtype, the
    run's view of ``states`` itself (8 rows of the tiny model: 207 -> 90 us a layer, no 512 KB
    gather and write-back); else gathered, stepped and written back. qk: [N, 2 Hk, Dk] (the q
    heads, then the k heads: one view of the conv's output). Returns o [N, Hv, Dv] in v's dtype."""
    acc = acc_dtype(v.dtype)
    if run is not None and states.dtype == acc:
        return _delta_step_(qk, v, g, beta, states[run])
    s = states.index_select(0, slots)
    s = s if s.dtype == acc else s.to(acc)
    o = _delta_step_(qk, v, g, beta, s)
    states.index_copy_(0, slots, s if s.dtype == states.dtype else s.to(states.dtype))
    return o


def _delta_step_(qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 s: torch.Tensor) -> torch.Tensor:
    """The step on ``s`` [N, Hv, Dk, Dv] (accumulation dtype, the caller's own: updated in place) as
    batched products over (row, value head); q and k normalised together, each key head's q and k
    shared by the value heads that read it (a view, then one copy for both)."""
    acc = s.dtype
    n, hv, dv = v.shape
    hk2, dk = qk.shape[1], qk.shape[2]
    hk, rows = hk2 // 2, n * hv
    qk = l2norm(qk if qk.dtype == acc else qk.to(acc))
    qk[:, :hk] *= dk ** -0.5
    both = qk.view(n, 2, hk, 1, dk).transpose(0, 1).expand(2, n, hk, hv // hk, dk).reshape(2, rows, 1, dk)
    q, k = both[0], both[1]
    st = s.view(rows, dk, dv)
    st.mul_((g if g.dtype == acc else g.to(acc)).exp().view(rows, 1, 1))
    vr = (v if v.dtype == acc else v.to(acc)).reshape(rows, 1, dv)
    delta = (vr - torch.bmm(k, st)).mul_((beta if beta.dtype == acc else beta.to(acc)).reshape(rows, 1, 1))
    st.baddbmm_(k.transpose(1, 2), delta)
    o = torch.bmm(q, st).view(n, hv, dv)
    return o if o.dtype == v.dtype else o.to(v.dtype)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gdn.chunk_gated_delta_rule``'s contract: q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta:
    [T, Hv]; state: [Hv, Dk, Dv] -> o [T, Hv, Dv] (dtype of v), final state (accumulation
    dtype). The same algebra (see there; blocks of ``block_tokens``), arranged for the CPU: with
    n blocks of C tokens and value head h reading key head h // (Hv / Hk),

        KK, QK   = k k^T, q k^T per key head                              [n, Hk, C, C]
        [U | W]  = (I + strict_lower(beta KK ∘ D))^-1 beta [v | k e^G]      one solve
        S_i      = state entering block i (the loop: S_{i+1} = e^{G_C} S_i + k_dec^T (U_i - W_i S_i))
        o        = (q e^G) S + (QK ∘ D) (U - W S)                           all blocks at once
    """
    o, s, _ = chunk_delta_rule_cuts(q, k, v, g, beta, state, (), chunk)
    return o, s


def block_tokens(t: int) -> int:
    """The block a chunk of ``t`` tokens runs in: 16 tokens for a chunk that short (one small
    block instead of one mostly padding: the rule of a 16-token chunk 0.46 -> 0.25 ms a layer),
    else 32 — not ``gdn.CHUNK`` (64): on the CPU half the block halves the triangular solves'
    and the intra-block products' arithmetic and their [n, H, C, C] temporaries, for twice the
    hand-over steps; the tiny model's rule ran 1.1-1.25x faster at 300-2,000 tokens (bench/README,
    "Fifteenth session"). Any block size is the same algebra, equal to rounding."""
    return 16 if t <= 16 else 32


def chunk_delta_rule_cuts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, cuts: tuple[int, ...] | list[int], chunk: int | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``chunk_delta_rule``, plus the state after each of ``cuts`` tokens (0 < r < T, ascending):
    what the rule run over the first r tokens alone would return, from the same pass. At r = i C + o
    (block i, o of its tokens in)::

        S_r = e^{G_o} S_i + (k ∘ e^{G_o - G})[:o]^T (U - W S_i)[:o]      (G_o: the decay through token o)

    the block hand-over truncated to the block's first o tokens (a token's U - W S row reads only
    the tokens before it in its block). Equal to the segment-by-segment states to rounding."""
    out_dtype, acc = v.dtype, acc_dtype(v.dtype)
    t, hk, dk = k.shape
    chunk = chunk or block_tokens(t)
    hv, dv = v.shape[1], v.shape[2]
    rep = hv // hk
    pad = (-t) % chunk
    n = (t + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:          # [T, H, D] -> [n, H, C, D], contiguous
        x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x  # padding: k = 0, beta = 0, g = 0
        return x.view(n, chunk, x.shape[1], x.shape[2]).transpose(1, 2).contiguous()

    q = blocks(l2norm(q.to(acc)) * (dk ** -0.5))                          # [n, Hk, C, Dk]
    k = blocks(l2norm(k.to(acc)))
    v = blocks(v.to(acc))                                                 # [n, Hv, C, Dv]
    gb = torch.stack([g.to(acc), beta.to(acc)])                           # [2, T, Hv]
    gb = (F.pad(gb, (0, 0, 0, pad)) if pad else gb).view(2, n, chunk, hv).transpose(2, 3)
    G, b = gb[0].cumsum(-1), gb[1].reshape(n, hk, rep, chunk, 1)          # [n, Hv, C]
    kt = k.transpose(-1, -2)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill_(~lower, float("-inf")).exp_()
    decay = decay.view(n, hk, rep, chunk, chunk)                          # D, zero above the diagonal
    system = ((k @ kt)[:, :, None] * decay).mul_(b)                       # unit diagonal ignored
    e_g = G.exp().view(n, hk, rep, chunk, 1)
    rhs = torch.cat([v.view(n, hk, rep, chunk, dv), k[:, :, None] * e_g], -1).mul_(b)
    # the transposed system (X^T A^T = B^T, A^T upper): LAPACK's column-major form of the same
    # solve, which torch runs without transposed copies of both sides (the rule at T = 2,000 ~10 % faster)
    uw = torch.linalg.solve_triangular(system.mT, rhs.mT, upper=True, left=False,
                                       unitriangular=True).mT.reshape(n, hv, chunk, dv + dk)
    v_new, w = uw[..., :dv].contiguous(), uw[..., dv:]     # U (then U - W S in place); W read as a transposed view
    intra = ((q @ kt)[:, :, None] * decay).view(n, hv, chunk, chunk)
    q_dec = (q[:, :, None] * e_g).view(n, hv, chunk, dk)
    k_dec_t = (k[:, :, None] * (G[..., -1:] - G).exp_().view(n, hk, rep, chunk, 1)).view(n, hv, chunk, dk)
    k_dec_t = k_dec_t.transpose(-1, -2).contiguous()
    block_decay = G[..., -1].exp()[..., None, None]                      # [n, Hv, 1, 1]
    entering = torch.empty(n + 1, hv, dk, dv, dtype=acc, device=v.device)
    entering[0] = state
    for i in range(n):
        s = entering[i]
        v_new[i].baddbmm_(w[i], s, alpha=-1)
        torch.mul(s, block_decay[i], out=entering[i + 1]).baddbmm_(k_dec_t[i], v_new[i])
    out = (q_dec @ entering[:n]).add_(intra @ v_new)                      # [n, Hv, C, Dv]
    at = []
    for r in cuts:
        i, o = divmod(r, chunk)
        if not o:
            at.append(entering[i].clone())
            continue
        gi = G[i, :, :o]                                                  # [Hv, o]
        kd = (k[i, :, None, :o] * (gi[:, -1:] - gi).exp().view(hk, rep, o, 1)).view(hv, o, dk)
        at.append(torch.baddbmm(entering[i] * gi[:, -1].exp()[:, None, None], kd.transpose(1, 2), v_new[i, :, :o]))
    s = entering[n]
    return out.transpose(1, 2).reshape(n * chunk, hv, dv)[:t].to(out_dtype), s, at


class GdnOps:
    """``gdn``'s ops as a path calls them (``BatchedPath._gdn_ops``), the chunk rule replaced."""

    causal_conv1d = staticmethod(gdn.causal_conv1d)
    causal_conv1d_step = staticmethod(gdn.causal_conv1d_step)
    recurrent_gated_delta_rule = staticmethod(gdn.recurrent_gated_delta_rule)
    chunk_gated_delta_rule = staticmethod(chunk_delta_rule)
    chunk_delta_rule_cuts = staticmethod(chunk_delta_rule_cuts)


def kernel_delta_rule_cuts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, cuts: tuple[int, ...] | list[int] = (), chunk: int | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``chunk_delta_rule_cuts`` by the compiled recurrence where the math is fp32 (a float64
    call, a test's, keeps the chunked form)."""
    if acc_dtype(v.dtype) == torch.float32 and cpu_kernel.fits(v.shape[-1]):
        return cpu_kernel.delta_rule_cuts(q, k, v, g, beta, state, cuts)
    return chunk_delta_rule_cuts(q, k, v, g, beta, state, cuts, chunk)


def kernel_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    o, s, _ = kernel_delta_rule_cuts(q, k, v, g, beta, state, (), chunk)
    return o, s


def kernel_step_slots(qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      states: torch.Tensor, slots: torch.Tensor, run: slice | None = None) -> torch.Tensor:
    """``delta_rule_step_slots`` by the compiled recurrence where the states are fp32 (each row's
    state stepped in its slot, as a one-token chunk would), else as before."""
    if states.dtype == torch.float32 and states.is_contiguous() and cpu_kernel.fits(v.shape[-1]):
        hk = qk.shape[1] // 2
        return cpu_kernel.delta_rule_step_slots(qk[:, :hk], qk[:, hk:], v, g, beta, states, slots)
    return delta_rule_step_slots(qk, v, g, beta, states, slots, run)


def kernel_causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``gdn.causal_conv1d`` by the compiled pass where x is fp32 rows of whole 16-float vectors
    (conv and SiLU in one pass: 2,000 rows of 512 channels 1.2 -> 0.44 ms), else as before."""
    if x.dtype == torch.float32 and x.stride(-1) == 1 and cpu_kernel.fits(x.shape[-1]) and weight.shape[1] <= 16:
        return cpu_kernel.conv_silu(x, state, weight)
    return gdn.causal_conv1d(x, state, weight)


class KernelGdnOps(GdnOps):
    """``GdnOps`` with a chunk's conv and delta rule and the decode rows' step by the compiled
    loops (``cpu_kernel``): a decode row's delta-rule arithmetic is a one-token chunk's."""

    causal_conv1d = staticmethod(kernel_causal_conv1d)
    chunk_gated_delta_rule = staticmethod(kernel_delta_rule)
    chunk_delta_rule_cuts = staticmethod(kernel_delta_rule_cuts)
    delta_rule_step_slots = staticmethod(kernel_step_slots)


def gdn_ops() -> type[GdnOps]:
    """The CPU path's GDN ops: the compiled chunk rule where it could be built, else the chunked form."""
    return KernelGdnOps if cpu_kernel.available() else GdnOps


def norm_scale(weight: torch.Tensor, acc: torch.dtype, zero_centered: bool) -> torch.Tensor:
    """What an RMSNorm multiplies the normalised row by: ``1 + w`` in the accumulation dtype
    (zero-centered) or ``w`` as it is (plain: the reference casts the normalised row, then scales).
    The CPU layers keep it per weight (``cpu_layers.prepare``)."""
    return (1.0 + (weight if weight.dtype == acc else weight.to(acc))) if zero_centered else weight


def scaled_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """``rms_norm`` with the weight's ``norm_scale`` already made: one torch call for an fp32
    zero-centered norm (no cast where x is in the accumulation dtype already)."""
    acc = acc_dtype(x.dtype)
    xf = x if x.dtype == acc else x.to(acc)
    if zero_centered:
        y = F.rms_norm(xf, (x.shape[-1],), scale, eps)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    y = F.rms_norm(xf, (x.shape[-1],), None, eps)
    return scale * (y if y.dtype == x.dtype else y.to(x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """``ops.rms_norm``'s contract (x: [..., D]; weight: [D]) through ``F.rms_norm``: the same
    precision policy — zero-centered scales by (1 + w) in the accumulation dtype and casts,
    plain casts and then scales by w."""
    return scaled_norm(x, norm_scale(weight, acc_dtype(x.dtype), zero_centered), eps, zero_centered)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.gated_rms_norm``'s contract (w * norm(x) * silu(gate), the same casts): in fp32 with
    the compiled kernel, heads of whole 16-float vectors in one pass (``cpu_kernel.gated_norm``),
    else through ``F.rms_norm`` without the casts that change nothing (fp32)."""
    f32 = torch.float32
    if x.dtype == f32 and gate.dtype == f32 and weight.dtype == f32 and x.dim() == 3 and x.stride(-1) == 1 \
            and x.stride(1) == x.shape[2] and gate.stride(-1) == 1 and cpu_kernel.fits(x.shape[-1]) \
            and cpu_kernel.available():
        return cpu_kernel.gated_norm(x, gate, weight, eps)     # one compiled pass (2,000 x 4 heads: 0.64 -> 0.25 ms)
    acc = acc_dtype(x.dtype)
    y = F.rms_norm(x if x.dtype == acc else x.to(acc), (x.shape[-1],), None, eps)
    y = weight * (y if y.dtype == x.dtype else y.to(x.dtype))
    out = y * F.silu(gate if gate.dtype == acc else gate.to(acc))
    return out if out.dtype == x.dtype else out.to(x.dtype)
