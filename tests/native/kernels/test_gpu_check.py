"""The CPU-runnable parts of `ninfer bench gpu`: its CLI entry and the kernel-vs-reference
comparisons at the tiny size under the interpreter (the GPU run itself needs CUDA)."""

from __future__ import annotations

import torch

from ninfer.benchmarks import gpu
from ninfer.benchmarks.options import BENCHES
from ninfer.cli import build_parser


def test_registered_as_a_bench():
    assert "gpu" in BENCHES
    args = build_parser().parse_args(["bench", "gpu", "--out", "x.json"])
    assert args.name == "gpu" and args.out == "x.json"


def test_tiny_kernel_checks_pass_on_cpu():
    rows = gpu.check_kernels("cpu", "tiny", dtypes=(torch.float32, torch.bfloat16))
    names = {r["kernel"].split(" x")[0] for r in rows}
    assert {"paged_decode", "paged_prefill", "write_kv", "copy_page_prefix", "gather_slots (ssm state)",
            "rms_norm (plain)", "rms_norm (zero-centred)", "gated_rms_norm", "fused_moe"} <= names
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
