"""The CPU path's layers in fewer torch calls (``paths.CPU``: a CPU model in fp32 / bf16 / fp16).

On the CPU a small call's cost is its number of torch calls, not its arithmetic: a decode step of
the tiny model was ~2,000 aten calls (~760 from Python), ~1.5-3 us each, and the forward of one
decode row took 3.4 ms against 4.7 ms for eight (bench/README, "Fourteenth session"). Each layer
here computes what ``HybridModel.attention`` / ``_gdn`` and ``cpu_ops.dense_moe`` compute, to
the dtype's rounding (tests/native/model/test_cpu_layers.py), with the weights of a call's
products side by side so that one matmul does the work of several:

* attention: q | k | v (and the output gate) in one product; the q and k norms' scales kept in
  the accumulation dtype (``1 + w`` for a zero-centered norm, built once, not per call); RoPE
  on q and k together, in place.
* GDN: q | k | v | z | b | a in one product; ``-exp(A_log)`` and ``dt_bias`` kept in the
  accumulation dtype.
* MoE (the dense form, where ``cpu_ops.dense_moe_fits``): router | every expert's gate and up |
  the shared expert's gate, up and gate row in one product, the routed experts' and the shared
  expert's down projections in a second (the shared expert's sigmoid gate scales its activations
  before it).

``prepare`` builds a layer's ``CpuLayer``: the fused products' weights, of which the layer's own
projection weights become views (no second copy; an in-place change of either is seen by both),
and the derived constants. FP8 weights keep the generic layers (``prepare`` gives None).
``HybridModel`` runs these only while its path is ``paths.CPU``; any other path (a test's
``PER_SEQUENCE``, the float64 oracle's ``BATCHED``) runs the generic layers over the same views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.native.model import cpu_kernel
from ninfer.native.model.cpu_ops import norm_scale, scaled_norm
from ninfer.native.model.fp8 import linear
from ninfer.native.model.moe import MoeWeights
from ninfer.native.model.ops import acc_dtype


@dataclass
class CpuAttention:
    qkv: torch.Tensor                  # [q_proj | k_proj | v_proj] rows: the layer's three are views of it
    bias: torch.Tensor | None          # [q | k | v] biases side by side, or None
    q_norm: torch.Tensor               # the q / k norms' scales in the accumulation dtype (``norm_scale``)
    k_norm: torch.Tensor
    q_rows: int                        # q_proj's rows (2 H D with the output gate)
    kv_rows: int                       # Hkv D


@dataclass
class CpuGdn:
    in_proj: torch.Tensor              # [in_proj_qkvz | in_proj_ba] rows: both views of it
    neg_a: torch.Tensor                # -exp(A_log) [Hv], accumulation dtype
    dt_bias: torch.Tensor              # [Hv], accumulation dtype
    qkvz_rows: int


@dataclass
class CpuMoe:
    first: torch.Tensor                # [router | gate_up (E 2I) | shared gate | shared up | shared gate row] rows
    second: torch.Tensor               # [down side by side | shared down]: [H, E I + Is]; down, down_cat and
                                       # shared_down_proj are views of it
    experts: int
    inter: int                         # I
    shared_inter: int                  # Is


@dataclass
class CpuLayer:
    input_norm: torch.Tensor           # the layer's two norms' scales (``norm_scale``)
    post_norm: torch.Tensor
    mixer: CpuAttention | CpuGdn
    moe: CpuMoe | None                 # None: a dense MLP or a MoE without a shared expert (generic form)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``Rope.apply`` in place on a tensor the caller owns: x [T, Hx, D]; cos, sin [T, 1, R]."""
    r = cos.shape[-1]
    half = r // 2
    rot = x[..., :r]
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    rot.mul_(cos).addcmul_(rotated, sin)


def _norm_rope_pass(q: torch.Tensor, f, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether an attention layer's q / k norms and RoPE take ``cpu_kernel.qk_norm_rope``: fp32
    q, scales and rotary tables in layouts it reads (else the torch ops, never an error), the kernel
    built; float64 (the oracle's dtype) and bf16 keep the torch ops."""
    r = cos.shape[-1]
    return (q.dtype == torch.float32 and f.q_norm.dtype == torch.float32 and f.k_norm.dtype == torch.float32
            and cos.dtype == torch.float32 and sin.dtype == torch.float32 and r % 2 == 0 and r <= min(q.shape[-1], 1024)
            and q.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride() and cpu_kernel.available())


def _plain(*ws) -> bool:
    """Every weight a tensor (not FP8) of one dtype: they can stand side by side."""
    return all(isinstance(w, torch.Tensor) for w in ws) and len({w.dtype for w in ws}) == 1


def _fused_rows(owner, names: list[str]) -> torch.Tensor:
    """The weights ``names`` of ``owner`` stacked by rows into one tensor, each then replaced by its
    view of it (one copy in memory, as before)."""
    parts = [getattr(owner, n) for n in names]
    fused = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]).contiguous()
    at = 0
    for n, p in zip(names, parts):
        rows = p.numel() // p.shape[-1]
        setattr(owner, n, fused[at:at + rows].view(p.shape))
        at += rows
    return fused


def prepare(layer, cfg, acc: torch.dtype) -> CpuLayer | None:
    """``layer``'s ``CpuLayer`` (its projection weights made views of the fused ones), or None
    when a weight is FP8."""
    from ninfer.native.model.model import AttentionWeights     # the layer's types (model.py imports this module)
    m, zc = layer.mixer, cfg.zero_centered_norm
    if isinstance(m, AttentionWeights):
        if not _plain(m.q_proj, m.k_proj, m.v_proj):
            return None
        q_rows, kv_rows = m.q_proj.shape[0], m.k_proj.shape[0]
        mixer: CpuAttention | CpuGdn = CpuAttention(
            qkv=_fused_rows(m, ["q_proj", "k_proj", "v_proj"]),
            bias=torch.cat(m.biases[:3]) if m.biases else None,
            q_norm=norm_scale(m.q_norm, acc, zc), k_norm=norm_scale(m.k_norm, acc, zc),
            q_rows=q_rows, kv_rows=kv_rows)
    else:
        if not _plain(m.in_proj_qkvz, m.in_proj_ba):
            return None
        rows = m.in_proj_qkvz.shape[0]
        mixer = CpuGdn(in_proj=_fused_rows(m, ["in_proj_qkvz", "in_proj_ba"]), neg_a=-m.a_log.to(acc).exp(),
                       dt_bias=m.dt_bias.to(acc), qkvz_rows=rows)
    moe = None
    w = layer.mlp
    if isinstance(w, MoeWeights) and w.shared_gate_proj is not None and _plain(
            w.router, w.gate_up, w.down, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj, w.shared_gate):
        e, two_i, hidden = w.gate_up.shape
        i = two_i // 2
        first = _fused_rows(w, ["router", "gate_up", "shared_gate_proj", "shared_up_proj", "shared_gate"])
        second = torch.cat([w.down.permute(1, 0, 2).reshape(hidden, e * i), w.shared_down_proj], dim=1).contiguous()
        # the down projections as views of it (strided: each expert's [H, I] block a column range)
        w.down = second[:, :e * i].view(hidden, e, i).permute(1, 0, 2)
        w.down_cat, w.shared_down_proj = second[:, :e * i], second[:, e * i:]
        moe = CpuMoe(first=first, second=second, experts=e, inter=i, shared_inter=w.shared_down_proj.shape[1])
    return CpuLayer(input_norm=norm_scale(layer.input_norm, acc, zc), post_norm=norm_scale(layer.post_norm, acc, zc),
                    mixer=mixer, moe=moe)


def dense_moe(x: torch.Tensor, w: MoeWeights, f: CpuMoe) -> torch.Tensor:
    """``cpu_ops.dense_moe``'s result (the same routing: softmax in the accumulation dtype, top-k,
    renormalised when the model asks) in two products::

        [logits | gate_up | s_gate | s_up | s_g] = x @ first^T
        h   = [silu(gate) * up * route  |  silu(s_gate) * s_up * sigmoid(s_g)]     [T, E I + Is]
        out = h @ second^T
    """
    e, i, i_s = f.experts, f.inter, f.shared_inter
    t = x.shape[0]
    y = linear(x, f.first)
    acc = acc_dtype(x.dtype)
    logits = y[:, :e]
    probs = torch.softmax(logits if logits.dtype == acc else logits.to(acc), dim=-1)
    top_w, top_i = torch.topk(probs, w.top_k, dim=-1)
    if w.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    route = torch.zeros(t, e, dtype=x.dtype, device=x.device).scatter_(
        1, top_i, top_w if top_w.dtype == x.dtype else top_w.to(x.dtype))
    h = torch.empty(t, e * i + i_s, dtype=x.dtype, device=x.device)
    gu = y[:, e:e + 2 * e * i].view(t, e, 2, i)
    torch.mul(F.silu(gu[:, :, 0]), gu[:, :, 1], out=h[:, :e * i].view(t, e, i)).mul_(route[:, :, None])
    s = y[:, e + 2 * e * i:]
    torch.mul(F.silu(s[:, :i_s]), s[:, i_s:2 * i_s], out=h[:, e * i:]).mul_(torch.sigmoid(s[:, 2 * i_s:]))
    return linear(h, f.second)


def attention(model, w, f: CpuAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, cache,
              j: int) -> torch.Tensor:
    """``HybridModel.attention`` (no ``attend``) with one input product and RoPE in place;
    cos, sin: [T, 1, R]."""
    c = model.cfg
    t, d = x.shape[0], c.head_dim
    qkv = linear(x, f.qkv, f.bias)
    q, gate = qkv[:, :f.q_rows], None
    if c.attn_output_gate:
        qg = q.view(t, -1, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
    else:
        q = q.view(t, -1, d)
    h = q.shape[1]
    k = qkv[:, f.q_rows:f.q_rows + f.kv_rows].view(t, -1, d)
    v = qkv[:, f.q_rows + f.kv_rows:].view(t, -1, d)
    eps, zc = c.rms_norm_eps, c.zero_centered_norm
    if _norm_rope_pass(q, f, cos, sin):      # fp32: norms and RoPE in one compiled pass
        qk = cpu_kernel.qk_norm_rope(q, k, f.q_norm, f.k_norm, eps, cos, sin)
    else:
        qk = torch.cat([scaled_norm(q, f.q_norm, eps, zc), scaled_norm(k, f.k_norm, eps, zc)], dim=1)
        rope_(qk, cos, sin)
    q, k = qk[:, :h], qk[:, h:]
    model.path.write_kv(cache.k[j], cache.v[j], batch.slot_mapping, k, v)
    out = model.path.attention(q, cache.k[j], cache.v[j], batch, d ** -0.5).reshape(t, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate).reshape(t, -1)
    bo = w.biases[3] if w.biases else None
    return linear(out, w.o_proj, bo)


def gdn(model, w, f: CpuGdn, x: torch.Tensor, batch, cache, j: int) -> torch.Tensor:
    """``HybridModel._gdn`` with one input product and the decay's constants kept."""
    c = model.cfg
    hv = c.linear_num_value_heads
    y = linear(x, f.in_proj)
    mixed, z = y[:, :c.conv_dim], y[:, c.conv_dim:f.qkvz_rows]
    b, a = y[:, f.qkvz_rows:f.qkvz_rows + hv], y[:, f.qkvz_rows + hv:]
    beta = torch.sigmoid(b)
    acc = model.acc
    g = f.neg_a * F.softplus((a if a.dtype == acc else a.to(acc)) + f.dt_bias)
    return model.gdn_mix(w, mixed, z, g, beta, batch, cache, j)
