"""The CPU path's layers in fewer torch calls (``cpu_layers``, the slot-wise decode steps and norms
of ``cpu_ops``): each op equals its reference to the dtype's rounding (the model-level check is
``test_cpu_path.py::test_cpu_path_equals_per_sequence``, which runs them against the per-sequence
path), the fused weights hold no second copy of the projections, and the CPU forward runs them
— another path on the same model runs the generic layers over the same weights."""

from __future__ import annotations

import pytest
import torch

from ninfer.native.model import cpu_layers, cpu_ops, gdn, paths
from ninfer.native.model.config import LINEAR
from ninfer.native.model.forward import slot_run
from ninfer.native.model.model import HybridModel
from ninfer.native.model.moe import MoeWeights
from ninfer.native.model.ops import Rope, gated_rms_norm, rms_norm
from tests.native.model.test_batched_forward import DTYPES, OP_REL, prepared, rel_err


def _shares(part: torch.Tensor, whole: torch.Tensor) -> bool:
    return part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_projections_are_views_of_the_fused_products(tiny_model, dtype):
    """Each fused product's weight is the layer's projections side by side, and the projections
    are views of it (the model holds them once); the MoE's second product is the experts' down
    projections side by side with the shared one's. A bf16 model's fp32 twin has its own."""
    model = HybridModel.load(tiny_model, dtype)
    for m in (model, model.decode_twin or model):
        for layer in m.layers:
            f = layer.cpu
            assert f is not None and f.input_norm.dtype == torch.float32
            if layer.kind == LINEAR:
                w = layer.mixer
                assert _shares(w.in_proj_qkvz, f.mixer.in_proj) and _shares(w.in_proj_ba, f.mixer.in_proj)
                assert torch.equal(f.mixer.in_proj, torch.cat([w.in_proj_qkvz, w.in_proj_ba]))
                assert torch.equal(f.mixer.neg_a, -w.a_log.float().exp())
            else:
                w = layer.mixer
                assert all(_shares(p, f.mixer.qkv) for p in (w.q_proj, w.k_proj, w.v_proj))
                assert torch.equal(f.mixer.qkv, torch.cat([w.q_proj, w.k_proj, w.v_proj]))
                assert torch.equal(f.mixer.q_norm, 1.0 + w.q_norm.float())
            mlp = layer.mlp
            assert isinstance(mlp, MoeWeights) and f.moe is not None
            assert all(_shares(p, f.moe.first) for p in (mlp.router, mlp.gate_up, mlp.shared_gate_proj,
                                                       mlp.shared_up_proj, mlp.shared_gate))
            assert torch.equal(f.moe.first, torch.cat([mlp.router, mlp.gate_up.flatten(0, 1), mlp.shared_gate_proj,
                                                       mlp.shared_up_proj, mlp.shared_gate]))
            e, h, i = mlp.down.shape
            assert all(_shares(p, f.moe.second) for p in (mlp.down, mlp.down_cat, mlp.shared_down_proj))
            assert torch.equal(f.moe.second, torch.cat([mlp.down.permute(1, 0, 2).reshape(h, e * i),
                                                        mlp.shared_down_proj], dim=1))
    if dtype == "float32":
        w = model.layers[0].mixer                  # an in-place change to a part is the fused one's
        w.in_proj_ba.mul_(2.0)
        assert torch.equal(model.layers[0].cpu.mixer.in_proj[w.in_proj_qkvz.shape[0]:], w.in_proj_ba)


def test_only_the_cpu_path_fuses(tiny_model):
    """float64 (the oracle's ``BATCHED``) keeps its weights as loaded: no fused layers."""
    assert all(layer.cpu is None for layer in prepared(tiny_model, "float64").model.layers)


@pytest.mark.parametrize("kernel", [True, False], ids=["routed-kernel", "no-kernel"])
def test_the_cpu_forward_runs_the_fused_layers(tiny_model, monkeypatch, kernel):
    """The CPU path's forward runs ``cpu_layers`` for every layer; decode rows' MoE through the
    compiled routed-experts pass where it is built (``cpu_ops.takes_dense_moe``: faster than the
    dense form at every row count), else the dense form. With another path set on the same model,
    none of them."""
    from ninfer.native.model import cpu_kernel
    prep = prepared(tiny_model, "float32")
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    elif not cpu_kernel.available():
        pytest.skip(f"no CPU kernel: {cpu_kernel.why()}")
    calls = {"attention": 0, "gdn": 0, "dense_moe": 0, "moe_routed": 0}
    for name in calls:
        owner = cpu_kernel if name == "moe_routed" else cpu_layers
        real = getattr(owner, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(owner, name, counted)
    cfg = prep.model.cfg
    n = cfg.num_hidden_layers
    prep.run(paths.CPU, prep.step(8, False))
    assert calls == {"attention": len(cfg.attention_layers), "gdn": len(cfg.linear_layers),
                     "dense_moe": 0 if kernel else n, "moe_routed": n if kernel else 0}
    calls.update(attention=0, gdn=0, dense_moe=0, moe_routed=0)
    prep.run(paths.PER_SEQUENCE, prep.step(8, False))
    assert calls == {"attention": 0, "gdn": 0, "dense_moe": 0, "moe_routed": 0}


@pytest.mark.parametrize("slots", [[2, 3, 4], [4, 2, 3]], ids=["run", "scattered"])
def test_the_cpu_decode_rows_step_in_the_cache_view(tiny_model, monkeypatch, slots):
    """The CPU path's torch step (the chunked form's ops: no compiled kernel) gets each GDN layer's
    decode rows' run of slots (``ForwardBatch.decode_slot_run``: the states stepped in the cache's
    own view) and none where the slots are not one run; the states left are the per-sequence
    path's either way. (The compiled step steps every row in its slot, run or not:
    ``test_cpu_kernel.py``.)"""
    from ninfer.native.model.forward import SeqInput
    prep = prepared(tiny_model, "float32")
    monkeypatch.setattr(cpu_ops, "gdn_ops", lambda: cpu_ops.GdnOps)
    seen = []
    real = cpu_ops.delta_rule_step_slots
    monkeypatch.setattr(cpu_ops, "delta_rule_step_slots", lambda *a: seen.append(a[6:]) or real(*a))
    rows = [SeqInput(r.token_ids, r.start, r.page_table, slot) for r, slot in zip(prep.step(3, False), slots)]
    _, cache = prep.run(paths.CPU, rows)
    want = (slice(2, 5),) if slots == [2, 3, 4] else (None,)
    assert seen == [want] * len(prep.model.cfg.linear_layers)
    _, ref = prep.run(paths.PER_SEQUENCE, rows)
    assert rel_err(cache.ssm, ref.ssm) < 1e-5 and rel_err(cache.conv, ref.conv) < 1e-5


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_the_fused_dense_moe_equals_the_dense_form(tiny_model, dtype, rows):
    """``cpu_layers.dense_moe`` (two products) is ``cpu_ops.dense_moe`` to rounding on every
    layer's weights; in bf16 no worse against float64 math on the same inputs and weights."""
    model = HybridModel.load(tiny_model, dtype)
    if dtype == "float64":          # float64 fuses nothing: build the fused form to test the op itself
        for layer in model.layers:
            layer.cpu = cpu_layers.prepare(layer, model.cfg, torch.float64)
    x = torch.randn(rows, model.cfg.hidden_size, generator=torch.Generator().manual_seed(rows)).to(DTYPES[dtype])
    model64 = prepared(tiny_model, "float64").model
    for layer, layer64 in zip(model.layers, model64.layers):
        assert cpu_ops.dense_moe_fits(x, layer.mlp)
        got, ref = cpu_layers.dense_moe(x, layer.mlp, layer.cpu.moe), cpu_ops.dense_moe(x, layer.mlp)
        assert got.dtype == x.dtype and got.shape == x.shape
        if dtype != "bfloat16":
            assert rel_err(got, ref) < OP_REL[dtype]
        else:
            truth = cpu_ops.dense_moe(x.double(), layer64.mlp)
            assert (got.double() - truth).abs().mean() <= 1.25 * (ref.double() - truth).abs().mean()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads", [(2, 2), (2, 4), (1, 4)], ids=lambda h: f"Hk{h[0]}-Hv{h[1]}")
@pytest.mark.parametrize("slots", [[7, 0, 3, 5], [3, 4, 5, 6], [4, 5, 6, 8], [6, 5, 4, 3]],
                         ids=["scattered", "run", "almost-a-run", "descending"])
def test_the_delta_rule_step_in_slots(dtype, heads, slots):
    """``delta_rule_step_slots``: the rows' states stepped where they live — the slots named
    hold what ``delta_rule_step`` returns for them, every other slot is untouched, and the
    outputs are its outputs — whether the slots are scattered, one ascending run (stepped in
    its view of the states: ``run`` from ``forward.slot_run``), one short of a run, or a run in
    descending order."""
    hk, hv = heads
    dt, g = DTYPES[dtype], torch.Generator().manual_seed(hk * 10 + hv)
    n, d, s = 4, 16, 9
    q, k = (torch.randn(n, hk, d, generator=g).to(dt) for _ in range(2))
    v = torch.randn(n, hv, d, generator=g).to(dt)
    gate, beta = -torch.rand(n, hv, generator=g).to(dt), torch.rand(n, hv, generator=g).to(dt)
    states = torch.randn(s, hv, d, d, generator=g).to(torch.float64 if dt == torch.float64 else torch.float32)
    before, run = states.clone(), slot_run(slots)
    assert (run is not None) == (slots == [3, 4, 5, 6])
    slots = torch.tensor(slots)
    o_ref, s_ref = cpu_ops.delta_rule_step(q, k, v, gate, beta, before.index_select(0, slots))
    o = cpu_ops.delta_rule_step_slots(torch.cat([q, k], 1), v, gate, beta, states, slots, run)
    assert o.dtype == dt and torch.equal(o, o_ref)
    assert torch.equal(states.index_select(0, slots), s_ref.to(states.dtype))
    others = [i for i in range(s) if i not in slots.tolist()]
    assert torch.equal(states[others], before[others])


def test_states_stored_in_another_dtype_step_in_the_accumulation_dtype():
    """States kept in bf16 (not what a Program stores today: fp32, or float64 for a float64
    model) are stepped in fp32 and stored back rounded, even where the slots are one run (no
    step in the stored dtype's view)."""
    g = torch.Generator().manual_seed(11)
    n, hk, hv, d = 3, 2, 4, 16
    q, k = (torch.randn(n, hk, d, generator=g) for _ in range(2))
    v = torch.randn(n, hv, d, generator=g)
    gate, beta = -torch.rand(n, hv, generator=g), torch.rand(n, hv, generator=g)
    states = torch.randn(6, hv, d, d, generator=g).to(torch.bfloat16)
    before, slots = states.clone(), torch.tensor([2, 3, 4])
    o_ref, s_ref = cpu_ops.delta_rule_step(q, k, v, gate, beta, before.index_select(0, slots))
    o = cpu_ops.delta_rule_step_slots(torch.cat([q, k], 1), v, gate, beta, states, slots, slot_run([2, 3, 4]))
    assert s_ref.dtype == torch.float32 and torch.equal(o, o_ref)
    assert torch.equal(states.index_select(0, slots), s_ref.to(torch.bfloat16))
    assert torch.equal(states[[0, 1, 5]], before[[0, 1, 5]])


def test_a_slot_run_is_one_ascending_range():
    """``forward.slot_run``: the slice of slots in one ascending run (one slot included), None
    for any other order, a gap or no rows; a built batch carries its decode rows' run, a graph's
    static batch none (its slots change from replay to replay)."""
    assert slot_run([3, 4, 5]) == slice(3, 6) and slot_run([9]) == slice(9, 10)
    assert slot_run([0, 1, 2, 3]) == slice(0, 4)
    for other in ([3, 5, 6], [5, 4], [2, 2], [1, 0, 2], []):
        assert slot_run(other) is None, other
    from ninfer.native.model.forward import ForwardBatch, SeqInput

    def batch(slots, chunk=False):
        seqs = [SeqInput(token_ids=[5], start=3, page_table=[i], state_slot=s) for i, s in enumerate(slots)]
        seqs += [SeqInput(token_ids=[5, 6, 7], start=0, page_table=[9], state_slot=0)] if chunk else []
        return ForwardBatch.build(seqs)
    assert batch([2, 3, 4]).decode_slot_run == slice(2, 5)
    assert batch([2, 3, 4], chunk=True).decode_slot_run == slice(2, 5)     # the chunk's slot is not a decode row's
    assert batch([4, 2]).decode_slot_run is None and batch([]).decode_slot_run is None
    assert ForwardBatch(input_ids=None, positions=None, cu=[0], starts=[], page_tables=[], state_slots=None,
                        slot_mapping=None, logits_rows=None).decode_slot_run is None


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_conv_step_in_slots(dtype):
    """``conv_step_slots`` is ``gdn.causal_conv1d_step`` over the rows' slots: the same outputs,
    the new windows in those slots, the others untouched."""
    g, dt = torch.Generator().manual_seed(5), DTYPES[dtype]
    n, c, k = 3, 24, 4
    x, w = torch.randn(n, c, generator=g).to(dt), torch.randn(c, k, generator=g).to(dt)
    states = torch.randn(6, c, k - 1, generator=g).to(torch.float64 if dt == torch.float64 else torch.float32)
    before, slots = states.clone(), torch.tensor([4, 1, 2])
    y_ref, new_ref = gdn.causal_conv1d_step(x, before.index_select(0, slots), w)
    y = cpu_ops.conv_step_slots(x, states, slots, w)
    assert y.dtype == dt and rel_err(y, y_ref) <= OP_REL[dtype]
    assert torch.equal(states.index_select(0, slots), new_ref.to(states.dtype))
    assert torch.equal(states[[0, 3, 5]], before[[0, 3, 5]])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("zero_centered", [True, False], ids=["zero-centered", "plain"])
def test_the_norms_equal_the_references(dtype, zero_centered):
    """``scaled_norm`` with the kept scale and ``cpu_ops.gated_rms_norm``: ``ops.rms_norm`` and
    ``ops.gated_rms_norm`` to rounding, in the model's dtype."""
    g, dt = torch.Generator().manual_seed(3), DTYPES[dtype]
    x, z = (torch.randn(7, 3, 64, generator=g).to(dt) for _ in range(2))
    w = (0.1 * torch.randn(64, generator=g)).to(dt)
    acc = torch.float64 if dt == torch.float64 else torch.float32
    got = cpu_ops.scaled_norm(x, cpu_ops.norm_scale(w, acc, zero_centered), 1e-6, zero_centered)
    ref = rms_norm(x, w, 1e-6, zero_centered)
    assert got.dtype == dt and rel_err(got, ref) <= OP_REL[dtype]
    got, ref = cpu_ops.gated_rms_norm(x, z, w, 1e-6), gated_rms_norm(x, z, w, 1e-6)
    assert got.dtype == dt and rel_err(got, ref) <= OP_REL[dtype]


@pytest.mark.parametrize("rotary", [16, 64], ids=["partial", "full"])
def test_rope_in_place_is_rope_apply(rotary):
    """``cpu_layers.rope_`` rotates the first R dims of every head in place as ``Rope.apply``
    returns them, the rest untouched."""
    rope = Rope(rotary, 10000.0, torch.float32, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 17, 200, 4095]))
    x = torch.randn(5, 6, 64, generator=torch.Generator().manual_seed(1))
    want = Rope.apply(x, cos, sin)
    cpu_layers.rope_(x, cos[:, None], sin[:, None])
    assert rel_err(x, want) <= OP_REL["float32"] and torch.equal(x[..., rotary:], want[..., rotary:])



@pytest.mark.parametrize("slots", [[2, 3, 4], [4, 2, 3]], ids=["run", "scattered"])
def test_the_cpu_decode_rows_step_through_the_compiled_kernel(tiny_model, monkeypatch, slots):
    """With the compiled kernel, every GDN layer's decode rows are stepped by it, each in its slot;
    the states left are the per-sequence path's to rounding."""
    from ninfer.native.model import cpu_kernel
    from ninfer.native.model.forward import SeqInput
    if not cpu_kernel.available():
        pytest.skip(f"no CPU kernel: {cpu_kernel.why()}")
    prep = prepared(tiny_model, "float32")
    seen = []
    real = cpu_kernel.delta_rule_step_slots
    monkeypatch.setattr(cpu_kernel, "delta_rule_step_slots", lambda *a: seen.append(a[6].tolist()) or real(*a))
    rows = [SeqInput(r.token_ids, r.start, r.page_table, slot) for r, slot in zip(prep.step(3, False), slots)]
    _, cache = prep.run(paths.CPU, rows)
    assert seen == [slots] * len(prep.model.cfg.linear_layers)
    _, ref = prep.run(paths.PER_SEQUENCE, rows)
    assert rel_err(cache.ssm, ref.ssm) < 1e-5 and rel_err(cache.conv, ref.conv) < 1e-5
