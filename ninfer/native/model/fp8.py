"""FP8 block-scaled weights (Qwen's ``-FP8`` releases, DeepSeek's format).

A quantized Linear weight is stored as ``X.weight`` in float8_e4m3fn beside ``X.weight_scale_inv``
in fp32, one value per 128 × 128 block (the last blocks cut short)::

    W[i, j]  =  weight[i, j] * scale_inv[i // 128, j // 128]          (dequantised, fp32)

The engine keeps such a weight as an ``Fp8Weight`` (1 byte per element + the blocks' scales:
Qwen3-Next-80B-A3B fits one H200 in ~82 GB this way) and multiplies through ``linear``:

* elsewhere than CUDA (the reference, and every test on the CPU): the weight dequantised as
  above and rounded to the activation dtype, then ``F.linear`` — bit for bit the model whose
  checkpoint holds those dequantised values;
* on CUDA: ``torch._scaled_mm`` with the activations quantized per token and 128 columns
  (the checkpoints' ``activation_scheme: dynamic``) and the weight's 128 × 128 block scales,
  where this torch and GPU support blockwise scaling; else (refused once, logged) the
  dequantised form there too.

Stacked experts are an ``Fp8Weight`` of 3-D ``weight`` [E, N, K] and ``scale_inv`` [E, ⌈N/128⌉,
⌈K/128⌉]; ``kernels/moe.py`` reads them directly. Forming weights from the checkpoint's (row
permutation of the GDN projection, gate | up concatenation, the experts' stack) keeps them FP8
when the rows move in whole 128-row blocks, and dequantises them to the model dtype otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
log = logging.getLogger("ninfer.fp8")


@dataclass
class Fp8Weight:
    weight: torch.Tensor          # [N, K] (or [E, N, K]) float8_e4m3fn
    scale_inv: torch.Tensor       # [ceil(N/128), ceil(K/128)] (or [E, ...]) fp32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __getitem__(self, e: int) -> "Fp8Weight":
        """Expert ``e`` of a stacked weight."""
        return Fp8Weight(self.weight[e], self.scale_inv[e])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``: each element times its block's scale (in fp32), rounded once."""
        n, k = self.weight.shape[-2:]
        s = self.scale_inv.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :n, :k]
        return (self.weight.to(torch.float32) * s).to(dtype)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` (its last two dims in blocks)."""
    return (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK))


def quantize(w: torch.Tensor) -> Fp8Weight:
    """Block-quantize a weight [N, K] as the FP8 releases do: per 128 x 128 block, scale =
    amax / 448, the elements divided by it and cast to e4m3 (for tests and tiny checkpoints)."""
    n, k = w.shape
    pad = F.pad(w.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = pad.view(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)          # [N/128, K/128]
    q = (blocks / scale[:, None, :, None]).view_as(pad)[:n, :k].to(FP8)
    return Fp8Weight(q.contiguous(), scale.contiguous())


# ---- forming weights from the checkpoint's ---------------------------------------------------
def fold(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """Each ``X.weight`` with an ``X.weight_scale_inv`` beside it becomes one ``Fp8Weight``
    (the scale's entry dropped); ``lm_head`` is dequantised (its users — the LM head, MTP's and
    DFlash's — multiply by it as a plain tensor). In place; returns ``tensors``."""
    for name in [n for n in tensors if n.endswith(SCALE_SUFFIX)]:
        base = name[: -len(SCALE_SUFFIX)]
        w = Fp8Weight(tensors[base], tensors.pop(name))
        tensors[base] = w.dequantize(dtype) if base == "lm_head.weight" else w
    return tensors


def _aligned(rows: list[int]) -> bool:
    return all(r % BLOCK == 0 for r in rows)


def plain(w, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, Fp8Weight) else w


def permute_rows(w, perm: torch.Tensor, dtype: torch.dtype):
    """``w[perm]``: block rows moved whole when ``perm`` moves runs of 128 aligned rows,
    else the dequantised weight's rows."""
    if not isinstance(w, Fp8Weight):
        return w[perm].contiguous()
    blocks = perm.view(-1, BLOCK) if perm.numel() % BLOCK == 0 and w.weight.shape[0] % BLOCK == 0 else None
    if blocks is not None and bool((blocks[:, 0] % BLOCK == 0).all()) and \
            torch.equal(blocks - blocks[:, :1], torch.arange(BLOCK).expand_as(blocks)):
        return Fp8Weight(w.weight[perm].contiguous(), w.scale_inv[blocks[:, 0] // BLOCK].contiguous())
    return w.dequantize(dtype)[perm].contiguous()


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    if ts[0].is_meta:            # shapes only (``plan.py`` forms a whole model on "meta"): no per-call cost
        return torch.empty((*ts[0].shape[:-2], sum(t.shape[-2] for t in ts), ts[0].shape[-1]), dtype=ts[0].dtype,
                           device="meta")
    return torch.cat(ts, dim=-2)


def _stack(ts: list[torch.Tensor]) -> torch.Tensor:
    if ts[0].is_meta:
        return torch.empty((len(ts), *ts[0].shape), dtype=ts[0].dtype, device="meta")
    return torch.stack(ts)


def cat_rows(ws: list, dtype: torch.dtype):
    """Row concatenation: FP8 kept when every part but the last is whole 128-row blocks."""
    if all(isinstance(w, Fp8Weight) for w in ws) and _aligned([w.weight.shape[-2] for w in ws[:-1]]):
        return Fp8Weight(_cat([w.weight for w in ws]), _cat([w.scale_inv for w in ws]))
    return _cat([plain(w, dtype) for w in ws])


def stack(ws: list, dtype: torch.dtype):
    """The experts' stack [E, N, K]: FP8 kept when all of them are."""
    if all(isinstance(w, Fp8Weight) for w in ws):
        return Fp8Weight(_stack([w.weight for w in ws]), _stack([w.scale_inv for w in ws]))
    return _stack([plain(w, dtype) for w in ws])


# ---- multiplying ------------------------------------------------------------------------------
def rows_bucket(m: int) -> int:
    """The row count a CPU half-precision matmul of ``m`` rows runs at (``linear``): up to 16 as
    it is, then the next multiple of 64, past 1,024 of 256."""
    if m <= 16:
        return m
    step = 64 if m <= 1024 else 256
    return -(-m // step) * step


def _bucketed(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of a CPU bf16 / fp16 ``x`` [M, K] with M padded by zero rows to
    ``rows_bucket(M)``. oneDNN builds (JIT-compiles) a kernel for every new M in these dtypes —
    ~0.65 ms a linear against ~45 us once built (measured, 2 cores, [M, 128] x [128, 256]) — and
    a forward meets a new M with every chunk length and, in the MoE, every expert's row count:
    a 300-token bf16 forward ran 33 ms when its length was new, 22 when repeated. A row's
    result does not read the other rows; the padding costs at most one bucket of rows."""
    m = x.shape[0]
    b = rows_bucket(m)
    if b == m:
        return F.linear(x, w, bias)
    padded = x.new_zeros(b, x.shape[1])
    padded[:m] = x
    return F.linear(padded, w, bias)[:m]


def _half_cpu(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu"


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a plain or an FP8 weight (a CPU bf16 / fp16 one at bucketed row counts)."""
    if not isinstance(w, Fp8Weight):
        return _bucketed(x, w, bias) if _half_cpu(x) else F.linear(x, w, bias)
    if x.is_cuda and _scaled_mm_usable(w):
        try:
            return _scaled_mm(x, w, bias)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            _refuse(exc)
    w = w.dequantize(x.dtype)
    return _bucketed(x, w, bias) if _half_cpu(x) else F.linear(x, w, bias)


SCALED_MM: dict[str, object] = {"ok": None}


def _scaled_mm_usable(w: Fp8Weight) -> bool:
    n, k = w.weight.shape
    return SCALED_MM["ok"] is not False and n % BLOCK == 0 and k % BLOCK == 0 and hasattr(torch, "_scaled_mm")


def _refuse(exc: BaseException) -> None:
    SCALED_MM["ok"] = False
    log.warning("torch._scaled_mm refused blockwise FP8 scaling here (%s: %s): FP8 weights are dequantised for "
                "each product instead (correct, slower)", type(exc).__name__, str(exc).splitlines()[0][:200])


def quantize_activations(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> e4m3 [M, K] and fp32 scales [M, K/128]: per token, per 128 columns."""
    m, k = x2.shape
    groups = x2.float().view(m, k // BLOCK, BLOCK)
    scale = (groups.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    return (groups / scale[..., None]).view(m, k).to(FP8), scale


def _scaled_mm(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    xq, sa = quantize_activations(x.reshape(-1, k))
    # blockwise scaling (1 x 128 activations, 128 x 128 weights): scale_a [M, K/128] and
    # scale_b [K/128, N/128], as torch's Hopper path takes them (outer dim contiguous)
    out = torch._scaled_mm(xq, w.weight.t(), scale_a=sa.t().contiguous().t(), scale_b=w.scale_inv.t(),
                           out_dtype=x.dtype)
    SCALED_MM["ok"] = True
    if bias is not None:
        out = out + bias
    return out.view(*lead, -1)
