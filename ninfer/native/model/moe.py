"""Sparse MoE MLP with a sigmoid-gated shared expert (pure-torch reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.native.model.fp8 import linear
from ninfer.native.model.ops import acc_dtype, silu_mlp

# Token rows up to which the per-(token, expert) fused kernel (kernels/moe.py) beats grouping by
# expert: past it each chosen expert's weights are read once per token instead of once. Here,
# beside the torch form, so that graphs.py can bound its chunk graphs without importing triton.
FUSED_MAX_ROWS = 256


@dataclass
class MoeWeights:
    """router: [E, H]; gate_up: [E, 2I, H] (gate rows then up rows); down: [E, H, I];
    shared_*: the shared expert's SwiGLU weights; shared_gate: [1, H]."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    norm_topk_prob: bool
    shared_gate_proj: torch.Tensor | None = None
    shared_up_proj: torch.Tensor | None = None
    shared_down_proj: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    down_cat: torch.Tensor | None = None          # the CPU's dense form: ``down`` side by side [H, E*I], derived once
    shared_cat: torch.Tensor | None = None        # the CPU's grouped form: the shared gate | up | gate rows, derived once
    routed_t: tuple | None = None                 # the CPU kernel's (key, gate_up^T, down^T): derived, cpu_ops


def route(x: torch.Tensor, w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts: the router's softmax in the accumulation dtype, its top-k, renormalised
    when the model asks (``norm_topk_prob``). Returns (weights [T, k] in the accumulation dtype,
    expert ids [T, k])."""
    probs = torch.softmax(linear(x, w.router).to(acc_dtype(x.dtype)), dim=-1)
    top_w, top_i = torch.topk(probs, w.top_k, dim=-1)
    if w.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    return top_w, top_i


def sparse_moe(x: torch.Tensor, w: MoeWeights, dense: bool = False) -> torch.Tensor:
    """x: [T, H] -> [T, H]. Routing softmax in the accumulation dtype, top-k, optional
    renormalisation; each token's output is the weighted sum of its experts plus the gated
    shared expert.

    ``dense``: every expert over every token, weighted by a [T, E] routing matrix that is zero
    where an expert was not chosen — no data-dependent shape or host sync, so a CUDA graph can
    capture it (native/graphs.py). Experts are summed in the same ascending order as the sparse
    form and an unchosen expert adds an exact zero, so the two agree to the matmuls' rounding."""
    top_w, top_i = route(x, w)                                         # [T, k]
    top_w = top_w.to(x.dtype)
    out = torch.zeros_like(x)
    inter = w.down.shape[-1]
    if dense:
        weights = torch.zeros(x.shape[0], w.gate_up.shape[0], dtype=x.dtype, device=x.device).scatter_(1, top_i, top_w)
        for e in range(w.gate_up.shape[0]):
            gate_up = linear(x, w.gate_up[e])
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out = out + linear(h, w.down[e]) * weights[:, e:e + 1]
        return with_shared(out, x, w)
    # (token, slot) pairs grouped by expert with one stable sort and one host read of the counts:
    # each expert sees its tokens in ascending order (as a per-expert torch.where would give), and
    # one index_add_ in that order sums each token's experts in ascending expert order
    if x.shape[0] == 0:
        return with_shared(out, x, w)
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w.gate_up.shape[0]).tolist()
    tok = order // w.top_k
    xs = x.index_select(0, tok)
    ys, lo = [], 0
    for e, n in enumerate(counts):
        if n:
            gate_up = linear(xs[lo:lo + n], w.gate_up[e])
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            ys.append(linear(h, w.down[e]))
            lo += n
    y = torch.cat(ys) * top_w.reshape(-1).index_select(0, order)[:, None]
    out.index_add_(0, tok, y)
    return with_shared(out, x, w)


def with_shared(out: torch.Tensor, x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    if w.shared_gate_proj is not None:
        shared = silu_mlp(x, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj)
        out = out + torch.sigmoid(linear(x, w.shared_gate)) * shared
    return out
