"""The staged GPU check's runner (issue 33) without a GPU: its time budget, one JSON line per
stage appended as the stage ends, a stage killed at its cap with its partial rows kept (its
children too), the env stage showing an import error whole, and the entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ninfer.benchmarks import gpu_runner
from ninfer.benchmarks.gpu_runner import Runner, Stage, cap_for

RUNNER = Path(gpu_runner.__file__)


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_stage_gets_its_cap_or_what_is_left_and_is_skipped_below_its_minimum():
    s = Stage("x", cap_s=100, min_s=20)
    assert cap_for(s, elapsed=0, budget=540) == 100
    assert cap_for(s, elapsed=480, budget=540) == 60
    assert cap_for(s, elapsed=500, budget=540) == 40
    assert cap_for(s, elapsed=521, budget=540) is None


def test_the_runner_spends_its_budget_in_order_and_appends_a_line_as_each_stage_ends(tmp_path):
    """Each stage's line is in the report before the next stage starts; a stage over its cap is
    recorded as a timeout with the rows it wrote; later stages get what is left, and those with
    less than their minimum are skipped, not run."""
    clock = FakeClock()
    out = tmp_path / "report.jsonl"
    stages = (Stage("env", 60, 5), Stage("a", 100, 20), Stage("b", 400, 20), Stage("c", 200, 100),
              Stage("d", 50, 10), Stage("gpu_only", 50, 5, cuda_only=True))
    seen_before, caps = {}, {}
    spend = {"env": 3, "a": 40, "b": 400, "d": 40}      # b runs into its cap

    def launch(argv, env, cap, log):
        name = argv[1]
        seen_before[name] = [r["stage"] for r in _lines(out)] if out.exists() else []
        caps[name] = cap
        partial = argv[2]
        with open(partial, "a") as f:
            f.write(json.dumps({"case": f"{name} row"}) + "\n")
            if name == "env":
                f.write(json.dumps({"cuda_available": False}) + "\n")
        clock.t += min(spend[name], cap)
        return (None if name == "b" else 0), f"{name} output"

    r = Runner(str(out), budget_s=540, stages=stages, work=str(tmp_path / "w"),
               command=lambda st, partial: ["stage", st.name, partial], launch=launch, clock=clock)
    records = r.run()
    lines = _lines(out)
    assert [x["stage"] for x in lines] == ["env", "a", "b", "c", "d", "gpu_only", "summary"]
    assert seen_before == {"env": [], "a": ["env"], "b": ["env", "a"], "d": ["env", "a", "b", "c"]}
    assert caps == {"env": 60, "a": 100, "b": 400, "d": 50}       # after b, 540 - 443 = 97 s are left
    by = {x["stage"]: x for x in lines}
    assert by["b"]["status"] == "timeout" and by["b"]["rows"] == [{"case": "b row"}]
    assert by["b"]["output_tail"] == "b output"
    assert by["c"]["status"] == "skipped" and "budget: 97 s left" in by["c"]["reason"]   # it needs 100
    assert by["d"]["status"] == "ok"
    assert by["gpu_only"]["status"] == "skipped" and by["gpu_only"]["reason"] == "needs a CUDA device"
    assert r.device == "cpu"                                    # from the env stage's row
    assert records[-1] == lines[-1] and lines[-1]["ok"] is False and lines[-1]["stages"]["b"] == "timeout"


def test_a_stage_past_its_cap_is_killed_with_its_children_and_keeps_its_rows(tmp_path):
    """A real process: it writes a row, starts a child, then hangs; at the cap both die, and
    the row it wrote comes back in its line."""
    pidfile = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import json, subprocess, sys, time
        open(sys.argv[1], "a").write(json.dumps({{"case": "before the hang", "ok": True}}) + "\\n")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        print("hanging", flush=True)
        time.sleep(120)
    """)
    out = tmp_path / "r.jsonl"
    r = Runner(str(out), budget_s=60, stages=(Stage("hang", 3, 1),), work=str(tmp_path / "w"),
               command=lambda st, partial: [sys.executable, "-c", script, partial], device="cpu")
    t0 = time.monotonic()
    r.run()
    assert time.monotonic() - t0 < 30
    (line, summary) = _lines(out)
    assert line["status"] == "timeout" and line["rows"] == [{"case": "before the hang", "ok": True}]
    assert "hanging" in line["output_tail"]
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the stage's child outlived its cap")
    assert summary["ok"] is False


def test_the_env_stage_shows_an_import_error_whole_and_runs_without_ninfer_importable(tmp_path):
    """Run by path, the env stage reports every import: a broken fla (raising inside its own
    import) is shown with its message and traceback, not swallowed, and does not fail the stage
    (GDN then runs the reference); ``fla_status`` says the same."""
    fake = tmp_path / "site" / "fla"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('fla needs triton>=9 (planted)')\n")
    out = tmp_path / "r.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run([sys.executable, str(RUNNER), "--out", str(out), "--work", str(tmp_path / "w"),
                           "--stages", "env"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line, summary) = _lines(out)
    rows = {r.get("module"): r for r in line["rows"] if "module" in r}
    assert rows["fla"]["ok"] is False and "planted" in rows["fla"]["error"]
    assert "RuntimeError" in rows["fla"]["traceback"] and "__init__.py" in rows["fla"]["traceback"]
    assert rows["torch"]["ok"] and rows["ninfer.native.kernels.paged_attention"]["ok"]
    assert Path(rows["ninfer"]["file"]).resolve().parents[1] == RUNNER.resolve().parents[2]   # this checkout
    status = [r["fla_status"] for r in line["rows"] if "fla_status" in r]
    assert status and "planted" in status[0]
    assert any("cuda_available" in r for r in line["rows"]) and summary["ok"]
    assert (tmp_path / "gpu_check.log").exists()


def test_the_shell_entry_installs_wheels_with_no_index_into_a_target_only():
    text = (RUNNER.parents[2] / "bench" / "gpu_check.sh").read_text()
    assert "--no-index --no-deps" in text and "--target /tmp/ninfer-site" in text
    assert "pip install -e" not in text and "gpu_runner.py" in text
    fetch = (RUNNER.parents[2] / "bench" / "fetch_wheels.sh").read_text()
    assert "--python-version 3.12" in fetch and "--only-binary=:all:" in fetch and "msgspec" in fetch


def test_ninfer_bench_gpu_runs_the_staged_check(tmp_path, monkeypatch):
    """`ninfer bench gpu` is the runner: its options reach it, its exit code is the run's."""
    from ninfer.cli import main
    seen = {}

    def fake_run(self):
        seen.update(out=self.out, budget=self.budget, stages=[s.name for s in self.stages], extra=self.extra)
        return [{"stage": "summary", "ok": True}]
    monkeypatch.setattr(Runner, "run", fake_run)
    rc = main(["bench", "gpu", "--out", str(tmp_path / "g.jsonl"), "--budget", "100", "--stages", "env,pinned",
               "--model", str(tmp_path)])
    assert rc == 0
    assert seen == {"out": str(tmp_path / "g.jsonl"), "budget": 100.0, "stages": ["env", "pinned"],
                    "extra": ("--model", str(tmp_path))}
