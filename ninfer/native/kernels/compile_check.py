"""Offline compile check (issue 33): every Triton kernel of ``native/kernels`` compiled for sm_90
on a machine without a GPU, through the very wrappers the model calls, at the real shapes and
dtypes; each variant's registers, spills, stack and shared memory from ptxas (the triton wheel
bundles it). Fails on a spill or on shared memory past the sm_90 limit.

How it compiles without a GPU: a stand-in driver reports an sm_90 target (device 0, stream 0),
and every launch ``kernel[grid](...)`` is turned into triton's own ``warmup`` form (specialise,
compile, do not launch). So the launch configs, the constexprs, the argument specialisations
(alignment, divisibility, ``do_not_specialize``) are exactly the wrappers' — nothing here
restates them. CPU tensors stand in for device ones: only their dtype and alignment matter, and
the large ones are ``torch.empty`` (address space, never touched).

Run it as its own process (``python -m ninfer.native.kernels.compile_check``): the kernels must
be imported with ``TRITON_INTERPRET`` unset, and the driver stand-in stays in that process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

SM90_SHARED_LIMIT = 232448        # bytes of shared memory one block may use on sm_90 (227 KiB)


@dataclass(frozen=True)
class Shape:
    """A published config's kernel-relevant sizes (DESIGN.md §9)."""
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_dim: int
    experts: int = 0
    top_k: int = 0
    moe_inter: int = 0
    gdn_layers: int = 36


SHAPES = (
    Shape("Qwen3-Next-80B-A3B", 2048, 16, 2, 256, 16, 32, 128, experts=512, top_k=10, moe_inter=512, gdn_layers=36),
    Shape("Qwen3.5-35B-A3B", 2048, 16, 2, 256, 16, 32, 128, experts=256, top_k=8, moe_inter=512, gdn_layers=30),
    Shape("Qwen3.5-27B", 5120, 24, 4, 256, 16, 48, 128, gdn_layers=48),
)
MAX_CONTEXT = 32768               # the widest page table a lane's row holds (512 pages)
DECODE_ROWS = (1, 8, 64)          # a lone row (most splits), a batch, a full graph bucket (fewest)
CHUNK = 2048                      # a prefill chunk
VERIFY = 4                        # a verify row: 1 + 3 drafts


@dataclass
class Record:
    kernel: str
    case: str
    dtype: str
    n_regs: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    shared: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    compile_s: float = 0.0
    error: str = ""
    constexprs: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error and not self.spill_stores and not self.spill_loads and \
            (self.shared or 0) <= SM90_SHARED_LIMIT


class _Sm90Driver:
    """Just enough of a triton driver for ``JITFunction.run(warmup=True)``: an sm_90 target."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def is_active(self):
        return True


_PTXAS = re.compile(r"Compiling entry function '(?P<name>[^']+)'.*?(?P<stack>\d+) bytes stack frame, "
                    r"(?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads.*?Used (?P<regs>\d+) registers",
                    re.S)


class _Compiler:
    """Within ``active()``: launches compile for sm_90 instead of running; each new variant is
    recorded with what ptxas said about it."""

    def __init__(self):
        self.records: list[Record] = []
        self.case, self.dtype = "", ""
        self._seen: set = set()

    @contextlib.contextmanager
    def active(self):
        import triton
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction
        orig_run = JITFunction.run
        compiler = self

        def run(fn, *args, grid, warmup, **kwargs):
            buf = io.StringIO()
            t0 = time.perf_counter()
            rec = Record(kernel=fn.__name__, case=compiler.case, dtype=compiler.dtype)
            try:
                with contextlib.redirect_stdout(buf):
                    kernel = orig_run(fn, *args, grid=grid, warmup=True, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a kernel that does not compile is a finding
                rec.error = f"{type(exc).__name__}: {exc}"[:600]
                compiler.records.append(rec)
                return None
            key = (fn.__name__, getattr(kernel, "hash", None) or id(kernel))
            if key in compiler._seen:                 # an identical variant (already recorded)
                return kernel
            compiler._seen.add(key)
            rec.compile_s = round(time.perf_counter() - t0, 2)
            meta = kernel.metadata
            rec.shared, rec.num_warps, rec.num_stages = meta.shared, meta.num_warps, meta.num_stages
            rec.constexprs = {k: v for k, v in kwargs.items() if isinstance(v, (int, bool, str))}
            m = _PTXAS.search(buf.getvalue())
            if m:
                rec.n_regs, rec.stack = int(m["regs"]), int(m["stack"])
                rec.spill_stores, rec.spill_loads = int(m["st"]), int(m["ld"])
            else:
                rec.error = "no ptxas report (was the kernel served from a cache?)"
            compiler.records.append(rec)
            return kernel

        cache = tempfile.mkdtemp(prefix="ninfer-sm90-")
        saved = (knobs.nvidia.dump_ptxas_log, knobs.cache.dir)
        knobs.nvidia.dump_ptxas_log = True
        knobs.cache.dir = cache                      # a fresh cache: every variant meets ptxas
        before = getattr(driver, "_active", None)
        driver.set_active(_Sm90Driver())
        JITFunction.run = run
        try:
            yield self
        finally:
            JITFunction.run = orig_run
            driver._active = before                  # reset_active() would look for a real driver
            knobs.nvidia.dump_ptxas_log, knobs.cache.dir = saved
            del triton


def _calls(shape: Shape, dtype):
    """(case, thunk) pairs: every wrapper the model's kernel path calls, at ``shape``."""
    import torch

    from ninfer.native.kernels import copies, moe, norms
    from ninfer.native.kernels import paged_attention as pa
    from ninfer.native.model.moe import MoeWeights
    e = lambda *s, dt=dtype: torch.empty(*s, dtype=dt)  # noqa: E731
    lt = lambda *s: torch.zeros(*s, dtype=torch.long)  # noqa: E731
    h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
    width = MAX_CONTEXT // 64
    pages = max(DECODE_ROWS) * 8 + 64
    kc, vc = e(pages, 64, hkv, d), e(pages, 64, hkv, d)
    scale = d ** -0.5
    out = []
    for rows in DECODE_ROWS:
        splits = pa.decode_splits(width, rows, hkv)
        out.append((f"decode rows={rows} splits={splits}",
                    lambda rows=rows, splits=splits: pa.paged_decode_triton(
                        e(rows, h, d), kc, vc, lt(rows, width), lt(rows) + 1, scale, splits)))
    # another table width (an odd stride): with the widths unspecialised, no new variant
    out.append(("decode rows=3 width+1", lambda: pa.paged_decode_triton(
        e(3, h, d), kc, vc, lt(3, width + 1), lt(3) + 1, scale, pa.decode_splits(width + 1, 3, hkv))))
    cu = torch.tensor([0, CHUNK])
    out.append((f"prefill chunk={CHUNK}", lambda: pa.paged_prefill_triton(
        e(CHUNK, h, d), kc, vc, lt(1, width), cu, lt(1), scale, max_q=CHUNK)))
    n = 8
    out.append((f"verify rows={n}x{VERIFY}", lambda: pa.paged_prefill_triton(
        e(n * VERIFY, h, d), kc, vc, lt(n, width), torch.arange(0, n * VERIFY + 1, VERIFY), lt(n), scale,
        max_q=VERIFY, q_lens=lt(n) + VERIFY)))
    # copies (bit moves: the element width decides the variant)
    out.append(("write_kv T=64", lambda: copies.write_kv_triton(kc, vc, lt(64), e(64, hkv, d), e(64, hkv, d))))
    ssm = e(shape.gdn_layers, 9, shape.gdn_v_heads, shape.gdn_dim, shape.gdn_dim, dt=torch.float32)
    out.append(("gather_slots ssm", lambda: copies.gather_slots_triton(ssm, lt(8))))
    out.append(("scatter_slots ssm", lambda: copies.scatter_slots_triton(ssm, lt(8), ssm[:, :8])))
    conv = e(shape.gdn_layers, 9, 2 * shape.gdn_k_heads * shape.gdn_dim + shape.gdn_v_heads * shape.gdn_dim, 3)
    out.append(("copy_slots conv", lambda: copies.copy_slots_triton(conv, lt(1), lt(1) + 1)))
    kl = e(4, pages, 64, hkv, d)
    out.append(("copy_page_prefix", lambda: copies.copy_page_prefix_triton(kl, kl, lt(2), lt(2) + 1, lt(2) + 37)))
    # GDN decode rows in place (conv step, delta-rule step) over the layer's slots
    from ninfer.native.kernels import gdn_decode
    hk, hv, dg = shape.gdn_k_heads, shape.gdn_v_heads, shape.gdn_dim
    conv_dim = 2 * hk * dg + hv * dg
    conv1 = e(9, conv_dim, 3)
    ssm1 = e(9, hv, dg, dg, dt=torch.float32)
    out.append(("gdn conv step", lambda: gdn_decode.conv_step_triton(e(8, conv_dim), conv1, lt(8), e(conv_dim, 4))))
    out.append(("gdn delta-rule step", lambda: gdn_decode.delta_rule_step_triton(
        e(8, hk, dg), e(8, hk, dg), e(8, hv, dg), e(8, hv, dt=torch.float32), e(8, hv), ssm1, lt(8))))
    # norms: the hidden width (zero-centred), a q/k head (plain), the GDN output (gated)
    out.append((f"rms_norm hidden={shape.hidden}", lambda: norms.rms_norm_triton(
        e(64, shape.hidden), e(shape.hidden), 1e-6, True)))
    out.append((f"rms_norm head={d}", lambda: norms.rms_norm_triton(e(64 * h, d), e(d), 1e-6, False)))
    out.append((f"gated_rms_norm dv={shape.gdn_dim}", lambda: norms.gated_rms_norm_triton(
        e(64 * shape.gdn_v_heads, shape.gdn_dim), e(64 * shape.gdn_v_heads, shape.gdn_dim), e(shape.gdn_dim), 1e-6)))
    if shape.experts:
        x, inter = torch.randn(64, shape.hidden).to(dtype), shape.moe_inter
        w = MoeWeights(router=torch.randn(shape.experts, shape.hidden).to(dtype),
                       gate_up=e(shape.experts, 2 * inter, shape.hidden), down=e(shape.experts, shape.hidden, inter),
                       top_k=shape.top_k, norm_topk_prob=True, shared_gate_proj=e(inter, shape.hidden).zero_(),
                       shared_up_proj=e(inter, shape.hidden).zero_(), shared_down_proj=e(shape.hidden, inter).zero_(),
                       shared_gate=e(1, shape.hidden).zero_())
        out.append((f"fused_moe E={shape.experts} k={shape.top_k}", lambda: moe.fused_moe_triton(x, w)))
        from ninfer.native.model.fp8 import FP8, Fp8Weight, scale_shape
        q = lambda *s: Fp8Weight(torch.empty(*s, dtype=FP8), torch.empty(scale_shape(s)))  # noqa: E731
        wq = MoeWeights(router=w.router, gate_up=q(shape.experts, 2 * inter, shape.hidden),
                        down=q(shape.experts, shape.hidden, inter), top_k=shape.top_k, norm_topk_prob=True)
        out.append((f"fused_moe FP8 experts E={shape.experts}", lambda: moe.fused_moe_triton(x, wq)))
    return out


def check(shapes=SHAPES, dtypes=("bfloat16", "float32"), progress=None) -> list[Record]:
    """Compile every call of ``_calls`` for each shape and dtype; one record per new variant."""
    import torch
    c = _Compiler()
    with c.active():
        for shape in shapes:
            for name in dtypes:
                for case, call in _calls(shape, getattr(torch, name)):
                    c.case, c.dtype = f"{shape.name}: {case}", name
                    before = len(c.records)
                    call()
                    if progress:
                        for r in c.records[before:]:
                            progress(r)
    return c.records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ninfer.native.kernels.compile_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--models", default=None, help="a subset of: " + ", ".join(s.name for s in SHAPES))
    ap.add_argument("--json", default=None, metavar="FILE", help="write every record here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("run with TRITON_INTERPRET unset: interpreted kernels do not compile")
    shapes = SHAPES if not args.models else tuple(s for s in SHAPES if s.name in args.models.split(","))

    def show(r: Record) -> None:
        mark = "ok " if r.ok else "BAD"
        print(f"{mark} {r.kernel:<14} {r.dtype:<9} regs={r.n_regs} spills={r.spill_stores}/{r.spill_loads} "
              f"stack={r.stack} shared={r.shared} warps={r.num_warps} {r.compile_s:5.1f}s  {r.case} {r.error}",
              flush=True)
    t0 = time.perf_counter()
    records = check(shapes, tuple(args.dtypes.split(",")), progress=show)
    bad = [r for r in records if not r.ok]
    import triton
    print(f"{len(records)} variants compiled for sm_90 (triton {triton.__version__}) in "
          f"{time.perf_counter() - t0:.0f} s; {len(bad)} with spills, shared memory over "
          f"{SM90_SHARED_LIMIT} B or errors")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "ok": r.ok} for r in records], f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
