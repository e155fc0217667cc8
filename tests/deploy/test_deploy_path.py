"""The deploy path as deploy/README.md tells a user to run it: ``deploy/start.sh`` on the tiny
model with the shipped ``deploy/engine.toml``, the official OpenAI client against it,
``ninfer.connect`` from Python, configs that stop the start with one line, and a start after a
failed (or half-started) one without ``ray stop``.

Isolation from every other Ray on this machine (tests/actors' session Ray, other checkouts):

* the Ray head is this module's own: ``ray start --head`` on a short temporary directory, on
  free ports, advertising one GPU (a CPU machine can; the worker then asks for it). TMPDIR
  points there too, so Ray's "latest cluster" file a plain ``ray.init()`` reads is private;
* the pytest process never joins that head (a process holds one Ray connection, and this one
  may hold tests/actors' Ray): everything runs in subprocesses with an explicit environment:
  RAY_ADDRESS names the head, PYTHONPATH this checkout, RAY_AUTH_MODE=disabled (a token in
  ~/.ray would switch ``ray start`` to token auth, which an explicit address does not pick up);
* teardown kills the processes the head's ``ray start`` left and their descendants, by id.
  ``ray stop`` is never run: it stops every Ray process on the machine, not just this head.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.ray, pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="process cleanup reads /proc")]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent             # the venv's python3, ray and ninfer
START = str(ROOT / "deploy" / "start.sh")

# The starter of a detached deployment dies as soon as the deployment's frontend exists: the
# start goes on without anyone waiting for it (a Ctrl-C'd or killed `ninfer serve`).
DIE_MID_START = """
import os, sys, threading, time
import ray, ninfer
threading.Thread(target=lambda: ninfer.Engine.start(sys.argv[1], config=sys.argv[2], transport="ray",
                                                    address="auto", detached=True), daemon=True).start()
while True:
    try:
        if ray.is_initialized():
            ray.get_actor("ninfer-frontend", namespace="ninfer")
            os._exit(0)
    except ValueError:
        pass
    time.sleep(0.05)
"""

# A fresh process with no address: Engine.start must join the running cluster (and find the
# deployment there) instead of failing in ray.init; then a Python client of the same deployment.
PYTHON_CLIENT = """
import sys
import ninfer
try:
    ninfer.Engine.start(sys.argv[1], transport="ray")
except ninfer.DeploymentError as exc:
    print("start refused:", exc)
engine = ninfer.connect(address=sys.argv[2])
out = engine.generate([1, 2, 3, 4, 5], max_tokens=4).result(timeout=120)
print("generated", len(out.token_ids), out.finish_reason)
engine.shutdown()
"""


class Head(NamedTuple):
    address: str
    tmp: Path

    def env(self, address: bool = True) -> dict[str, str]:
        """The environment of every subprocess: nothing Ray-related inherited from ours."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT), TMPDIR=str(self.tmp),
                   RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
        if address:
            env["RAY_ADDRESS"] = self.address
        return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group), from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def _kill_group_and_descendants(pgid: int) -> None:
    """Kill the processes of one group this test started and everything they spawned (Ray's
    raylet puts each actor worker in a session of its own)."""
    table = _process_table()
    doomed = {pid for pid, (_, group) in table.items() if group == pgid}
    frontier = set(doomed)
    while frontier:
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier} - doomed
        doomed |= frontier
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    tmp = Path(tempfile.mkdtemp(prefix="nd", dir="/tmp"))   # short: Ray's socket paths are limited
    base = Head("", tmp)
    cmd = [str(BIN / "ray"), "start", "--head", "--num-gpus=1", "--num-cpus=2", "--include-dashboard=false",
           "--disable-usage-stats", f"--temp-dir={tmp}/ray", f"--port={_free_port()}",
           f"--dashboard-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}"]
    proc = subprocess.Popen(cmd, env=base.env(address=False), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        yield Head((tmp / "ray" / "ray_current_cluster").read_text().strip(), tmp)
    finally:
        _kill_group_and_descendants(proc.pid)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory) -> str:
    """The suite's tiny model (start.sh only reads it), served as ``tiny``: a link of that name
    (the served model name is the directory's)."""
    link = tmp_path_factory.mktemp("deploy") / "tiny"
    link.symlink_to(tiny_model)
    return str(link)


class Server(NamedTuple):
    proc: subprocess.Popen
    base: str
    stdout: Path
    stderr: Path

    def err(self) -> str:
        return self.stderr.read_text()


def _start_sh(head: Head, model: str, *args: str, name: str) -> Server:
    """deploy/start.sh MODEL --port P ARGS..., its output in files (a pipe nobody reads would
    block the server)."""
    port = _free_port()
    out, err = head.tmp / f"{name}.out", head.tmp / f"{name}.err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([START, model, "--port", str(port), *args], env=head.env(), stdout=o, stderr=e,
                                start_new_session=True, cwd=ROOT)
    return Server(proc, f"http://127.0.0.1:{port}", out, err)


def _finished(server: Server, timeout: float = 240) -> tuple[int, list[str]]:
    """A start expected to fail: its exit status and stderr lines."""
    try:
        rc = server.proc.wait(timeout=timeout)
    finally:
        _stop(server)
    return rc, server.err().strip().splitlines()


def _wait_healthy(server: Server, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"the server exited {server.proc.returncode}:\n{server.err()}"
        try:
            if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no /health within {timeout} s:\n{server.err()}")


def _stop(server: Server) -> None:
    """Stop the server (the detached deployment stays, as with --address it should)."""
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(timeout=30)


def _python(head: Head, script: str, *args: str, address: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], env=head.env(address=address), cwd=head.tmp,
                          capture_output=True, text=True, timeout=240)


def _assert_one_line_error(rc: int, lines: list[str], needle: str) -> None:
    """Every stderr line is NInfer's own (no traceback, no actor log, no native dump), the last
    one the error, and the exit status non-zero."""
    shown = "\n".join(lines)                  # whole, so that a failure in CI shows the traceback
    assert rc == 2, shown
    assert lines and lines[-1].startswith("ninfer: error: ") and needle in lines[-1], shown
    assert all(line.startswith("ninfer: ") for line in lines), shown


def test_an_invalid_config_value_stops_the_start_in_one_line(head, tiny):
    bad = head.tmp / "bad.toml"
    bad.write_text("max_concurrency = 99\n")
    rc, lines = _finished(_start_sh(head, tiny, "--config", str(bad), name="invalid"))
    _assert_one_line_error(rc, lines, "max_concurrency=99 is out of range: allowed 1..8")
    assert len(lines) == 1 and str(bad) in lines[0], lines


def test_start_sh_serves_the_tiny_model_after_failed_starts(head, tiny):
    """A start that died mid-way, then one that fails in the worker, then the shipped file:
    each later start clears what the earlier left, without `ray stop`."""
    budget = head.tmp / "budget.toml"
    budget.write_text("memory_budget_bytes = 4096\n")     # passes every check but the worker's layout
    r = _python(head, DIE_MID_START, tiny, str(budget))
    assert r.returncode == 0, r.stderr

    rc, lines = _finished(_start_sh(head, tiny, "--config", str(budget), name="fails"))
    assert any("replacing the deployment 'ninfer' that a failed start left" in line for line in lines), lines
    _assert_one_line_error(rc, lines, "the layout does not fit the memory budget")

    server = _start_sh(head, tiny, name="serves")
    try:
        _wait_healthy(server)
        err = server.err()
        assert "max_context=32768 is above the model's max_position_embeddings (4096): using 4096" in err, err
        assert "replacing" not in err and "Traceback" not in err, err

        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=5, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5

        r = _python(head, PYTHON_CLIENT, tiny, head.address, address=False)
        assert r.returncode == 0, r.stderr
        assert "start refused: a deployment named 'ninfer' is already serving" in r.stdout, r.stdout
        assert "generated 4 length" in r.stdout, r.stdout
    finally:
        _stop(server)

    again = _start_sh(head, tiny, name="attaches")     # the deployment outlived its server
    try:
        _wait_healthy(again, timeout=120)
        assert "attached to the running deployment 'ninfer' (same model and engine config)" in again.err()
    finally:
        _stop(again)


BYSTANDER = """
import sys, time
import ray
ray.init(address=sys.argv[1], namespace="elsewhere", logging_level="ERROR")

@ray.remote(num_cpus=0)
class Bystander:
    def ping(self):
        return "still here"

if sys.argv[2] == "start":
    a = Bystander.options(name="bystander", lifetime="detached").remote()
    print(ray.get(a.ping.remote()))
else:
    if sys.argv[2] == "check":
        print(ray.get(ray.get_actor("bystander").ping.remote()))
    try:
        ray.get_actor("ninfer-frontend", namespace="ninfer")
        print("deployment still there")
    except ValueError:
        print("deployment gone")
    if sys.argv[2] == "check":
        ray.kill(ray.get_actor("bystander"))
"""


def test_stop_sh_removes_only_this_deployment(head, tiny):
    """deploy/stop.sh removes the named deployment's actors; another job's actor on the same
    Ray survives (no `ray stop`); a second run finds nothing to stop."""
    if "deployment gone" in _python(head, BYSTANDER, head.address, "probe").stdout:
        server = _start_sh(head, tiny, name="for-stop")     # run alone: a deployment to stop first
        try:
            _wait_healthy(server)
        finally:
            _stop(server)
    r = _python(head, BYSTANDER, head.address, "start")
    assert "still here" in r.stdout, r.stderr
    stop = subprocess.run([str(ROOT / "deploy" / "stop.sh")], env=head.env(), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert stop.returncode == 0 and "deployment 'ninfer' removed" in stop.stdout, stop.stdout + stop.stderr
    r = _python(head, BYSTANDER, head.address, "check")
    assert "still here" in r.stdout and "deployment gone" in r.stdout, r.stdout + r.stderr
    again = subprocess.run([str(ROOT / "deploy" / "stop.sh")], env=head.env(), capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert again.returncode == 0 and "no deployment named 'ninfer'" in again.stdout, again.stdout + again.stderr
