"""FP8 block-scaled checkpoints (issue 33, item 4; Qwen's -FP8 releases: e4m3 weights beside a
fp32 ``weight_scale_inv`` per 128 x 128 block): the loader keeps them FP8 (1 byte + the scales)
where the weights it forms move in whole blocks and dequantises them where they cannot, and the
model loaded from the FP8 checkpoint equals, bit for bit on the CPU through the same layers
(``paths.BATCHED``), the model loaded from the same checkpoint dequantised (``ninfer/tiny/fp8.py``
generates both) — logits in fp32 and bf16; on the default CPU path, where the plain model's
layers run their fused products (``cpu_layers``) and FP8 weights cannot stand side by side, to the
dtype's rounding — and the oracle's tokens and the engine's tokens are the same. The strict loader refuses a stray or mis-shaped scale
and an FP8 tensor without one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer.errors import ModelLoadError
from ninfer.native.model import fp8
from ninfer.native.model.model import HybridModel
from ninfer.native.model.moe import MoeWeights


@pytest.fixture(scope="module")
def fp8_pair(tiny_model, tmp_path_factory):
    from ninfer.tiny.fp8 import dequantized, make_tiny_fp8
    root = tmp_path_factory.mktemp("fp8")
    q = make_tiny_fp8(tiny_model, root / "fp8")
    return str(q), str(dequantized(q, root / "plain"))


def test_block_quantization_round_trip():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q = fp8.quantize(w)
    assert q.weight.dtype == fp8.FP8 and q.scale_inv.shape == (3, 2) == fp8.scale_shape((300, 200))
    back = q.dequantize(torch.float32)
    assert ((back - w).abs() <= w.abs() * 2 ** -3 + 1e-6).all()          # e4m3: 3 mantissa bits
    block = (slice(128, 256), slice(0, 128))
    assert torch.equal(back[block], q.weight[block].float() * q.scale_inv[1, 0])


def test_the_loader_keeps_fp8_where_blocks_move_whole(fp8_pair):
    m = HybridModel.load(fp8_pair[0], "float32")
    gdn, attn, moe_layer, dense = m.layers[0], m.layers[2], m.layers[1], m.layers[0]
    assert isinstance(gdn.mixer.in_proj_qkvz, fp8.Fp8Weight)            # 128-row head blocks permuted whole
    assert isinstance(gdn.mixer.in_proj_ba, torch.Tensor)               # 4 rows moved inside a block
    assert isinstance(attn.mixer.q_proj, fp8.Fp8Weight) and isinstance(gdn.mixer.out_proj, fp8.Fp8Weight)
    assert all(isinstance(w, fp8.Fp8Weight) for w in dense.mlp)
    mlp = moe_layer.mlp
    assert isinstance(mlp, MoeWeights) and isinstance(mlp.gate_up, fp8.Fp8Weight)
    assert mlp.gate_up.weight.shape == (4, 256, 256) and mlp.gate_up.scale_inv.shape == (4, 2, 2)
    assert isinstance(mlp.router, torch.Tensor) and mlp.router.dtype == torch.float32   # not converted
    assert isinstance(m.lm_head, torch.Tensor) and isinstance(m.mtp_tensors["mtp.fc.weight"], fp8.Fp8Weight)


def _logits(model_dir, dtype, path=None):
    from ninfer.native.model.forward import ForwardBatch, SeqInput
    m = HybridModel.load(model_dir, dtype)
    m.path = path or m.path
    cache = m.new_cache(8, 2)
    tokens = [(37 * i) % 500 + 3 for i in range(70)]
    batch = ForwardBatch.build([SeqInput(tokens, 0, [0, 1], 0, "all")])
    return m.forward(batch, cache).logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fp8_model_is_its_dequantised_twin(fp8_pair, dtype):
    from ninfer.native.model import paths
    from tests.native.model.test_batched_forward import REL, rel_err
    a, b = _logits(fp8_pair[0], dtype, paths.BATCHED), _logits(fp8_pair[1], dtype, paths.BATCHED)
    assert torch.isfinite(a).all() and torch.equal(a, b)
    # the CPU path: fused products where plain; bf16's unit of rounding is 0.8 %, five layers deep
    a, b = _logits(fp8_pair[0], dtype), _logits(fp8_pair[1], dtype)
    assert torch.isfinite(a).all() and rel_err(a, b) < {"float32": REL["float32"], "bfloat16": 5e-2}[dtype]


def test_the_oracle_and_the_engine_on_an_fp8_checkpoint(fp8_pair):
    import ninfer
    prompt = [(11 * i) % 400 + 5 for i in range(30)]
    want = ninfer.reference_generate(fp8_pair[1], prompt, max_tokens=8, ignore_eos=True, dtype="float32")
    assert ninfer.reference_generate(fp8_pair[0], prompt, max_tokens=8, ignore_eos=True, dtype="float32") == want
    eng = ninfer.Engine.start(fp8_pair[0], config={"max_concurrency": 2, "max_context": 256}, dtype="float32",
                              transport="inproc")
    try:
        assert eng.generate(prompt, max_tokens=8, ignore_eos=True).result(120).token_ids == want
    finally:
        eng.shutdown()


def test_the_plan_counts_what_the_fp8_model_holds(fp8_pair):
    from ninfer.native.plan import read_config, weight_bytes
    from tests.native.test_plan import _tensors
    raw, cfg, _ = read_config(fp8_pair[0])
    m = HybridModel.load(fp8_pair[0], "bfloat16")
    held = {id(t): t for t in _tensors([m.layers, m.embed, m.final_norm, m.lm_head, m.mtp_tensors])}
    w = weight_bytes(cfg, raw, torch.bfloat16)
    assert w.total == sum(t.numel() * t.element_size() for t in held.values())
    assert w.fp8 == sum(t.numel() for t in held.values() if t.dtype == fp8.FP8) > 0


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.2.self_attn.q_proj.weight_scale_inv"), "has no"),
    (lambda t: t.update({"model.layers.2.self_attn.q_proj.weight_scale_inv": torch.ones(3, 3)}), "has shape (3, 3)"),
    (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}), "unexpected tensor"),
])
def test_the_strict_loader_on_fp8_checkpoints(fp8_pair, tmp_path, edit, message):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(fp8_pair[0], d)
    t = load_file(str(d / "model.safetensors"))
    edit(t)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HybridModel.load(d, "float32")
    assert json.loads((d / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
