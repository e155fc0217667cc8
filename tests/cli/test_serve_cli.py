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
    (("--connect", "--max-model-len", "512", "--dtype", "float32"),
     "serve --connect attaches to a running deployment, which keeps the engine config it was started with: "
     "--max-model-len, --dtype cannot apply"),
], ids=["max-num-seqs", "float16", "utilization", "tensor-parallel", "quantization", "unknown", "speculative",
        "connect-with-engine-flags"])
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


def _started(tmp_path, *args: str):
    """``ninfer serve`` with ``args`` in a child process: (base URL, process); its output in
    ``proc.log``."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", *args, "--transport", "inproc",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return f"http://127.0.0.1:{port}", proc


def _stopped(proc) -> str:
    proc.terminate()
    proc.wait(timeout=30)
    proc.log.seek(0)
    out = proc.log.read()
    proc.log.close()
    return out


def _cache_config(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        if fam.name == "vllm:cache_config_info":
            return fam.samples[0].labels
    raise AssertionError("no vllm:cache_config_info on /metrics")


def _budget_for_pages(model: str, pages: int, **fields) -> tuple[int, int]:
    """A --kv-cache-memory that holds exactly ``pages`` Main-KV pages beside the fixed parts
    (state slots, workspace) for this config, and the page count the default budget gives."""
    import torch

    from ninfer.config import EngineConfig
    from ninfer.native.layout import MAIN, resolve_layout
    from ninfer.native.model.config import load_config
    cfg, cpu = load_config(model), torch.device("cpu")
    lay = resolve_layout(cfg, EngineConfig(**fields), cpu)
    fixed = lay.state_slots * lay.state_image_bytes + lay.workspace_bytes + lay.graph_bytes
    budget = fixed + pages * lay.kv_page_bytes[MAIN]
    assert resolve_layout(cfg, EngineConfig(**fields, memory_budget_bytes=budget), cpu).main_pages == pages
    return budget, lay.main_pages


def test_vllm_style_command_line_serves(tiny_model, tmp_path):
    """`ninfer serve MODEL` with vLLM's flags: each value reaches the engine the server runs —
    what the worker solved and runs with is on /metrics (vLLM's ``cache_config_info``), on
    /v1/models and in the start-up line; every served name is a model, prefix caching is
    accepted, and the answers are the oracle's in the dtype asked for."""
    lanes = dict(max_concurrency=2, max_context=512, dtype="float64", prefill_chunk_tokens=128)
    budget, default_pages = _budget_for_pages(tiny_model, 11, **lanes)
    assert default_pages > 11                     # the budget, not the context, bounds the pool
    base, proc = _started(tmp_path, tiny_model, "--max-model-len", "512", "--max-num-seqs", "2", "--dtype",
                          "float64", "--kv-cache-memory", str(budget), "--max-num-batched-tokens", "128",
                          "--enable-prefix-caching", "--served-model-name", "tiny", "tiny-alias")
    try:
        wait_up(proc, base)
        models = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny-alias"] and models[0]["max_model_len"] == 512
        info = _cache_config(base)
        assert {k: info[k] for k in ("max_model_len", "max_num_seqs", "cache_dtype", "max_num_batched_tokens",
                                     "num_gpu_blocks", "kv_cache_memory_bytes", "block_size")} == {
            "max_model_len": "512", "max_num_seqs": "2", "cache_dtype": "float64", "max_num_batched_tokens": "128",
            "num_gpu_blocks": "11", "kv_cache_memory_bytes": str(budget), "block_size": "64"}, info
        prompt = list(range(5, 45))
        for name in ("tiny", "tiny-alias"):
            r = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            import ninfer
            assert r.json()["choices"][0]["token_ids"] == ninfer.reference_generate(
                tiny_model, prompt, max_tokens=6, dtype="float64", ignore_eos=True)
        r = httpx.post(f"{base}/v1/completions", json={"model": "other", "prompt": "hi"}, timeout=60)
        assert r.status_code == 404
    finally:
        out = _stopped(proc)
    port = base.rsplit(":", 1)[1]
    assert f"serving tiny on http://127.0.0.1:{port}/v1" in out, out
    assert (f"engine: dtype float64, max_model_len 512, max_num_seqs 2, max_num_batched_tokens 128, KV cache 11 "
            f"pages of 64 tokens") in out and f"memory budget {budget} bytes" in out, out


def test_gpu_memory_utilization_reaches_the_engine_and_the_cpu_says_what_it_uses(tiny_model, tmp_path):
    """``--gpu-memory-utilization`` lands in the config the engine runs with (vLLM's
    ``cache_config_info`` label); on the CPU, where the budget is ``--kv-cache-memory`` (1 GiB
    unless given), the server says so at start rather than ignore the flag silently."""
    import torch
    base, proc = _started(tmp_path, tiny_model, "--gpu-memory-utilization", "0.5", "--max-model-len", "512",
                          "--max-num-seqs", "2")
    try:
        wait_up(proc, base)
        info = _cache_config(base)
        assert info["gpu_memory_utilization"] == "0.5" and info["kv_cache_memory_bytes"] == "None", info
    finally:
        out = _stopped(proc)
    assert "gpu_memory_utilization 0.5" in out, out
    if not torch.cuda.is_available():
        assert ("--gpu-memory-utilization=0.5 applies to a GPU's memory: this engine runs on the CPU, where the KV "
                "budget is --kv-cache-memory") in out, out


def test_human_readable_sizes_as_vllm_reads_them():
    assert _human_int("32768") == 32768
    assert _human_int("32k") == 32000 and _human_int("32K") == 32768
    assert _human_int("8G") == 8 << 30 and _human_int("1.5m") == 1_500_000


@pytest.mark.parametrize("argv, chunk", [
    ((), "auto"),                                          # the server sized to the machine
    (("--max-num-batched-tokens", "auto"), "auto"),
    (("--max-num-batched-tokens", "2k"), 2000),
    (("--max-num-batched-tokens", "128"), 128),
], ids=["default", "auto", "human", "number"])
def test_the_server_sizes_its_chunk_unless_told(argv, chunk):
    from ninfer.cli import build_parser
    from ninfer.frontend.serve_flags import engine_config
    args = build_parser().parse_args(["serve", "m", *argv])
    assert engine_config(args).prefill_chunk_tokens == chunk


def test_a_config_file_keeps_its_chunk(tmp_path):
    from ninfer.cli import build_parser
    from ninfer.frontend.serve_flags import engine_config
    (tmp_path / "a.toml").write_text("max_concurrency = 2\n")
    (tmp_path / "b.toml").write_text("prefill_chunk_tokens = 96\n")
    for name, chunk in (("a", 256), ("b", 96)):
        args = build_parser().parse_args(["serve", "m", "--config", str(tmp_path / f"{name}.toml")])
        assert engine_config(args).prefill_chunk_tokens == chunk
