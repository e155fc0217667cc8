"""Pure-torch reference ops shared by the layers: norms, RoPE, dense MLP.

Precision policy (one place): ``acc_dtype(dtype)`` is the accumulation dtype — float64 for a
float64 model (so the oracle is exact), float32 otherwise (as the reference implementation
does for bf16/fp32). Results are cast back to the model dtype at the same points as the
Hugging Face implementation so fp32 logits agree to ~1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim.

    x: [..., D]; weight: [D]. ``zero_centered`` (Qwen3-Next) scales by (1 + w) in the
    accumulation dtype and then casts; plain (Qwen3) casts first and then scales by w.
    """
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xf * (1.0 + weight.to(acc))).to(x.dtype)
    return weight * xf.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Norm-then-gate RMSNorm of the GDN output: w * norm(x) * silu(gate).

    x, gate: [..., Dv]; weight: [Dv].
    """
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(x.dtype)
    return (y * F.silu(gate.to(acc))).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def silu_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP. x: [T, H]; gate_w, up_w: [I, H]; down_w: [H, I] -> [T, H]."""
    from ninfer.native.model.fp8 import linear
    return linear(F.silu(linear(x, gate_w)) * linear(x, up_w), down_w)


class Rope:
    """Rotary embedding on the first ``rotary_dim`` dims of each head (rotate-half layout).

    For float64 models the angles are computed in float64; otherwise in float32 exactly as
    the reference implementation does (inv_freq and position × inv_freq in fp32).

    ``mrope_section`` (Qwen3.5's interleaved MRoPE, e.g. (11, 11, 10) of rotary_dim/2 = 32
    frequencies): positions may then be [3, T] rows (t, h, w); frequency j takes its angle
    from row ``axis[j]``, interleaved T H W T H W ... while each section lasts:

        j     : 0 1 2 3 4 5 ... 30 31
        axis  : T H W T H W ... T  T      (H: j%3==1, j<3·s_h; W: j%3==2, j<3·s_w)

    A [T] position vector means (p, p, p), i.e. plain RoPE, so text-only calls are unchanged.
    """

    def __init__(self, rotary_dim: int, theta: float, dtype: torch.dtype, device: torch.device,
                 mrope_section: tuple[int, ...] = ()):
        self.rotary_dim = rotary_dim
        self.dtype = dtype
        acc = acc_dtype(dtype)
        self.acc = acc
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=acc, device=device) / rotary_dim))
        self.axis = mrope_axes(mrope_section, rotary_dim // 2, device) if mrope_section else None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (or [3, T] with ``mrope_section``) -> cos, sin: [T, rotary_dim] in the model dtype."""
        if positions.dim() == 2:
            if self.axis is None:
                raise ValueError("3-row (t, h, w) positions need a Rope built with mrope_section")
            rows = positions.to(self.acc)[:, :, None] * self.inv_freq            # [3, T, R/2]
            freqs = rows.gather(0, self.axis.expand(1, rows.shape[1], -1))[0]     # [T, R/2]
        else:
            freqs = positions.to(self.acc)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, Hx, D]; cos, sin: [T, R] with R <= D -> [T, Hx, D]."""
        r = cos.shape[-1]
        rot, rest = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos[:, None, :] + rotated * sin[:, None, :]
        return torch.cat((out, rest), dim=-1)


def mrope_axes(section: tuple[int, ...], half: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) each of the ``half`` frequencies uses: [1, 1, half]."""
    if len(section) != 3 or sum(section) != half:
        raise ValueError(f"mrope_section {list(section)} must be 3 numbers summing to rotary_dim/2 = {half}")
    j = torch.arange(half)
    axis = torch.zeros(half, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis.view(1, 1, half).to(device)
