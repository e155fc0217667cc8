"""Gated DeltaNet ops on the GPU: fla-core's kernels behind our signatures.

The references are ``ninfer/native/model/gdn.py`` (same signatures, re-exported here as
``*_ref``). On CUDA, when fla-core (the optional ``gpu`` extra, pinned 0.6.0) is installed and
the model is not float64, the dispatch calls fla's kernels, which match our contract directly:

    ours                                       fla-core 0.6.0
    q, k [N, T, Hk, Dk], v [N, T, Hv, Dv]      the same ([B, T, H, K] / [B, T, HV, V], HV % H == 0)
    g (log decay), beta (post-sigmoid) [.., Hv] the same (use_gate_in_kernel=False)
    l2norm(q), l2norm(k), q * Dk^-0.5 inside   use_qk_l2norm_in_kernel=True, scale=Dk^-0.5 (eps 1e-6 both)
    state in/out [N, Hv, Dk, Dv], fp32         initial_state / output_final_state, fp32, [K, V] layout
    conv state [C, K-1] (last K-1 inputs)      [N, C, W]: one leading column more (ignored on input)

float64 (the CPU oracle) always takes the reference: fla computes its state in fp32. Without
fla on a CUDA machine the reference runs there too (correct, slower). docs/structures.md
records why these are fla's and not ours, and what was measured.
"""

from __future__ import annotations

import functools
import logging

import torch

from ninfer.native.kernels import on_cuda
from ninfer.native.model.gdn import causal_conv1d as causal_conv1d_ref
from ninfer.native.model.gdn import causal_conv1d_step as causal_conv1d_step_ref
from ninfer.native.model.gdn import chunk_gated_delta_rule as chunk_gated_delta_rule_ref
from ninfer.native.model.gdn import (
    recurrent_gated_delta_rule as recurrent_gated_delta_rule_ref,
)

log = logging.getLogger("ninfer.kernels")

__all__ = [
    "causal_conv1d",
    "causal_conv1d_ref",
    "causal_conv1d_step",
    "causal_conv1d_step_ref",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "fla_available",
    "fla_status",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_ref",
]


@functools.cache
def fla_status() -> str:
    """'ok' when fla-core's GDN kernels import, else the import error as it was raised (a
    missing package, or fla failing against this torch / triton: the two must not look alike)."""
    try:
        import fla.modules.causal_conv1d
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"; kept whole
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@functools.cache
def fla_available() -> bool:
    """Whether CUDA GDN calls take fla's kernels. When they cannot, the reason is logged once
    (a warning: a CUDA model then runs the torch reference, correct but slow), never swallowed."""
    status = fla_status()
    if status != "ok":
        log.warning("fla-core's GDN kernels are not usable (%s): the gated delta rule and the causal conv run "
                    "the torch reference on CUDA", status)
    return status == "ok"


def _use_fla(*tensors: torch.Tensor) -> bool:
    return on_cuda(*tensors) and tensors[0].dtype != torch.float64 and fla_available()


# ---- the gated delta rule ---------------------------------------------------------------
def recurrent_gated_delta_rule_fla(q, k, v, g, beta, state):
    """fla's fused recurrent form. Shapes as ``recurrent_gated_delta_rule_ref``."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    o, s = fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, scale=q.shape[-1] ** -0.5,
        initial_state=state.to(torch.float32).contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    return o, s


def chunk_gated_delta_rule_fla(q, k, v, g, beta, state):
    """fla's chunked form over one sequence. Shapes as ``chunk_gated_delta_rule_ref``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    o, s = fla_chunk(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=q.shape[-1] ** -0.5,
                     initial_state=state[None].to(torch.float32).contiguous(), output_final_state=True,
                     use_qk_l2norm_in_kernel=True)
    return o[0], s[0]


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    impl = recurrent_gated_delta_rule_fla if _use_fla(v, q) else recurrent_gated_delta_rule_ref
    return impl(q, k, v, g, beta, state)


def chunk_gated_delta_rule(q, k, v, g, beta, state):
    impl = chunk_gated_delta_rule_fla if _use_fla(v, q) else chunk_gated_delta_rule_ref
    return impl(q, k, v, g, beta, state)


# ---- causal depthwise conv ----------------------------------------------------------------
def _fla_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor):
    """x: [N, T, C]; state: [N, C, K-1] -> y [N, T, C], new state [N, C, K-1]."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    init = torch.nn.functional.pad(state.to(x.dtype), (1, 0)).contiguous()      # [N, C, K]
    y, final = fla_conv(x.contiguous(), weight=weight, initial_state=init, output_final_state=True,
                        activation="silu")
    return y, final[:, :, 1:].contiguous()


def causal_conv1d_fla(x, state, weight):
    """Shapes as ``causal_conv1d_ref``: x [T, C]; state [C, K-1]; weight [C, K]."""
    y, s = _fla_conv(x[None], state[None], weight)
    return y[0], s[0]


def causal_conv1d_step_fla(x, state, weight):
    """Shapes as ``causal_conv1d_step_ref``: x [N, C]; state [N, C, K-1]."""
    y, s = _fla_conv(x[:, None], state, weight)
    return y[:, 0], s


def causal_conv1d(x, state, weight):
    return (causal_conv1d_fla if _use_fla(x) else causal_conv1d_ref)(x, state, weight)


def causal_conv1d_step(x, state, weight):
    return (causal_conv1d_step_fla if _use_fla(x) else causal_conv1d_step_ref)(x, state, weight)
