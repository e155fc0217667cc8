"""The stages of the staged GPU check (``gpu_runner.py`` runs each in its own process).

``python -m ninfer.benchmarks.gpu_stages NAME --partial FILE [--device cuda|cpu] [--work DIR]``
runs one stage and appends its rows to FILE as it makes them (one JSON object per line), so a
stage killed at its cap still reports what it did. Every case is isolated: an exception is that
row's error, never the end of the stage. On CUDA the stages run at the sizes the issue names;
on the CPU each runs its tiny form (Triton interpreted, graphs through the stand-in backend,
``NINFER_GRAPHS=replay``) — what the tests run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
AUTOTUNE_CONFIGS = 3          # fla's autotuners keep this many configs (about 60 per kernel otherwise)


class Rows:
    """Appends each row to the partial file at once (and echoes a short line)."""

    def __init__(self, path: str | None):
        self.path, self.rows = path, []

    def __call__(self, **row) -> dict:
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        brief = {k: v for k, v in row.items() if k in ("kernel", "case", "dtype", "ok", "error", "ms", "GB_s")}
        print("  ", json.dumps(brief or row, default=str)[:300], flush=True)
        return row


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:800]


def _guarded(rows: Rows, name: str, fn: Callable[[], None], **extra) -> None:
    """Run one part of a stage; an exception is a row with its traceback's tail."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported, the stage goes on
        rows(case=name, ok=False, error=_err(exc), traceback=traceback.format_exc()[-2500:], **extra)


# ---- what the compiled kernels use (registers, spills, shared memory) ----------------------
def compiled_kernels(jit_fn) -> list:
    """The CompiledKernels a JITFunction (or an autotuner / heuristics wrapper around one) has
    built in this process: ``device_caches[device][0]`` is the kernel cache in triton 3.x."""
    fn, seen = jit_fn, 0
    while not hasattr(fn, "device_caches") and hasattr(fn, "fn") and seen < 4:
        fn, seen = fn.fn, seen + 1
    out = []
    for caches in getattr(fn, "device_caches", {}).values():
        cache = caches[0] if isinstance(caches, tuple) else {}
        out.extend(cache.values())
    return out


def kernel_resources(modules=None) -> list[dict]:
    """One row per compiled variant of every Triton kernel in ``modules`` (ours by default):
    registers, spilled registers, shared memory, warps, stages. Empty under the interpreter."""
    import importlib

    import triton
    names = modules or ("ninfer.native.kernels.paged_attention", "ninfer.native.kernels.copies",
                        "ninfer.native.kernels.norms", "ninfer.native.kernels.moe")
    rows = []
    for name in names:
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if not isinstance(obj, (triton.runtime.JITFunction, triton.runtime.Autotuner, triton.runtime.Heuristics)):
                continue
            for k in compiled_kernels(obj):
                meta = getattr(k, "metadata", None)
                rows.append({"kernel": f"{name.rsplit('.', 1)[-1]}.{attr}", "n_regs": getattr(k, "n_regs", None),
                             "n_spills": getattr(k, "n_spills", None), "shared": getattr(meta, "shared", None),
                             "num_warps": getattr(meta, "num_warps", None),
                             "num_stages": getattr(meta, "num_stages", None)})
    return rows


def cap_autotuners(prefix: str = "fla", keep: int = AUTOTUNE_CONFIGS) -> int:
    """Every triton autotuner in the loaded modules under ``prefix`` keeps its first ``keep``
    configs (fla tries ~60 per dtype and shape: minutes of compiles). Returns how many were cut."""
    import triton
    cut = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for obj in list(vars(mod).values()):
            fn, depth = obj, 0
            while fn is not None and depth < 4:
                if isinstance(fn, triton.runtime.Autotuner):
                    if len(fn.configs) > keep:
                        fn.configs = fn.configs[:keep]
                        cut += 1
                    break
                fn, depth = getattr(fn, "fn", None), depth + 1
    return cut


# ---- graph capture of one call -------------------------------------------------------------
def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                       b.contiguous().view(torch.uint8))


def replay_equals_eager(run: Callable[[], object], device: str) -> dict:
    """``run`` eagerly, then captured in a CUDA graph (after a warm-up on a side stream, as
    ``graphs.CudaBackend`` does) and replayed: every output bit for bit equal to the eager one.
    On the CPU the stand-in: run twice under ``no_host_reads`` (a read of a value back to the
    host inside it raises, as a capture would refuse it)."""
    eager = [t.clone() for t in _flat(run())]
    t0 = time.perf_counter()
    if torch.device(device).type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _flat(run())
        capture_s = time.perf_counter() - t0
        graph.replay()                 # a capture runs nothing: the outputs are this replay's
        torch.cuda.synchronize()
    else:
        from ninfer.native.graphs import no_host_reads
        with no_host_reads():
            captured = _flat(run())
        capture_s = time.perf_counter() - t0
        with no_host_reads():
            captured = [t.clone() for t in _flat(run())]
    same = len(captured) == len(eager) and all(_bits_equal(a, b) for a, b in zip(captured, eager))
    return {"bit_exact": same, "capture_s": round(capture_s, 3)}


# ---- the stages -----------------------------------------------------------------------------
def _dtypes(names: str) -> list[torch.dtype]:
    return [DTYPES[n] for n in names.split(",") if n]


def stage_kernels(rows: Rows, device: str, size: str, dtypes: list, reps: int) -> bool:
    from ninfer.benchmarks import gpu
    ok = True
    for dtype in dtypes:                                   # bf16 first: an fp32 compile is the slowest
        t0 = time.perf_counter()
        for case in gpu.kernel_cases(size, dtype, device):
            row = case if isinstance(case, dict) else gpu.run_case(case, device, reps)
            ok &= bool(row.get("ok"))
            rows(**row, size=size)
        rows(case=f"{str(dtype).removeprefix('torch.')} done", wall_s=round(time.perf_counter() - t0, 1))
    from ninfer.native.model.fp8 import SCALED_MM
    rows(case="fp8 linear path", scaled_mm=SCALED_MM["ok"],
         meaning="True: torch._scaled_mm blockwise ran; False: refused (see the log), dequantised; None: not tried")
    for res in kernel_resources():
        res["ok"] = not res["n_spills"]
        ok &= res["ok"]
        rows(**res)
    return ok


def stage_kernels_graph(rows: Rows, device: str, size: str, dtypes: list) -> bool:
    from ninfer.benchmarks import gpu
    ok = True
    for dtype in dtypes:
        for case in gpu.kernel_cases(size, dtype, device):
            if isinstance(case, dict) or not case.graph:
                continue
            row = {"kernel": case.kernel, "dtype": str(dtype).removeprefix("torch.")}
            try:
                res = replay_equals_eager(case.run, device)
                row.update(res, ok=res["bit_exact"])
            except Exception as exc:  # noqa: BLE001
                row.update(ok=False, error=_err(exc))
            ok &= row["ok"]
            rows(**row)
    return ok


def stage_fla(rows: Rows, device: str, size: str, dtypes: list) -> bool:
    """fla's GDN kernels (autotuners capped) at ``size`` against the references, each also
    captured and replayed. Without fla: its import error, and on the CPU the harness over the
    reference (``ops`` = the torch module)."""
    from ninfer.benchmarks import gpu
    from ninfer.native.kernels import gdn
    status = gdn.fla_status()
    cuda = torch.device(device).type == "cuda"
    rows(case="fla", status=status, ok=status == "ok" or not cuda)
    if status != "ok" and cuda:
        return False
    ops, prefix = (gpu.FlaOps, "fla") if cuda else (gdn, "reference")
    if cuda:
        import fla.modules.causal_conv1d  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
        rows(case="autotuners capped", cut=cap_autotuners("fla"), keep=AUTOTUNE_CONFIGS)
    ok = True
    for dtype in dtypes:
        for case in gpu.gdn_cases(gpu.SIZES[size], dtype, device, ops=ops, prefix=prefix):
            row = gpu.run_case(case, device, reps=5)
            if row.get("ok"):
                try:
                    row.update(replay_equals_eager(case.run, device))
                    row["ok"] = row["bit_exact"]
                except Exception as exc:  # noqa: BLE001
                    row.update(ok=False, capture_error=_err(exc))
            ok &= bool(row.get("ok"))
            rows(**row, size=size)
    return ok


def stage_pinned(rows: Rows, device: str) -> bool:
    """Pinned copy rates (the cost model's figures, DESIGN.md §9) from the caching allocator's
    pinned memory and from the Host arena's own backing (registered pages, exact size)."""
    from ninfer.native.memory import host_backing
    if torch.device(device).type != "cuda":
        t = host_backing(3 << 20, pin=False)
        rows(case="host_backing (cpu)", bytes=t.numel(), ok=t.numel() == 3 << 20)
        return True
    from ninfer.benchmarks.gpu import transfer_bandwidth
    for r in transfer_bandwidth(256):
        rows(case="caching-allocator pinned", **r)
    size = (1 << 30) + (1 << 29) + 12345            # not a power of two: the arena's own form
    t0 = time.perf_counter()
    arena = host_backing(size, pin=True)
    alloc_s = time.perf_counter() - t0
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    rows(case="arena backing", bytes=size, is_pinned=arena.is_pinned(), alloc_s=round(alloc_s, 3),
         host_allocator_reserved=stats.get("reserved_bytes.current", stats.get("allocated_bytes.current")),
         ok=arena.is_pinned())
    dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for name, dst, src in (("H2D", dev, arena[:dev.numel()]), ("D2H", arena[:dev.numel()], dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rows(case="arena", copy=name, MiB=256, GB_s=5 * dev.numel() / (time.perf_counter() - t0) / 1e9)
    return True


def _tiny(work: str, model: str | None) -> str:
    """The tiny model: ``model`` (a carried ``models/tiny``) when given, else built under
    ``work`` — into a temporary folder renamed when complete, so a stage killed mid-build never
    leaves a half-written model for the next one."""
    if model and os.path.isfile(os.path.join(model, "config.json")):
        return model
    path = os.path.join(work, "tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        import shutil

        from ninfer.tiny.build import make_tiny_model
        tmp = f"{path}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    return path


def stage_engine(rows: Rows, device: str, work: str, model: str | None, kind: str) -> bool:
    from ninfer.benchmarks import gpu
    cuda = torch.device(device).type == "cuda"
    tiny = _tiny(work, model)
    if kind == "tiny":
        kw = dict(dtype="float32") if cuda else dict(prompts=2, max_tokens=4, concurrency=(1, 2),
                                                     prefill_tokens=128)
        out = gpu.engine_check(tiny, device=device, **kw)
    elif kind == "mtp":
        kw = dict(dtype="float32") if cuda else dict(prompts=2, max_tokens=6, concurrency=(2,), prefill_tokens=64)
        out = gpu.engine_check(tiny, device=device, speculative={"method": "mtp", "num_tokens": 3}, **kw)
    else:
        mid = gpu.make_mid_model(tiny, os.path.join(work, "mid-qwen3-next"))
        out = gpu.engine_check(mid, dtype="bfloat16", max_tokens=8, prompts=2, reference=False, device=device)
    ok = True
    for key in ("graphs", "eager"):
        rec = dict(out.get(key, {}))
        rec.pop("tokens", None)
        # tokens against the reference are recorded, not required: on CUDA the kernels and the
        # reference's torch ops round differently; graphs against eager must be equal
        good = rec.get("engine") == "ran"
        if kind == "mtp" and key == "graphs":
            good = good and bool((rec.get("graphs") or {}).get("verify_replays"))
        ok &= good
        rows(case=f"engine {kind} {key}", ok=good, **rec)
    if "graphs_equal_eager" in out:
        ok &= bool(out["graphs_equal_eager"])
        rows(case=f"engine {kind} graphs == eager", ok=bool(out["graphs_equal_eager"]))
    return ok


def stage(name: str, rows: Rows, device: str, work: str, model: str | None, dtypes: list) -> bool:
    cuda = torch.device(device).type == "cuda"
    if name == "kernels_small":
        return stage_kernels(rows, device, "small" if cuda else "tiny", dtypes, reps=3)
    if name == "kernels_graph":
        return stage_kernels_graph(rows, device, "small" if cuda else "tiny", dtypes)
    if name == "kernels_real":
        return stage_kernels(rows, device, "full" if cuda else "tiny",
                             [d for d in dtypes if d != torch.float16] if cuda else [torch.float32], reps=10)
    if name == "fla_real":
        return stage_fla(rows, device, "full" if cuda else "tiny", [d for d in dtypes if d != torch.float16])
    if name == "pinned":
        return stage_pinned(rows, device)
    if name == "engine_tiny":
        return stage_engine(rows, device, work, model, "tiny")
    if name == "mtp_verify":
        return stage_engine(rows, device, work, model, "mtp")
    if name == "engine_mid":
        return stage_engine(rows, device, work, model, "mid")
    raise SystemExit(f"unknown stage {name!r}")


STAGE_NAMES = ("kernels_small", "kernels_graph", "engine_tiny", "fla_real", "kernels_real", "pinned",
               "engine_mid", "mtp_verify")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_stages")
    ap.add_argument("name", choices=[*STAGE_NAMES, "memcheck"])
    ap.add_argument("--partial", default=None, help="append each row here as a JSON line")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--work", default="/tmp/ninfer-gpu-check")
    ap.add_argument("--model", default=None, help="the tiny model directory (default: built under --work)")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32", help="in this order")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("NINFER_GRAPHS", "replay")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    rows = Rows(args.partial)
    if args.name == "memcheck":
        return memcheck(rows, args)
    t0 = time.perf_counter()
    ok = False
    try:
        ok = stage(args.name, rows, device, args.work, args.model, _dtypes(args.dtypes))
    except Exception as exc:  # noqa: BLE001 - the stage's own failure, with its traceback
        rows(case=args.name, ok=False, error=_err(exc), traceback=traceback.format_exc()[-3000:])
    rows(case="stage end", ok=ok, wall_s=round(time.perf_counter() - t0, 1), device=device)
    return 0 if ok else 1


def memcheck(rows: Rows, args) -> int:
    """compute-sanitizer's memcheck over the small bf16 kernels (one process under it)."""
    import shutil
    import subprocess
    tool = shutil.which("compute-sanitizer")
    if tool is None or not torch.cuda.is_available():
        rows(case="memcheck", ok=True, skipped="compute-sanitizer not on PATH" if tool is None else "no CUDA device")
        return 0
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "9", "--target-processes", "all",
           sys.executable, "-m", "ninfer.benchmarks.gpu_stages", "kernels_small", "--device", "cuda",
           "--dtypes", "bfloat16", "--work", args.work]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "=========" in line and "ERROR SUMMARY" not in line][:40]
    summary = [line for line in out.splitlines() if "ERROR SUMMARY" in line]
    rows(case="memcheck kernels_small bf16", rc=proc.returncode, ok=proc.returncode == 0,
         wall_s=round(time.perf_counter() - t0, 1), summary=summary, findings=errors, tail=out[-2000:])
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
