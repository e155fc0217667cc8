"""The CPU-runnable parts of the staged GPU check (`ninfer bench gpu`, bench/gpu_check.sh):
each stage's tiny form under the interpreter and the graphs' stand-in — kernels against their
references, kernels replayed bit for bit, fla's stage harness over the reference, the pinned
arena's exact size, the engine stages' verdicts — and the helpers that read registers and spills
and cap autotuners (the GPU run itself needs CUDA; the runner is tests/benchmarks/test_gpu_runner.py)."""

from __future__ import annotations

import torch

import json
import os
import sys
import types

import pytest
import triton

from ninfer.benchmarks import gpu, gpu_stages
from ninfer.benchmarks.options import BENCHES
from ninfer.cli import build_parser


@pytest.fixture(autouse=True)
def _environment_restored():
    """A stage is a process of its own, so ``gpu_stages.main`` on the CPU sets TRITON_INTERPRET and
    NINFER_GRAPHS=replay for the rest of its process; called here it is this xdist worker's, and
    left set, every later Program in the worker captured the stand-in graphs (a 10 s
    ``make_program`` in tests/native/test_auto_chunk.py, the engine tests slower too). The
    environment is put back after each test."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def test_registered_as_a_bench():
    assert "gpu" in BENCHES
    args = build_parser().parse_args(["bench", "gpu", "--out", "x.json"])
    assert args.name == "gpu" and args.out == "x.json"


def test_tiny_kernel_checks_pass_on_cpu():
    rows = gpu.check_kernels("cpu", "tiny", dtypes=(torch.float32, torch.bfloat16))
    names = {r["kernel"].split(" x")[0] for r in rows}
    assert {"paged_decode", "paged_prefill", "write_kv", "copy_page_prefix", "gather_slots (ssm state)",
            "rms_norm (plain)", "rms_norm (zero-centred)", "gated_rms_norm", "fused_moe", "fp8 linear (dequantised)",
            "fused_moe fp8 experts", "gdn delta-rule step in place", "gdn conv step in place"} <= names
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert all(r["ms"] is None for r in rows)          # no timings without CUDA


def test_cpu_only_parts_report_nothing_to_measure():
    assert gpu.transfer_bandwidth() == [] if not torch.cuda.is_available() else True
    assert gpu.gdn_cases(gpu.SIZES["tiny"], torch.float32, "cpu") == []


def test_runs_from_this_checkout():
    from pathlib import Path

    import ninfer
    assert Path(ninfer.__file__).resolve().parents[1] == Path(__file__).resolve().parents[3]


def test_the_engine_check_runs_graphs_and_eager_on_the_cpu_stand_in(tiny_model, monkeypatch):
    """The check's engine part, on the CPU with the graphs' stand-in backend: both runs start,
    equal the oracle and each other, measure decode and prefill, and the graph run replayed."""
    monkeypatch.setenv("NINFER_GRAPHS", "replay")
    out = gpu.engine_check(tiny_model, prompts=2, max_tokens=4, concurrency=(1, 2), prefill_tokens=128,
                           device="cpu")
    g, e = out["graphs"], out["eager"]
    assert g["engine"] == e["engine"] == "ran", out
    assert g["requests_equal_reference"] == e["requests_equal_reference"] == 2
    assert out["graphs_equal_eager"]
    assert g["graphs"]["replays"] > 0 and g["graphs"]["buckets"] == [1, 2, 4, 8]
    assert g["graphs"]["chunk_replays"] > 0 and [0, 512] in g["graphs"]["chunk_buckets"]
    assert e["graphs"] is None
    assert set(g["decode_tok_s"]) == {1, 2} and g["prefill_tok_s"] > 0


def test_the_engine_check_with_mtp_replays_verify_graphs(tiny_model, monkeypatch):
    monkeypatch.setenv("NINFER_GRAPHS", "replay")
    out = gpu.engine_check(tiny_model, prompts=2, max_tokens=6, concurrency=(2,), prefill_tokens=64,
                           device="cpu", speculative={"method": "mtp", "num_tokens": 2})
    assert out["graphs_equal_eager"] and out["graphs"]["requests_equal_reference"] == 2
    assert out["graphs"]["graphs"]["verify_buckets"] and out["graphs"]["graphs"]["verify_replays"] > 0


def test_the_mid_size_model_is_a_loadable_directory(tiny_model, tmp_path):
    """``make_mid_model`` with small sizes (the real ones are 1.7 B parameters): the layer
    pattern repeats 3:1, the tokenizer comes along, the model loads."""
    from ninfer.native.model.model import HybridModel
    small = {**gpu.MID, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 2, "head_dim": 32,
             "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
             "linear_value_head_dim": 16, "intermediate_size": 96}
    d = gpu.make_mid_model(tiny_model, str(tmp_path / "mid"), small)
    m = HybridModel.load(d, "float32")
    assert list(m.cfg.layer_types) == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert m.cfg.hidden_size == 64 and (tmp_path / "mid" / "tokenizer.json").exists()


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_graph_stage_replays_every_capturable_kernel_bit_exact(tmp_path):
    """The stand-in of a CUDA graph (run twice under ``no_host_reads``): every kernel the forward
    captures, in both dtypes, equal bit for bit; the page COW (a host read of its length, run
    outside graphs) is not among them."""
    partial = tmp_path / "p.jsonl"
    rc = gpu_stages.main(["kernels_graph", "--device", "cpu", "--dtypes", "bfloat16,float32", "--partial",
                          str(partial), "--work", str(tmp_path)])
    rows = [r for r in _rows(partial) if "kernel" in r]
    assert rc == 0 and all(r["ok"] and r["bit_exact"] for r in rows), rows
    names = {r["kernel"].split(" x")[0] for r in rows}
    assert {"paged_decode", "paged_prefill", "write_kv", "gather_slots (ssm state)", "rms_norm (plain)",
            "gated_rms_norm", "fused_moe", "fp8 linear (dequantised)", "fused_moe fp8 experts",
            "gdn delta-rule step in place", "gdn conv step in place"} <= names
    assert "copy_page_prefix" not in names and len(rows) == 2 * 11 + 1


def test_a_host_read_inside_a_captured_call_fails_its_graph_row():
    def reads_back():
        x = torch.ones(4)
        return x * float(x.sum())            # a sync a CUDA capture refuses

    with pytest.raises(Exception, match="captured forward"):
        gpu_stages.replay_equals_eager(reads_back, "cpu")
    assert gpu_stages.replay_equals_eager(lambda: torch.ones(4) * 2, "cpu")["bit_exact"]


def test_the_fla_stage_harness_runs_over_the_reference_on_the_cpu(tmp_path):
    """On the CPU the fla stage runs its cases (chunk, decode and verify rows, conv and conv
    step) with the torch reference standing in for fla, each also replayed; its first row is
    fla's status, whatever it is."""
    partial = tmp_path / "p.jsonl"
    rc = gpu_stages.main(["fla_real", "--device", "cpu", "--dtypes", "bfloat16,float32", "--partial",
                          str(partial), "--work", str(tmp_path)])
    rows = _rows(partial)
    assert rc == 0 and rows[0]["case"] == "fla" and rows[0]["status"]
    cases = [r for r in rows if "kernel" in r]
    assert len(cases) == 10 and all(r["ok"] and r["bit_exact"] for r in cases), cases
    assert [r["dtype"] for r in cases[:5]] == ["bfloat16"] * 5        # bf16 before fp32


def test_registers_and_spills_are_read_from_the_compiled_kernels():
    """Under the interpreter nothing is compiled (no rows); the walker finds CompiledKernels in
    a JITFunction's per-device cache, through autotune / heuristics wrappers."""
    assert gpu_stages.kernel_resources() == []
    compiled = types.SimpleNamespace(n_regs=96, n_spills=0, metadata=types.SimpleNamespace(shared=512, num_warps=4))
    jit = types.SimpleNamespace(device_caches={0: ({"k": compiled}, {}, None, None, None)})
    wrapped = types.SimpleNamespace(fn=types.SimpleNamespace(fn=jit))
    assert gpu_stages.compiled_kernels(wrapped) == [compiled]


def test_fla_autotuners_are_capped(monkeypatch):
    @triton.jit
    def _k(x, B: triton.language.constexpr):
        pass
    tuned = triton.autotune(configs=[triton.Config({"B": 2 ** i}) for i in range(8)], key=[])(_k)
    wrapped = triton.heuristics({})(tuned)
    mod = types.ModuleType("flafake.ops.x")
    mod.kernel, mod.other = wrapped, 3
    monkeypatch.setitem(sys.modules, "flafake.ops.x", mod)
    assert gpu_stages.cap_autotuners("flafake", keep=3) == 1
    assert len(tuned.configs) == 3 and gpu_stages.cap_autotuners("flafake", keep=3) == 0


def test_the_pinned_stage_on_the_cpu(tmp_path):
    partial = tmp_path / "p.jsonl"
    assert gpu_stages.main(["pinned", "--device", "cpu", "--partial", str(partial), "--work", str(tmp_path)]) == 0
    assert _rows(partial)[0]["bytes"] == 3 << 20


@pytest.mark.parametrize("kind", ["tiny", "mtp"])
def test_the_engine_stages_verdicts(kind, tiny_model, monkeypatch, tmp_path):
    """A stage row per run: ok when the engine ran (reference equality recorded), the graphs
    run equal to the eager run, and for MTP only when the verify graphs replayed."""
    ran = {"engine": "ran", "requests": 2, "requests_equal_reference": 1, "tokens": [[1]],
           "graphs": {"verify_replays": 0}}
    out = {"graphs": dict(ran), "eager": dict(ran, graphs=None), "graphs_equal_eager": True}
    monkeypatch.setattr(gpu, "engine_check", lambda *a, **k: out)
    rows = gpu_stages.Rows(None)
    ok = gpu_stages.stage_engine(rows, "cpu", str(tmp_path), tiny_model, kind)
    assert ok is (kind == "tiny")
    assert all("tokens" not in r for r in rows.rows) and rows.rows[0]["requests_equal_reference"] == 1
    out["graphs_equal_eager"] = False
    assert gpu_stages.stage_engine(gpu_stages.Rows(None), "cpu", str(tmp_path), tiny_model, kind) is False
