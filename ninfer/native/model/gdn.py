"""Gated DeltaNet core: causal depthwise conv with carried state, and the gated delta rule.

Per value head h, with state S: [Dk, Dv], decay g_t (log space, <= 0) and rate beta_t::

    S   <- exp(g_t) * S
    S   <- S + k_t ⊗ beta_t (v_t - S^T k_t)         (delta rule)
    o_t  = S^T q_t                                  (q_t already scaled by Dk^-0.5)

Two exact forms of the same recurrence, both taking an explicit initial state and returning
the final state (so any prefill may be cut anywhere and continued):

* ``chunk_gated_delta_rule`` — prefill: UT/WY transform inside 64-token blocks, one state
  hand-over per block.
* ``recurrent_gated_delta_rule`` — decode: one step per token, batched over rows.

q and k are L2-normalised inside (as the reference implementation does); all math runs in the
accumulation dtype (fp32, or fp64 for a float64 model). Key heads are shared by
``Hv // Hk`` consecutive value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.native.model.ops import acc_dtype, l2norm

CHUNK = 64


# rows from which ``causal_conv1d`` leaves x in place (fp32 at 2,000 rows: 1.40 -> 0.95 ms;
# below a few hundred rows the concatenation is as cheap as the extra ops)
CONV_SPLIT_ROWS = 512


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence, continuing from ``state``.

    x: [T, C] new inputs; state: [C, K-1] the previous K-1 inputs (zeros at position 0);
    weight: [C, K]. Returns y: [T, C] (contiguous) and the new state [C, K-1] (the last K-1 inputs).

        rows:  s_0 .. s_{K-2} | x_0 x_1 ... x_{T-1}
        y_t   =  sum_j w[:, j] * rows[t + j]          (the window ending at x_t)
    """
    k, t = weight.shape[1], x.shape[0]
    k1 = k - 1
    # K shifted multiply-adds over contiguous row blocks: a depthwise conv with a 4-wide kernel is
    # a handful of vector ops (F.conv1d's grouped path costs ~1 ms a call on CPU in float64), and
    # in the [T, C] layout nothing is transposed in or out (the [C, T] layout's copies took
    # ~9 ms of fp32 at T = 2,048; the products and sums are the same, bit for bit)
    w = weight.t().contiguous()                         # [K, C]
    if t < CONV_SPLIT_ROWS:
        xs = torch.cat([state.t().to(x.dtype), x], dim=0)  # [K-1+T, C]
        return F.silu(_window_sums(xs, w, t)), xs[t:].t().contiguous()
    # a long chunk: the first K-1 outputs (which read the state) from a small concatenation, the
    # rest from x in place — the same products summed in the same order, without copying x
    y = torch.empty_like(x)
    y[:k1] = _window_sums(torch.cat([state.t().to(x.dtype), x[:k1]], dim=0), w, k1)
    _window_sums(x, w, t - k1, out=y[k1:])
    return F.silu(y), x[t - k1:].t().contiguous()


def _window_sums(rows: torch.Tensor, w: torch.Tensor, t: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j w[j] * rows[i + j] for i < t, j < K, in ascending j (rows: [t + K - 1, C]; w: [K, C])."""
    y = torch.mul(rows[:t], w[0], out=out)
    for j in range(1, w.shape[0]):
        y.addcmul_(rows[j:j + t], w[j])
    return y


def causal_conv1d_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for N rows. x: [N, C]; state: [N, C, K-1]; weight: [C, K].

    Returns y: [N, C] and the new state [N, C, K-1].
    """
    xs = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [N, C, K]
    y = F.silu((xs * weight[None]).sum(-1))
    return y, xs[:, :, 1:].clone()


def _prep(q, k, v, g, beta, acc):
    """Expand key heads to value heads, normalise and scale q/k, cast to the accumulation dtype."""
    rep = v.shape[-2] // k.shape[-2]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    q, k = l2norm(q.to(acc)), l2norm(k.to(acc))
    q = q * (q.shape[-1] ** -0.5)
    return q, k, v.to(acc), g.to(acc), beta.to(acc)


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, keep_steps: bool = False,
):
    """Token-by-token form for N rows of T steps each (decode: T == 1; a verify row: T = 1 + drafts).

    q, k: [N, T, Hk, Dk]; v: [N, T, Hv, Dv]; g, beta: [N, T, Hv]; state: [N, Hv, Dk, Dv].
    Returns o: [N, T, Hv, Dv] (input dtype of v) and the final state [N, Hv, Dk, Dv]
    (accumulation dtype); with ``keep_steps`` also the state after every step [N, T, Hv, Dk, Dv]
    (speculative verify rolls back to one of them).
    """
    out_dtype = v.dtype
    acc = acc_dtype(v.dtype)
    q, k, v, g, beta = _prep(q, k, v, g, beta, acc)
    s = state.to(acc)
    outs, steps = [], []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kv_mem = (s * k[:, t, :, :, None]).sum(-2)                      # [N, Hv, Dv]
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((s * q[:, t, :, :, None]).sum(-2))
        if keep_steps:
            steps.append(s)
    o = torch.stack(outs, dim=1).to(out_dtype)
    return (o, s, torch.stack(steps, dim=1)) if keep_steps else (o, s)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (UT-transform) form over one sequence.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; state: [Hv, Dk, Dv].
    Returns o: [T, Hv, Dv] (dtype of v) and the final state [Hv, Dk, Dv] (accumulation dtype).

    Inside a block of C tokens with cumulative log decay G_i = g_1 + ... + g_i:
        D[i, j]  = exp(G_i - G_j) for j <= i, else 0
        (I + strict_lower((beta k) k^T ∘ D)) U = beta v,   ... W = beta k exp(G)
        v'       = U - W S
        o        = (q exp(G)) S + ((q k^T) ∘ D) v'
        S_next   = exp(G_C) S + (k exp(G_C - G))^T v'
    """
    out_dtype = v.dtype
    acc = acc_dtype(v.dtype)
    T = v.shape[0]
    q, k, v, g, beta = _prep(q, k, v, g, beta, acc)
    # [H, T, D] layout; pad T up to a multiple of the block (padding: k = 0, beta = 0, g = 0).
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.t(), beta.t()
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    H, n = v.shape[0], (T + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)

    G = g.cumsum(-1)                                                    # [H, n, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay                          # unit diagonal ignored
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * G.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * G.exp()[..., None]
    k_dec = k * (G[..., -1:] - G).exp()[..., None]
    block_decay = G[..., -1].exp()[..., None, None]                      # [H, n, 1, 1]

    s = state.to(acc)
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * block_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(H, n * chunk, -1)[:, :T].transpose(0, 1)
    return out.to(out_dtype), s
