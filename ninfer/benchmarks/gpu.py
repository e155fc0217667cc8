"""The GPU check's cases (issue 15, staged by issue 33: ``gpu_runner.py`` / ``gpu_stages.py``).

Every kernel of ``ninfer/native/kernels`` against its torch reference on the same device
(``kernel_cases`` at the ``SIZES`` tiny / small / full: relative error within the bound the CPU
tests state, copies bit for bit), fla's GDN kernels against ours (``gdn_cases``), pinned
H2D / D2H bandwidth, and the engine (``engine_check``: the tiny model and a mid-size synthetic
one, ``make_mid_model``, each with CUDA graphs on and off) against ``reference_generate`` and
each other, with decode tok/s at C = 1..8, prefill tok/s and the graphs' capture time. Without
CUDA the same comparisons run at the tiny size under TRITON_INTERPRET=1 (what the tests run).
It has not yet run on a GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Bounds (relative Frobenius error vs the reference in fp32 on the same stored values): the
# kernels round only their outputs. On CUDA the 16-bit P·V product adds P's rounding, hence
# the looser GPU column.
ATTN_BOUND = {"cpu": {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3},
              "cuda": {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}}
# fla computes the delta rule's products in TF32 on CUDA (its own tests accept 5e-3 in fp32);
# 16-bit inputs add their own rounding of q, k, v and of the output.
GDN_BOUND = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
CONV_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SIZES = {
    # decode rows, context, heads, kv heads, head dim | prefill prefix, chunk | GDN heads k/v, dims, chunk
    "tiny": {"rows": 2, "ctx": 130, "h": 4, "hkv": 2, "d": 64, "prefix": 70, "chunk": 20,
             "hk": 1, "hv": 2, "dk": 32, "t": 9, "layers": 2, "experts": 8, "topk": 2, "hidden": 128, "inter": 64},
    # real head dims and widths (Qwen3-Next's), few rows: what compiles at real sizes, quickly
    "small": {"rows": 4, "ctx": 300, "h": 16, "hkv": 2, "d": 256, "prefix": 100, "chunk": 90,
              "hk": 16, "hv": 32, "dk": 128, "t": 200, "layers": 2, "experts": 64, "topk": 10, "hidden": 2048,
              "inter": 512},
    "full": {"rows": 64, "ctx": 4096, "h": 16, "hkv": 2, "d": 256, "prefix": 2048, "chunk": 2048,
             "hk": 16, "hv": 32, "dk": 128, "t": 2048, "layers": 36, "experts": 512, "topk": 10, "hidden": 2048,
             "inter": 512},
}


@dataclass
class Case:
    kernel: str
    dtype: torch.dtype
    run: Callable[[], object]          # the kernel (timed)
    check: Callable[[object], float]   # its output -> error against the reference
    bound: float
    graph: bool = True                 # capturable: no host read (the forward's own call form)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _paged(n_seqs: int, length: int, hkv: int, d: int, dtype, device):
    """Caches and shuffled page tables with every sequence's positions 0..length-1 written."""
    pages = (length + 63) // 64
    order = torch.randperm(n_seqs * pages, device=device)
    tables = order.view(n_seqs, pages).to(torch.int32)
    k = torch.randn(n_seqs * pages, 64, hkv, d, device=device).to(dtype)
    v = torch.randn(n_seqs * pages, 64, hkv, d, device=device).to(dtype)
    return k, v, tables


def attention_cases(size: dict, dtype, device) -> list[Case]:
    from ninfer.native.kernels import paged_attention as pa
    dev = torch.device(device).type
    h, hkv, d = size["h"], size["hkv"], size["d"]
    scale = d ** -0.5
    k, v, tables = _paged(size["rows"], size["ctx"], hkv, d, dtype, device)
    q = torch.randn(size["rows"], h, d, device=device).to(dtype)
    lens = torch.full((size["rows"],), size["ctx"], dtype=torch.int32, device=device)
    splits = pa.decode_splits(tables.shape[1], size["rows"], hkv)
    dec_ref = pa.paged_decode_ref(q.float(), k.float(), v.float(), tables, lens, scale)
    pre_len = size["prefix"] + size["chunk"]
    k2, v2, t2 = _paged(1, pre_len, hkv, d, dtype, device)
    qp = torch.randn(size["chunk"], h, d, device=device).to(dtype)
    cu = torch.tensor([0, size["chunk"]], dtype=torch.int32, device=device)
    st = torch.tensor([size["prefix"]], dtype=torch.int32, device=device)
    pre_ref = pa.paged_prefill_ref(qp.float(), k2.float(), v2.float(), t2, cu, st, scale)
    bound = ATTN_BOUND[dev][dtype]
    block_m = None if dev == "cuda" else 16          # CUDA: the kernel's own launch config
    return [
        Case(f"paged_decode x{splits} splits", dtype,
             lambda: pa.paged_decode_triton(q, k, v, tables, lens, scale, splits), lambda o: _rel(o, dec_ref), bound),
        Case("paged_prefill", dtype, lambda: pa.paged_prefill_triton(qp, k2, v2, t2, cu, st, scale, block_m,
                                                                     max_q=size["chunk"]),
             lambda o: _rel(o, pre_ref), bound),
    ]


def copy_cases(size: dict, dtype, device) -> list[Case]:
    from ninfer.native.kernels import copies
    hkv, d, rows = size["hkv"], size["d"], size["rows"]
    k, v, tables = _paged(rows, size["ctx"], hkv, d, dtype, device)
    slots = (tables[:, -1].long() * 64 + 63).to(torch.int32)     # one new token per row
    nk, nv = torch.randn(rows, hkv, d, device=device).to(dtype), torch.randn(rows, hkv, d, device=device).to(dtype)
    kr, vr = k.clone(), v.clone()
    copies.write_kv_ref(kr, vr, slots.long(), nk, nv)
    kl, vl = torch.stack([k, k]), torch.stack([v, v])          # [La=2, P, 64, Hkv, D]
    src, dst = tables[:, 0].contiguous(), tables[:, -1].contiguous()   # distinct pages (ctx > 64)
    n = torch.full((rows,), 37, dtype=torch.int32, device=device)      # a tail of 37 tokens
    kc = kl.clone()
    copies.copy_page_prefix_ref(kc, vl.clone(), src, dst, n)

    def same(a, b) -> float:
        return 0.0 if torch.equal(a.view(torch.uint8), b.view(torch.uint8)) else 1.0
    cases = [
        Case("write_kv", dtype, lambda: (copies.write_kv_triton(k, v, slots, nk, nv), (k, v))[1],
             lambda o: max(same(o[0], kr), same(o[1], vr)), 0.0),
        Case("copy_page_prefix", dtype, lambda: (copies.copy_page_prefix_triton(kl, vl, src, dst, n), kl)[1],
             lambda o: same(o[:, dst.long(), :37], kc[:, dst.long(), :37]), 0.0, graph=False),
    ]
    if dtype != torch.float32:
        return cases
    # The ssm state is fp32 whatever the model dtype: checked (and timed) once.
    state = torch.randn(size["layers"], rows + 1, size["hv"], size["dk"], size["dk"], device=device)
    idx = torch.arange(rows, 0, -1, dtype=torch.int32, device=device)
    gathered = state[:, idx.long()]
    return cases + [Case("gather_slots (ssm state)", torch.float32, lambda: copies.gather_slots_triton(state, idx),
                         lambda o: same(o, gathered), 0.0)]


def gdn_cases(size: dict, dtype, device, ops=None, prefix: str = "fla") -> list[Case]:
    """The gated delta rule (chunked prefill over one sequence, recurrent decode rows, verify
    rows of 1 + 3 inputs) and the causal conv (a chunk, a decode step) through ``ops`` — the
    fla adapters of ``kernels.gdn`` on CUDA — against the torch references in fp32 on the same
    device. Without fla on CUDA there is nothing to check (``[]``); the CPU stand-in passes the
    reference module as ``ops`` (the stage's harness, not fla, is what it checks there)."""
    from ninfer.native.kernels import gdn
    if ops is None:
        if torch.device(device).type != "cuda" or not gdn.fla_available():
            return []
        ops = FlaOps
    hk, hv, dk, t, n = size["hk"], size["hv"], size["dk"], size["t"], size["rows"]
    g0 = torch.Generator(device=device).manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g0, device=device)  # noqa: E731
    q, k, v = r(t, hk, dk).to(dtype), r(t, hk, dk).to(dtype), r(t, hv, dk).to(dtype)
    g = -torch.rand(t, hv, generator=g0, device=device) * 0.5
    beta, s0 = torch.rand(t, hv, generator=g0, device=device).to(dtype), r(hv, dk, dk) * 0.1
    ref = gdn.chunk_gated_delta_rule_ref(q.float(), k.float(), v.float(), g, beta.float(), s0)
    qd, kd, vd = q[:n, None], k[:n, None], v[:n, None]
    gd, bd, sd = g[:n, None], beta[:n, None], s0[None].expand(n, -1, -1, -1).contiguous()
    ref_d = gdn.recurrent_gated_delta_rule_ref(qd.float(), kd.float(), vd.float(), gd, bd.float(), sd)
    nv, steps = max(1, n // 4), 4                       # verify rows: 1 + 3 drafts
    shape = lambda x: x[:nv * steps].reshape(nv, steps, *x.shape[1:])  # noqa: E731
    qv, kv, vv, gv, bv = shape(q), shape(k), shape(v), shape(g), shape(beta)
    sv = s0[None].expand(nv, -1, -1, -1).contiguous()
    ref_v = gdn.recurrent_gated_delta_rule_ref(qv.float(), kv.float(), vv.float(), gv, bv.float(), sv)
    channels = 2 * hk * dk + hv * dk
    x, w = r(t, channels).to(dtype), (r(channels, 4) * 0.3).to(dtype)
    cs = r(channels, 3).to(dtype)
    ref_c = gdn.causal_conv1d_ref(x.float(), cs.float(), w.float())
    xs, css = x[:n], cs[None].expand(n, -1, -1).contiguous()
    ref_cs = gdn.causal_conv1d_step_ref(xs.float(), css.float(), w.float())
    bound, cbound = GDN_BOUND[dtype], CONV_BOUND[dtype]

    def err(out, want) -> float:
        return max(_rel(out[0], want[0]), _rel(out[1], want[1]))
    return [
        Case(f"{prefix} chunk_gated_delta_rule T={t}", dtype, lambda: ops.chunk_gated_delta_rule(q, k, v, g, beta, s0),
             lambda o: err(o, ref), bound),
        Case(f"{prefix} recurrent (decode) N={n}", dtype,
             lambda: ops.recurrent_gated_delta_rule(qd, kd, vd, gd, bd, sd), lambda o: err(o, ref_d), bound),
        Case(f"{prefix} recurrent (verify) N={nv}x{steps}", dtype,
             lambda: ops.recurrent_gated_delta_rule(qv, kv, vv, gv, bv, sv), lambda o: err(o, ref_v), bound),
        Case(f"{prefix} causal_conv1d T={t}", dtype, lambda: ops.causal_conv1d(x, cs, w), lambda o: err(o, ref_c),
             cbound),
        Case(f"{prefix} causal_conv1d_step N={n}", dtype, lambda: ops.causal_conv1d_step(xs, css, w),
             lambda o: err(o, ref_cs), cbound),
    ]


class FlaOps:
    """fla's kernels behind our signatures (``kernels.gdn``'s adapters)."""

    @staticmethod
    def chunk_gated_delta_rule(*a):
        from ninfer.native.kernels import gdn
        return gdn.chunk_gated_delta_rule_fla(*a)

    @staticmethod
    def recurrent_gated_delta_rule(*a):
        from ninfer.native.kernels import gdn
        return gdn.recurrent_gated_delta_rule_fla(*a)

    @staticmethod
    def causal_conv1d(*a):
        from ninfer.native.kernels import gdn
        return gdn.causal_conv1d_fla(*a)

    @staticmethod
    def causal_conv1d_step(*a):
        from ninfer.native.kernels import gdn
        return gdn.causal_conv1d_step_fla(*a)


NORM_BOUND = {"cpu": {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 2.4e-2},   # interpreter: bf16
              "cuda": {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}}     # casts truncate


def norm_cases(size: dict, dtype, device) -> list[Case]:
    """The fused norms over a decode batch's rows of the model width (plain, zero-centred, gated)."""
    from ninfer.native.kernels import norms
    rows, width = size["rows"] * size["h"], size["d"]
    g = torch.Generator(device=device).manual_seed(5)
    x = (torch.randn(rows, width, generator=g, device=device) * 3).to(dtype)
    gate = torch.randn(rows, width, generator=g, device=device).to(dtype)
    w = (torch.randn(width, generator=g, device=device) * 0.2 + 1).to(dtype)
    bound = NORM_BOUND[torch.device(device).type][dtype]
    out = []
    for zc in (False, True):
        want = norms.rms_norm_ref(x, w, 1e-6, zc)
        out.append(Case(f"rms_norm ({'zero-centred' if zc else 'plain'})", dtype,
                        lambda zc=zc: norms.rms_norm_triton(x, w, 1e-6, zc), lambda o, r=want: _rel(o, r), bound))
    want = norms.gated_rms_norm_ref(x, gate, w, 1e-6)
    out.append(Case("gated_rms_norm", dtype, lambda: norms.gated_rms_norm_triton(x, gate, w, 1e-6),
                    lambda o: _rel(o, want), bound))
    return out


MOE_BOUND = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def moe_cases(size: dict, dtype, device) -> list[Case]:
    """The fused MoE over a decode batch (Qwen3-Next's 512 experts, top-10, at full size) with
    a shared expert, against the grouped torch reference on the same device."""
    from ninfer.native.kernels import moe
    from ninfer.native.model.moe import MoeWeights
    e, k, h, inter, t = size["experts"], size["topk"], size["hidden"], size["inter"], size["rows"]
    g = torch.Generator(device=device).manual_seed(9)
    r = lambda *s, std=0.05: (torch.randn(*s, generator=g, device=device) * std).to(dtype)  # noqa: E731
    w = MoeWeights(router=r(e, h, std=0.5), gate_up=r(e, 2 * inter, h), down=r(e, h, inter), top_k=k,
                   norm_topk_prob=True, shared_gate_proj=r(inter, h), shared_up_proj=r(inter, h),
                   shared_down_proj=r(h, inter), shared_gate=r(1, h))
    x = r(t, h, std=1.0)
    want = moe.sparse_moe_ref(x, w)
    return [Case("fused_moe", dtype, lambda: moe.fused_moe_triton(x, w), lambda o: _rel(o, want), MOE_BOUND[dtype])]


def gdn_decode_cases(size: dict, dtype, device) -> list[Case]:
    """The GDN decode rows in place (``kernels/gdn_decode.py``: conv step and delta-rule step
    reading and writing the rows' state slots) against gather / torch step / scatter."""
    from ninfer.native.kernels import gdn_decode as gd
    hk, hv, d, n = size["hk"], size["hv"], size["dk"], size["rows"]
    g0 = torch.Generator(device=device).manual_seed(17)
    r = lambda *s: torch.randn(*s, generator=g0, device=device)  # noqa: E731
    q, k, v = r(n, hk, d).to(dtype), r(n, hk, d).to(dtype), r(n, hv, d).to(dtype)
    g, beta = -torch.rand(n, hv, generator=g0, device=device) * 0.5, torch.rand(n, hv, generator=g0, device=device)
    slots = torch.arange(n, 0, -1, device=device)                       # slot 0 untouched
    ssm = r(n + 1, hv, d, d) * 0.1
    want_ssm = ssm.clone()
    want = gd.delta_rule_step_ref(q, k, v, g, beta.to(dtype), want_ssm, slots)
    c = 2 * hk * d + hv * d
    x, w = r(n, c).to(dtype), (r(c, 4) * 0.3).to(dtype)
    conv = r(n + 1, c, 3).to(dtype)
    want_conv = conv.clone()
    want_y = gd.conv_step_ref(x, want_conv, slots, w)
    bound = GDN_BOUND[dtype]

    def step():
        s = ssm.clone()
        return gd.delta_rule_step_triton(q, k, v, g, beta.to(dtype), s, slots), s

    def conv_step():
        s = conv.clone()
        return gd.conv_step_triton(x, s, slots, w), s
    return [Case("gdn delta-rule step in place", dtype, step,
                 lambda o: max(_rel(o[0], want), _rel(o[1], want_ssm)), bound),
            Case("gdn conv step in place", dtype, conv_step,
                 lambda o: max(_rel(o[0], want_y), _rel(o[1], want_conv)), CONV_BOUND[dtype])]


FP8_BOUND = {torch.float32: 6e-2, torch.float16: 6e-2, torch.bfloat16: 6e-2}   # e4m3 activations (CUDA)


def fp8_cases(size: dict, dtype, device) -> list[Case]:
    """FP8 block-scaled weights (Qwen's -FP8 releases): a Linear through ``fp8.linear`` —
    ``torch._scaled_mm`` with per-token activation scales on CUDA where blockwise scaling is
    supported, the dequantised product elsewhere — against the dequantised weight in fp32, and
    the fused MoE over FP8 experts against the grouped reference."""
    from ninfer.native.kernels import moe
    from ninfer.native.model import fp8
    from ninfer.native.model.moe import MoeWeights
    h, rows = size["hidden"], size["rows"]
    g = torch.Generator(device=device).manual_seed(13)
    r = lambda *s, std=0.05: torch.randn(*s, generator=g, device=device) * std  # noqa: E731
    w = fp8.quantize(r(2 * h, h))
    x = r(rows, h, std=1.0).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.dequantize(torch.float32))
    cuda = torch.device(device).type == "cuda"

    def lin():
        out = fp8.linear(x, w)
        return out
    e, k, inter = size["experts"], size["topk"], size["inter"]
    gu = fp8.stack([fp8.cat_rows([fp8.quantize(r(inter, h)), fp8.quantize(r(inter, h))], dtype) for _ in range(e)],
                   dtype)
    dn = fp8.stack([fp8.quantize(r(h, inter)) for _ in range(e)], dtype)
    mw = MoeWeights(router=r(e, h, std=0.5).to(dtype), gate_up=gu, down=dn, top_k=k, norm_topk_prob=True)
    xm = r(rows, h, std=1.0).to(dtype)
    mwant = moe.sparse_moe_ref(xm, mw)
    return [Case("fp8 linear" + (" (_scaled_mm if supported)" if cuda else " (dequantised)"), dtype, lin,
                 lambda o: _rel(o, want), FP8_BOUND[dtype] if cuda else 8e-3),
            Case("fused_moe fp8 experts", dtype, lambda: moe.fused_moe_triton(xm, mw), lambda o: _rel(o, mwant),
                 MOE_BOUND[dtype])]


KERNEL_GROUPS = {"paged_attention": lambda *a: attention_cases(*a), "copies": lambda *a: copy_cases(*a),
                 "norms": lambda *a: norm_cases(*a), "moe": lambda *a: moe_cases(*a), "fp8": lambda *a: fp8_cases(*a),
                 "gdn_decode": lambda *a: gdn_decode_cases(*a)}


def _time_ms(fn: Callable[[], object], device: str, reps: int) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_cases(size: str, dtype, device, groups=None) -> list:
    """The cases of every kernel group at ``size`` and ``dtype`` (a group that fails to build
    is one row with its error, so one bad group never hides the others)."""
    sz = SIZES[size]
    out = []
    for name, build in (groups or KERNEL_GROUPS).items():
        try:
            out += build(sz, dtype, device)
        except Exception as exc:  # noqa: BLE001 - reported as that group's row
            out.append({"kernel": name, "dtype": str(dtype).removeprefix("torch."), "ok": False,
                        "error": f"{type(exc).__name__}: {exc}"[:500]})
    return out


def run_case(case: Case, device: str, reps: int) -> dict:
    """One case: its error against the reference, whether within the bound, its time (CUDA)."""
    row = {"kernel": case.kernel, "dtype": str(case.dtype).removeprefix("torch.")}
    try:
        err = case.check(case.run())
        row.update(error=err, bound=case.bound, ok=err <= case.bound, ms=_time_ms(case.run, device, reps))
    except Exception as exc:  # noqa: BLE001 - one failing kernel never ends the check
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    return row


def check_kernels(device: str = "cpu", size: str = "tiny", dtypes=(torch.bfloat16, torch.float16, torch.float32),
                  reps: int = 20, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Every kernel against its reference on ``device``; one row per (kernel, dtype), 16-bit
    dtypes first (an fp32 compile is the slowest: its rows come last). ``on_row`` sees each row
    as it is made (the staged check appends it to its report at once)."""
    if torch.device(device).type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rows = []
    for dtype in dtypes:
        for case in kernel_cases(size, dtype, device):
            row = case if isinstance(case, dict) else run_case(case, device, reps)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def transfer_bandwidth(mib: int = 256, reps: int = 5) -> list[dict]:
    """Pinned Host <-> Device copy rate (GB/s), as the cost model assumes (DESIGN.md §9)."""
    if not torch.cuda.is_available():
        return []
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    out = []
    for name, dst, src in (("H2D", dev, host), ("D2H", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out.append({"copy": name, "MiB": mib, "GB_s": reps * host.numel() / (time.perf_counter() - t0) / 1e9})
    return out


MID = {"hidden_size": 2048, "num_hidden_layers": 48, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
       "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
       "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
       "intermediate_size": 5632, "num_experts": 0, "max_position_embeddings": 8192}


def make_mid_model(tiny_dir: str, out: str, sizes: dict | None = None) -> str:
    """A mid-size synthetic Qwen3-Next (hidden 2048, 48 layers at 3:1 GDN:attention, head dims
    256 / 128, dense MLP — about 1.7 B parameters, random, bf16) beside the tiny model's
    tokenizer. Dense MLP: a 512-expert MoE of this width would be tens of GB, and graphs capture
    at most ``graphs.DENSE_MOE_MAX_EXPERTS`` experts."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from ninfer.native.model.config import parse_config
    from ninfer.tiny.weights import random_tensors
    dst, src = Path(out), Path(tiny_dir)
    if (dst / "model.safetensors").exists():
        return str(dst)
    dst.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    sizes = sizes or MID
    raw.update(sizes)
    raw["layer_types"] = (sizes["layer_types"] * sizes["num_hidden_layers"])[:sizes["num_hidden_layers"]]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    save_file(random_tensors(parse_config(raw), seed=0), str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return str(dst)


def engine_check(model_dir: str, prompts: int = 4, max_tokens: int = 16, dtype: str = "float32",
                 concurrency=(1, 2, 4, 8), prefill_tokens: int = 2048, device: str = "cuda",
                 reference: bool = True, speculative: dict | None = None) -> dict:
    """The engine on CUDA with graphs on and off (``enforce_eager``): greedy tokens against
    ``reference_generate`` (recorded, not fatal: on CUDA the engine's kernels and the reference's
    torch ops round differently), the graphs' buckets, capture time and replays, decode tok/s at
    each C and prefill tok/s of one long prompt. ``reference=False`` skips the oracle (it runs
    on the CPU: too slow for the mid-size model within the check's 8 minutes); ``device="cpu"``
    is how the tests run this function (with ``NINFER_GRAPHS=replay``). ``speculative``: the
    engine's speculative config (MTP: its speculating steps replay the verify graphs)."""
    from ninfer.api import Engine
    from ninfer.benchmarks.actors import measure
    from ninfer.reference import reference_generate
    ps = [[7 + i] * (20 + 13 * i) for i in range(prompts)]
    want = None
    out = {}
    for eager in (False, True):
        key = "eager" if eager else "graphs"
        cfg = {"device": device, "max_concurrency": max(8, *concurrency), "max_context": prefill_tokens + 256,
               "prefill_chunk_tokens": 512, "enforce_eager": eager}
        if speculative:
            cfg["speculative"] = speculative
        try:
            eng = Engine.start(model_dir, config=cfg, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - reported as a finding
            out[key] = {"engine": "not started", "reason": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        try:
            hs = [eng.generate(p, max_tokens=max_tokens, ignore_eos=True) for p in ps]
            got = [h.result(300).token_ids for h in hs]
            if want is None and reference:
                want = [reference_generate(model_dir, p, max_tokens=max_tokens, ignore_eos=True, dtype=dtype)
                        for p in ps]
            rec = {"engine": "ran", "requests": prompts, "tokens": got}
            if want is not None:
                rec["requests_equal_reference"] = sum(g == w for g, w in zip(got, want))
            rec["decode_tok_s"] = {c: measure(eng, c, 64, 16)["decode_tok_s"] for c in concurrency}
            t0 = time.perf_counter()
            eng.generate([11] * prefill_tokens, max_tokens=1, ignore_eos=True).result(300)
            rec["prefill_tok_s"] = prefill_tokens / (time.perf_counter() - t0)
            rec["graphs"] = eng.stats().get("graphs")
            out[key] = rec
        except Exception as exc:  # noqa: BLE001
            out[key] = {"engine": "failed", "reason": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            eng.shutdown()
    g, e = out.get("graphs", {}), out.get("eager", {})
    if "tokens" in g and "tokens" in e:
        out["graphs_equal_eager"] = g["tokens"] == e["tokens"]
    return out
