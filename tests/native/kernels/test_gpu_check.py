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
    assert {"paged_decode", "paged_prefill", "write_kv", "copy_page_prefix", "gather_slots (ssm state)"} <= names
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert all(r["ms"] is None for r in rows)          # no timings without CUDA


def test_cpu_only_parts_report_nothing_to_measure():
    assert gpu.transfer_bandwidth() == [] if not torch.cuda.is_available() else True
    assert gpu.gdn_cases(gpu.SIZES["tiny"], torch.float32, "cpu") == []


def test_runs_from_this_checkout():
    from pathlib import Path

    import ninfer
    assert Path(ninfer.__file__).resolve().parents[1] == Path(__file__).resolve().parents[3]
