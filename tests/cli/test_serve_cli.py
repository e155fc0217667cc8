"""`ninfer serve` as a vLLM user types it: the model as a positional argument, vLLM's common
flags, one line for what NInfer does not take, the port checked before the model loads, an
unreachable cluster address refused within 30 s."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ninfer.frontend.serve_flags import _human_int
from tests.serving import free_port, wait_up


def _serve(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return r, time.monotonic() - t0


def _one_line(r: subprocess.CompletedProcess, needle: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("ninfer: error: "), r.stderr
    assert needle in lines[0], lines[0]
    assert "serving" not in r.stdout                      # nothing was loaded, nothing served
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    (("--max-num-seqs", "16"), "--max-num-seqs=16 is out of range: allowed 1..8. NInfer's max_concurrency is its C "
                               "execution lanes"),
    (("--dtype", "float16"), "--dtype=float16 is not supported: use bfloat16"),
    (("--gpu-memory-utilization", "1.5"), "--gpu-memory-utilization=1.5 is out of range"),
    (("--tensor-parallel-size", "2"), "--tensor-parallel-size is a vLLM flag NInfer does not take: NInfer serves "
                                      "one model on one GPU"),
    (("--quantization=fp8",), "--quantization is a vLLM flag NInfer does not take"),
    (("--no-such-flag",), "unrecognized argument '--no-such-flag'"),
    (("--speculative-config", "{nope"), "--speculative-config: not JSON"),
], ids=["max-num-seqs", "float16", "utilization", "tensor-parallel", "quantization", "unknown", "speculative"])
def test_vllm_flags_out_of_range_or_not_taken_are_one_line(tiny_model, args, needle):
    r, _ = _serve(tiny_model, "--transport", "inproc", "--port", str(free_port()), *args)
    _one_line(r, needle)


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_an_invalid_port_is_refused(tiny_model, port):
    r, _ = _serve(tiny_model, "--port", port)
    assert r.returncode == 2 and "--port" in r.stderr and "serving" not in r.stdout, r.stderr


def test_a_port_in_use_is_found_before_the_model_loads(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r, took = _serve(tiny_model, "--transport", "inproc", "--port", str(port))
    _one_line(r, f"cannot listen on 127.0.0.1:{port}: the port is in use")
    assert took < 20, took                          # no model load before it (that is what takes long)


def test_an_address_where_no_cluster_answers_fails_within_30_s(tiny_model):
    with socket.socket() as closed:                 # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    r, took = _serve(tiny_model, "--address", f"127.0.0.1:{port}", "--port", str(free_port()), timeout=60)
    _one_line(r, "no Ray cluster answers at")
    assert took < 30, took


def test_vllm_style_command_line_serves(tiny_model, tmp_path):
    """`ninfer serve MODEL` with vLLM's flags: the values reach the engine, every served name
    is a model, prefix caching is accepted."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", tiny_model, "--transport", "inproc",
                             "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "2", "--dtype",
                             "float32", "--kv-cache-memory", "256M", "--max-num-batched-tokens", "128",
                             "--enable-prefix-caching", "--served-model-name", "tiny", "tiny-alias"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base)
        models = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny-alias"] and models[0]["max_model_len"] == 512
        for name in ("tiny", "tiny-alias"):
            r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v1/completions", json={"model": "other", "prompt": "hi"}, timeout=60)
        assert r.status_code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.seek(0)
        out = log.read()
        log.close()
    assert f"serving tiny on http://127.0.0.1:{port}/v1" in out, out


def test_human_readable_sizes_as_vllm_reads_them():
    assert _human_int("32768") == 32768
    assert _human_int("32k") == 32000 and _human_int("32K") == 32768
    assert _human_int("8G") == 8 << 30 and _human_int("1.5m") == 1_500_000
