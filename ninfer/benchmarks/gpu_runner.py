"""The staged GPU check's runner (issue 33): one process per stage, each with its own time cap,
inside one overall budget, a JSON line per stage appended to the report as the stage ends.

Standard library only, and runnable by path (``python3 ninfer/benchmarks/gpu_runner.py``), so
that it starts and reports on the device image even where ``import ninfer`` fails (a missing
wheel): the first stage, ``env``, runs inside this file and records every import error with its
traceback. The later stages are ``python3 -m ninfer.benchmarks.gpu_stages NAME``.

    budget (540 s by default: a 15-minute device slot minus start-up, transfers and a rerun)
    ├─ env            versions, the GPU, every import (fla's error shown, not swallowed)
    ├─ kernels_small  every kernel at a small size vs its reference, CUDA_LAUNCH_BLOCKING=1,
    │                 registers and spills of each compiled kernel; bf16, fp16, then fp32
    ├─ kernels_graph  the same kernels captured in a CUDA graph and replayed: bit-exact
    ├─ engine_tiny    the tiny engine with graphs on and off: tokens vs the reference, capture, tok/s
    ├─ fla_real       fla's GDN kernels at Qwen3-Next sizes (autotuners capped), capture included
    ├─ kernels_real   our kernels at real sizes, timed
    ├─ pinned         pinned Host <-> Device GB/s, the Host arena's chunked allocation
    ├─ engine_mid     a mid-size synthetic hybrid (bf16, graphs on and off)
    ├─ mtp_verify     MTP's verify graphs (tokens equal with graphs on and off)
    └─ memcheck       compute-sanitizer memcheck over the small kernels, where it runs

A stage gets ``min(its cap, what is left)``; one with less left than its minimum is skipped
(recorded as such). A stage that runs past its cap is killed with its process group; the rows
it wrote before (each stage appends its rows to a partial file as it goes) still come back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

BUDGET_S = 540.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STDERR_TAIL = 4000


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: float                     # its own time cap
    min_s: float                     # skipped when less than this is left
    cuda_only: bool = False          # nothing to run without a GPU (recorded as skipped)
    env: dict = field(default_factory=dict)
    args: tuple = ()


STAGES = (
    Stage("env", 60, 5),
    Stage("kernels_small", 110, 20, env={"CUDA_LAUNCH_BLOCKING": "1"}),
    Stage("kernels_graph", 50, 15),
    Stage("engine_tiny", 80, 25),
    Stage("fla_real", 90, 25),
    Stage("kernels_real", 80, 20),
    Stage("pinned", 25, 8),
    Stage("engine_mid", 100, 40, cuda_only=True),
    Stage("mtp_verify", 60, 20),
    Stage("memcheck", 60, 25, cuda_only=True),
)


def cap_for(stage: Stage, elapsed: float, budget: float) -> float | None:
    """The time a stage may run now (None: too little is left for it)."""
    left = budget - elapsed
    if left < stage.min_s:
        return None
    return min(stage.cap_s, left)


def _tail(text: str, n: int = STDERR_TAIL) -> str:
    return text if len(text) <= n else "…" + text[-n:]


def _read_rows(path: str) -> list:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        rows.append({"unparsed": line[:500]})
    return rows


def _kill_group(proc: subprocess.Popen) -> None:
    """The stage and everything it started (compute-sanitizer's child, compile workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_process(argv: list[str], env: dict, cap_s: float, log) -> tuple[int | None, str]:
    """Run one stage's process in its own process group: (exit code or None on timeout, its
    output, also copied to ``log``)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=cap_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        rc = None
    if log is not None:
        log.write(out or "")
        log.flush()
    return rc, out or ""


class Runner:
    """Runs ``stages`` in order within ``budget_s``; appends one JSON line per stage to ``out``.

    ``command(stage, partial_path)`` gives a stage's argv (the default runs the real stages);
    ``clock`` and ``launch`` are injectable so the budget logic is tested without a GPU."""

    def __init__(self, out: str, budget_s: float = BUDGET_S, stages=STAGES, python: str = sys.executable,
                 work: str = "/tmp/ninfer-gpu-check", device: str = "auto",
                 command: Callable[[Stage, str], list[str]] | None = None,
                 launch: Callable[[list[str], dict, float, object], tuple[int | None, str]] = run_process,
                 clock: Callable[[], float] = time.monotonic, log_path: str | None = None, extra: tuple = ()):
        self.out, self.budget, self.stages, self.python, self.work = out, budget_s, stages, python, work
        self.device = device
        self.command = command or self._command
        self.launch, self.clock = launch, clock
        self.log_path, self.extra = log_path, tuple(extra)

    def _command(self, stage: Stage, partial: str) -> list[str]:
        if stage.name == "env":
            return [self.python, os.path.abspath(__file__), "--env-stage", partial]
        argv = [self.python, "-m", "ninfer.benchmarks.gpu_stages", stage.name, "--partial", partial,
                "--work", self.work, "--device", self.device, *stage.args, *self.extra]
        return argv

    def _env(self, stage: Stage) -> dict:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # this checkout's ninfer first (never an installed copy), then what was there (the wheels)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
        # one Triton cache for every stage: a kernel compiled by one stage is loaded by the next
        env.setdefault("TRITON_CACHE_DIR", os.path.join(self.work, "triton-cache"))
        if self.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
            env["NINFER_GRAPHS"] = "replay"
        env.update(stage.env)
        return env

    def _append(self, record: dict) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.out)), exist_ok=True)
        with open(self.out, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def run(self) -> list[dict]:
        os.makedirs(self.work, exist_ok=True)
        t0 = self.clock()
        records = []
        log = open(self.log_path, "a") if self.log_path else None
        try:
            for stage in self.stages:
                rec = self._run_stage(stage, t0, log)
                if stage.name == "env" and self.device == "auto":
                    self.device = _device_from_env(rec)
                self._append(rec)
                records.append(rec)
                _print_line(rec)
        finally:
            if log is not None:
                log.close()
        summary = {"stage": "summary", "device": self.device, "wall_s": round(self.clock() - t0, 1),
                   "budget_s": self.budget, "ok": all(r["status"] in ("ok", "skipped") for r in records),
                   "stages": {r["stage"]: r["status"] for r in records}}
        self._append(summary)
        records.append(summary)
        return records

    def _run_stage(self, stage: Stage, t0: float, log) -> dict:
        elapsed = self.clock() - t0
        rec = {"stage": stage.name, "started_s": round(elapsed, 1)}
        if stage.cuda_only and self.device == "cpu":
            return {**rec, "status": "skipped", "reason": "needs a CUDA device"}
        cap = cap_for(stage, elapsed, self.budget)
        if cap is None:
            return {**rec, "status": "skipped",
                    "reason": f"budget: {self.budget - elapsed:.0f} s left, the stage needs {stage.min_s:.0f} s"}
        partial = os.path.join(self.work, f"{stage.name}.partial.jsonl")
        if os.path.exists(partial):
            os.remove(partial)
        if log is not None:
            log.write(f"\n===== {stage.name} (cap {cap:.0f} s) =====\n")
            log.flush()
        start = self.clock()
        rc, output = self.launch(self.command(stage, partial), self._env(stage), cap, log)
        rows = _read_rows(partial)
        status = "timeout" if rc is None else "ok" if rc == 0 else "failed"
        rec.update(status=status, rc=rc, cap_s=round(cap, 1), wall_s=round(self.clock() - start, 1), rows=rows)
        if status != "ok":
            rec["output_tail"] = _tail(output)
        return rec


def _device_from_env(rec: dict) -> str:
    for row in rec.get("rows", []):
        if "cuda_available" in row:
            return "cuda" if row["cuda_available"] else "cpu"
    return "cpu"


def _print_line(rec: dict) -> None:
    bad = [r for r in rec.get("rows", []) if isinstance(r, dict) and r.get("ok") is False]
    extra = f"  ({len(bad)} rows not ok)" if bad else ""
    reason = f"  {rec['reason']}" if rec.get("reason") else ""
    print(f"[gpu-check] {rec['stage']:<14} {rec['status']:<8} {rec.get('wall_s', 0):>6} s{extra}{reason}", flush=True)


# ---- the env stage (standard library; imports tried one by one, errors kept whole) ---------
IMPORTS = ("torch", "triton", "numpy", "safetensors", "tokenizers", "jinja2", "msgspec", "einops",
           "sortedcontainers", "fla", "fla.ops.gated_delta_rule", "fla.modules.causal_conv1d",
           "ninfer", "ninfer.native.kernels.paged_attention", "ninfer.native.kernels.copies",
           "ninfer.native.kernels.norms", "ninfer.native.kernels.moe", "ninfer.native.kernels.gdn",
           "ninfer.native.graphs", "ninfer.api", "ninfer.benchmarks.gpu_stages")


OPTIONAL = ("fla", "einops")          # without them GDN runs the torch reference: reported, not fatal


def env_stage(partial: str) -> int:
    """Versions, the device, and every import the later stages need, each with its error."""
    import importlib

    def row(**kw):
        with open(partial, "a") as f:
            f.write(json.dumps(kw, default=str) + "\n")

    row(python=sys.version.split()[0], executable=sys.executable, platform=platform.platform(),
        pythonpath=os.environ.get("PYTHONPATH", ""))
    failed = False
    for name in IMPORTS:
        t = time.perf_counter()
        try:
            mod = importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - the point is to show every failure whole
            failed = failed or name.split(".")[0] not in OPTIONAL
            row(module=name, ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
            continue
        row(module=name, ok=True, version=getattr(mod, "__version__", None), file=getattr(mod, "__file__", None),
            import_s=round(time.perf_counter() - t, 2))
    try:
        import torch
        cuda = torch.cuda.is_available()
        info = {"cuda_available": cuda, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
        if cuda:
            p = torch.cuda.get_device_properties(0)
            free, total = torch.cuda.mem_get_info()
            info.update(device=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                        total_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1))
        row(**info)
    except BaseException as exc:  # noqa: BLE001
        row(cuda_available=False, error=f"{type(exc).__name__}: {exc}")
        failed = True
    try:
        from ninfer.native.kernels.gdn import fla_status
        row(fla_status=fla_status())
    except BaseException as exc:  # noqa: BLE001
        row(fla_status=f"unavailable: {type(exc).__name__}: {exc}")
    tools = {}
    for tool in ("nvidia-smi", "compute-sanitizer", "ptxas", "nvcc", "ncu"):
        tools[tool] = shutil.which(tool)
    row(tools=tools)
    if tools["nvidia-smi"]:
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            row(nvidia_smi=smi.stdout.strip() or smi.stderr.strip())
        except (OSError, subprocess.SubprocessError) as exc:
            row(nvidia_smi=f"{type(exc).__name__}: {exc}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_runner", description="The staged GPU check (bench/gpu_check.sh).")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "gpu_check.jsonl"),
                    help="the report: one JSON line per stage, appended as it ends (default $OUT/gpu_check.jsonl)")
    ap.add_argument("--log", default=None, help="every stage's output (default: beside --out, gpu_check.log)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--stages", default=None, help="comma-separated subset of: " + ",".join(s.name for s in STAGES))
    ap.add_argument("--work", default="/tmp/ninfer-gpu-check", help="scratch: models, Triton cache, partial rows")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="auto: cuda when the env stage sees one; cpu runs the tiny, interpreted forms")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="the tiny model for the engine stages (e.g. a carried models/tiny); built under --work "
                         "when missing")
    ap.add_argument("--env-stage", default=None, metavar="PARTIAL", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.env_stage:
        return env_stage(args.env_stage)
    stages = STAGES
    if args.stages:
        wanted = args.stages.split(",")
        unknown = set(wanted) - {s.name for s in STAGES}
        if unknown:
            ap.error(f"unknown stages: {sorted(unknown)}")
        stages = tuple(s for s in STAGES if s.name in wanted)
    log = args.log or os.path.join(os.path.dirname(os.path.abspath(args.out)), "gpu_check.log")
    extra = ("--model", os.path.abspath(args.model)) if args.model else ()
    records = Runner(args.out, args.budget, stages, work=args.work, device=args.device, log_path=log,
                     extra=extra).run()
    print(f"[gpu-check] report: {args.out}   log: {log}", flush=True)
    return 0 if records[-1]["ok"] else 1


if __name__ == "__main__":
    # run by path: import from the checkout, not from this file's folder
    sys.path[0] = REPO
    sys.exit(main())
