"""The CPU path (``paths.CPU``: ``BATCHED`` with the fused CPU chunk ops of ``cpu_ops``) against
the references beside it: op level ``chunk_attention`` vs ``paged_attention`` (chunks from
position 0 and over a cached prefix, across page boundaries, GQA ratios 1/2/4, scattered pages,
NaN in every slot a chunk must not read); model level, one call of decode rows and a chunk
over a cached prefix through ``paths.CPU`` and ``paths.PER_SEQUENCE`` — in float64 too, where
the fused ops must agree to rounding though the model never runs them there (``for_device``)."""

from __future__ import annotations

import pytest
import torch

from ninfer.native.model import paths
from ninfer.native.model.forward import ForwardBatch
from ninfer.native.model.attention import paged_attention
from ninfer.native.model.cpu_ops import chunk_attention
from tests.native.model.test_batched_forward import DTYPES, OP_REL, _compare, _paged_kv, prepared, rel_err


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("span", [(0, 1), (0, 64), (0, 130), (5, 1), (63, 2), (64, 70), (70, 60), (200, 129)],
                         ids=lambda s: f"start{s[0]}-len{s[1]}")
def test_chunk_attention_equals_paged_attention(dtype, heads, span):
    h, hkv = heads
    start, tq = span
    d, dt = 32, DTYPES[dtype]
    k_cache, v_cache, (table,) = _paged_kv([start + tq], hkv, d, dt, seed=start + tq + h)
    q = torch.randn(tq, h, d, generator=torch.Generator().manual_seed(2)).to(dt)
    pages = torch.tensor(table)
    got = chunk_attention(q, k_cache, v_cache, pages, start, d ** -0.5)
    ref = paged_attention(q, k_cache, v_cache, pages, start, d ** -0.5)
    assert got.dtype == dt and got.shape == q.shape
    assert torch.isfinite(got).all(), "an unwritten slot (NaN) leaked into the output"
    if dt != torch.bfloat16:
        assert rel_err(got, ref) < OP_REL[dtype]
    else:   # the fused op keeps the probabilities in fp32 where the reference rounds them to bf16:
        # both against float64 math on the same bf16 inputs, the fused op no worse
        truth = paged_attention(q.double(), k_cache.double(), v_cache.double(), pages, start, d ** -0.5)
        assert rel_err(got, truth) <= max(OP_REL[dtype], 1.25 * rel_err(ref, truth))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=lambda h: f"H{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("based", [False, True], ids=["", "bases"])
def test_decode_attention_equals_the_reference(dtype, heads, based):
    """``cpu_ops.decode_attention``: fp32 through the fused op (the reference to rounding), float64
    delegates to ``attention.decode_attention`` (equal); bf16 computes in fp32 on the same numbers —
    against float64 math on the same bf16 caches no worse than the reference. Rows of different lengths over shuffled NaN-filled pages
    (an unread slot leaking shows as NaN), with and without bases."""
    from ninfer.native.model.attention import decode_attention
    from ninfer.native.model.cpu_ops import decode_attention as fused
    h, hkv = heads
    lens, d, dt = [1, 63, 64, 65, 130], 32, DTYPES[dtype]
    k_cache, v_cache, tables = _paged_kv(lens, hkv, d, dt, seed=h + hkv)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    kv_lens = torch.tensor(lens)
    bases = torch.tensor([0, 5, 0, 64, 100]) if based else None
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(9)).to(dt)
    got = fused(q, k_cache, v_cache, table, kv_lens, d ** -0.5, bases=bases)
    ref = decode_attention(q, k_cache, v_cache, table, kv_lens, d ** -0.5, bases=bases)
    assert got.dtype == dt and got.shape == q.shape and torch.isfinite(got).all()
    if dt == torch.float64:
        assert torch.equal(got, ref)
        return
    if dt == torch.float32:
        assert rel_err(got, ref) < OP_REL[dtype]
        return
    truth = decode_attention(q.double(), k_cache.double(), v_cache.double(), table, kv_lens, d ** -0.5, bases=bases)
    assert rel_err(got, truth) <= max(OP_REL[dtype], 1.25 * rel_err(ref, truth))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_chunk", [False, True], ids=["decode-only", "with-chunk"])
@pytest.mark.parametrize("n_decode", [0, 1, 8], ids=lambda n: f"B{n}")
def test_cpu_path_equals_per_sequence(tiny_model, dtype, with_chunk, n_decode):
    if not (n_decode or with_chunk):
        pytest.skip("an empty call")
    prep = prepared(tiny_model, dtype)
    if dtype != "bfloat16":
        _compare(prep, prep.step(n_decode, with_chunk), dtype, paths.CPU)
        return
    # bf16 five layers deep is ~20 % off float64 on this random model, on either path, and the
    # fused ops round elsewhere (each is as accurate or more at op level: the tests above), which
    # five random layers amplify either way: both paths against the float64 model on the same
    # inputs, the CPU path's error of the reference's order
    truth, _ = prepared(tiny_model, "float64").run(paths.PER_SEQUENCE, prep.step(n_decode, with_chunk))
    got, _ = prep.run(paths.CPU, prep.step(n_decode, with_chunk))
    ref, _ = prep.run(paths.PER_SEQUENCE, prep.step(n_decode, with_chunk))
    assert rel_err(got.logits, truth.logits) <= 1.5 * rel_err(ref.logits, truth.logits)


def test_the_cpu_chooses_the_cpu_path_except_for_float64():
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert paths.for_device(torch.device("cpu"), dt) is paths.CPU
    assert paths.for_device(torch.device("cpu"), torch.float64) is paths.BATCHED     # the oracle's


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_dense_moe_equals_sparse_moe(tiny_model, dtype, rows):
    from ninfer.native.model.cpu_ops import dense_moe, dense_moe_fits
    from ninfer.native.model.moe import sparse_moe
    model = prepared(tiny_model, dtype).model
    w = model.layers[0].mlp
    x = torch.randn(rows, model.cfg.hidden_size, generator=torch.Generator().manual_seed(rows)).to(DTYPES[dtype])
    assert dense_moe_fits(x, w)
    got, ref = dense_moe(x, w), sparse_moe(x, w)
    assert got.dtype == x.dtype and got.shape == x.shape
    if dtype != "bfloat16":
        assert rel_err(got, ref) < OP_REL[dtype]
    else:   # both against float64 math on the same bf16 inputs and weights, the dense form no worse
        w64 = prepared(tiny_model, "float64").model.layers[0].mlp
        truth = sparse_moe(x.double(), w64)
        assert (got.double() - truth).abs().mean() <= 1.25 * (ref.double() - truth).abs().mean()


@pytest.mark.parametrize("dtype, kernel", [(d, True) for d in DTYPES] + [("float32", False)],
                         ids=[*DTYPES, "float32-no-kernel"])
@pytest.mark.parametrize("rows", [1, 65, 300, 2000])
def test_grouped_moe_equals_sparse_moe(tiny_model, dtype, kernel, rows, monkeypatch):
    """``cpu_ops.grouped_moe`` (what the CPU path runs past ``takes_dense_moe``): the shared
    expert's projections as one matmul, the routed rows added into its output — in fp32 by the
    compiled pass (``cpu_kernel.moe_routed``) or, without it, the padded batched products —
    ``sparse_moe`` to rounding; in bf16 no worse against float64 math on the same inputs and
    weights. Every layer's weights (each routes differently)."""
    from ninfer.native.model import cpu_kernel, cpu_ops
    from ninfer.native.model.moe import sparse_moe
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    model, model64 = prepared(tiny_model, dtype).model, prepared(tiny_model, "float64").model
    x = torch.randn(rows, model.cfg.hidden_size, generator=torch.Generator().manual_seed(rows)).to(DTYPES[dtype])
    for layer, layer64 in zip(model.layers, model64.layers):
        w = layer.mlp
        got, ref = cpu_ops.grouped_moe(x, w), sparse_moe(x, w)
        assert got.dtype == x.dtype and got.shape == x.shape
        if dtype != "bfloat16":
            assert rel_err(got, ref) < OP_REL[dtype]
        else:
            truth = sparse_moe(x.double(), layer64.mlp)
            assert (got.double() - truth).abs().mean() <= 1.25 * (ref.double() - truth).abs().mean()
    rows_path = paths.CPU.moe(x, model.layers[0].mlp, False)      # past the dense form's reach: this one
    if not cpu_ops.takes_dense_moe(x, model.layers[0].mlp):
        assert torch.equal(rows_path, cpu_ops.grouped_moe(x, model.layers[0].mlp))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads", [(2, 2), (2, 4), (1, 4)], ids=lambda h: f"Hk{h[0]}-Hv{h[1]}")
def test_delta_rule_step_equals_the_recurrent_rule(dtype, heads):
    from ninfer.native.model.cpu_ops import delta_rule_step
    from ninfer.native.model.gdn import recurrent_gated_delta_rule
    hk, hv = heads
    dt, g = DTYPES[dtype], torch.Generator().manual_seed(hk * 10 + hv)
    n, d = 5, 16
    q, k = (torch.randn(n, hk, d, generator=g).to(dt) for _ in range(2))
    v = torch.randn(n, hv, d, generator=g).to(dt)
    gate, beta = -torch.rand(n, hv, generator=g).to(dt), torch.rand(n, hv, generator=g).to(dt)
    state = torch.randn(n, hv, d, d, generator=g).to(torch.float64 if dt == torch.float64 else torch.float32)
    o, s = delta_rule_step(q, k, v, gate, beta, state)
    ro, rs = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], gate[:, None], beta[:, None], state)
    assert o.dtype == dt and o.shape == (n, hv, d) and s.shape == state.shape
    assert rel_err(s, rs) < OP_REL["float32" if dt == torch.bfloat16 else dtype]     # the state is fp32 in bf16
    assert rel_err(o, ro[:, 0]) < OP_REL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", [True, False], ids=["routed-kernel", "no-kernel"])
def test_grouped_moe_takes_the_kernel_or_the_padded_form_in_fp32(tiny_model, dtype, kernel, monkeypatch):
    """In fp32 the routed experts run in the compiled pass (``cpu_kernel.moe_routed``) where it is
    built, else as two batched products over zero-padded bands (``cpu_ops._experts_padded``), once
    per call; other dtypes keep the per-expert loop (a half-precision batched product builds a
    kernel per new shape on the CPU)."""
    from ninfer.native.model import cpu_kernel, cpu_ops
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    elif not cpu_kernel.available():
        pytest.skip(f"no CPU kernel: {cpu_kernel.why()}")
    calls = []
    real, real_k = cpu_ops._experts_padded, cpu_kernel.moe_routed
    monkeypatch.setattr(cpu_ops, "_experts_padded", lambda *a: calls.append(("padded", a[0].shape[0])) or real(*a))
    monkeypatch.setattr(cpu_kernel, "moe_routed", lambda *a: calls.append(("kernel", a[0].shape[0])) or real_k(*a))
    model = prepared(tiny_model, dtype).model
    x = torch.randn(300, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(DTYPES[dtype])
    cpu_ops.grouped_moe(x, model.layers[0].mlp)
    want = [("kernel" if kernel else "padded", 300)]
    assert calls == (want if dtype == "float32" else [])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("heads", [(2, 2), (2, 4), (1, 4)], ids=lambda h: f"Hk{h[0]}-Hv{h[1]}")
@pytest.mark.parametrize("tokens", [2, 16, 17, 32, 33, 63, 64, 65, 200], ids=lambda t: f"T{t}")
def test_chunk_delta_rule_equals_the_chunked_rule(dtype, heads, tokens):
    """The CPU chunk rule against ``gdn.chunk_gated_delta_rule`` in float64 on the same inputs (the
    truth: the fp32 reference in 64-token blocks is itself off by up to 1.7e-6 on these, the CPU
    rule in 32-token blocks by 4.5e-7): padded last blocks (33, 63, 65, 200), exact blocks (32,
    64), the short chunks' blocks of 16 at and past their edge (2, 16, 17), every key-to-value
    head ratio, a nonzero entering state; outputs and the final state."""
    from ninfer.native.model.cpu_ops import chunk_delta_rule
    from ninfer.native.model.gdn import chunk_gated_delta_rule
    hk, hv = heads
    dt, g = DTYPES[dtype], torch.Generator().manual_seed(tokens * 10 + hk + hv)
    d = 16
    q, k = (torch.randn(tokens, hk, d, generator=g).to(dt) for _ in range(2))
    v = torch.randn(tokens, hv, d, generator=g).to(dt)
    gate, beta = -torch.rand(tokens, hv, generator=g).to(dt), torch.rand(tokens, hv, generator=g).to(dt)
    state = torch.randn(hv, d, d, generator=g).to(torch.float64 if dt == torch.float64 else torch.float32)
    o, s = chunk_delta_rule(q, k, v, gate, beta, state)
    ro, rs = chunk_gated_delta_rule(*(x.double() for x in (q, k, v, gate, beta, state)))
    assert o.dtype == dt and o.shape == (tokens, hv, d) and s.dtype == state.dtype and s.shape == state.shape
    assert rel_err(s, rs) < OP_REL["float32" if dt == torch.bfloat16 else dtype]     # the state is fp32 in bf16
    assert rel_err(o, ro) < OP_REL[dtype]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cuts", [(1,), (5, 64), (63, 65, 128, 199), (100,)], ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("t", [200, 30], ids=["T200", "T30"])
def test_chunk_delta_rule_cuts_gives_the_state_the_first_r_tokens_leave(dtype, cuts, t):
    """The states at inner cuts from one pass: each equal to the chunked rule's final state over
    the first r tokens alone, in float64 on the same inputs (cuts inside the first block, on a
    block boundary, one short of and one past it, inside a later block); the outputs and final
    state as without cuts."""
    from ninfer.native.model.cpu_ops import chunk_delta_rule, chunk_delta_rule_cuts
    from ninfer.native.model.gdn import chunk_gated_delta_rule
    cuts = tuple(r for r in cuts if r < t) or (t // 2,)     # a 30-token chunk: blocks of 32
    dt, g = DTYPES[dtype], torch.Generator().manual_seed(sum(cuts))
    hk, hv, d = 2, 4, 16
    q, k = (torch.randn(t, hk, d, generator=g).to(dt) for _ in range(2))
    v = torch.randn(t, hv, d, generator=g).to(dt)
    gate, beta = -torch.rand(t, hv, generator=g).to(dt), torch.rand(t, hv, generator=g).to(dt)
    state = torch.randn(hv, d, d, generator=g).to(torch.float64 if dt == torch.float64 else torch.float32)
    o, s, at = chunk_delta_rule_cuts(q, k, v, gate, beta, state, cuts)
    o1, s1 = chunk_delta_rule(q, k, v, gate, beta, state)
    assert torch.equal(o, o1) and torch.equal(s, s1) and len(at) == len(cuts)
    rel = OP_REL["float32" if dt == torch.bfloat16 else dtype]
    for r, got in zip(cuts, at):
        _, ref = chunk_gated_delta_rule(*(x.double() for x in (q[:r], k[:r], v[:r], gate[:r], beta[:r], state)))
        assert got.dtype == state.dtype and got.shape == ref.shape
        assert rel_err(got, ref) < rel, r


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("zero_centered", [True, False], ids=["zero-centered", "plain"])
def test_rms_norm_equals_the_reference(dtype, zero_centered):
    from ninfer.native.model.cpu_ops import rms_norm as fused
    from ninfer.native.model.ops import rms_norm
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 3, 64, generator=g).to(DTYPES[dtype]), (0.1 * torch.randn(64, generator=g)).to(DTYPES[dtype])
    got, ref = fused(x, w, 1e-6, zero_centered), rms_norm(x, w, 1e-6, zero_centered)
    assert got.dtype == ref.dtype and rel_err(got, ref) <= OP_REL[dtype]


def test_half_precision_cpu_matmuls_run_at_bucketed_row_counts(monkeypatch):
    """A CPU bf16 / fp16 ``linear`` pads its rows to ``rows_bucket`` (oneDNN compiles a kernel per
    new row count in these dtypes; ~0.65 ms each): the product seen by ``F.linear`` has the bucket's
    rows, the caller gets its own rows, equal to the unpadded product to the dtype's rounding;
    fp32 and float64 are left as they are."""
    import torch.nn.functional as F

    from ninfer.native.model import fp8
    assert [fp8.rows_bucket(m) for m in (1, 16, 17, 64, 65, 1024, 1025, 1280, 1281)] == \
        [1, 16, 64, 64, 128, 1024, 1280, 1280, 1536]
    seen, real = [], F.linear
    monkeypatch.setattr(fp8.F, "linear", lambda x, w, b=None: (seen.append(x.shape[0]), real(x, w, b))[1])
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for m in (3, 17, 100, 1100):
            seen.clear()
            x = torch.randn(m, 32, generator=g)
            got = fp8.linear(x.to(dt), w.to(dt), b.to(dt))
            assert got.shape == (m, 24) and got.dtype == dt
            half = dt in (torch.bfloat16, torch.float16)
            assert seen == [fp8.rows_bucket(m) if half else m]
            ref = real(x.to(dt), w.to(dt), b.to(dt))
            assert rel_err(got, ref) <= (1e-2 if half else 0.0)


def _cache_copy(prep):
    return type(prep.cache)(*(t.clone() for t in (prep.cache.k, prep.cache.v, prep.cache.conv, prep.cache.ssm)))


def _forward_seqs(prep, rows):
    """``Prepared.run`` through ``forward_seqs`` (the runner's entry), on a copy of the cache."""
    cache = _cache_copy(prep)
    return prep.model.forward_seqs(rows, ForwardBatch.build(rows), cache), cache


def test_half_precision_cpu_decode_rows_run_on_the_fp32_twin(tiny_model):
    """A CPU bf16 model's decode rows run on its fp32 twin (the same weights, finer rounding
    inside): alone or beside a chunk, bit for bit the twin's rows (a decode row's arithmetic does
    not depend on its call), their logits what the LM head gives for the hidden rounded to bf16
    (what ``Memory.hidden`` keeps and a later sample reads), the chunk's rows its own call's."""
    prep = prepared(tiny_model, "bfloat16")
    model, twin = prep.model, prep.model.decode_twin
    assert twin is not None and twin.dtype == torch.float32 and prepared(tiny_model, "float32").model.decode_twin is None
    assert torch.equal(twin.layers[0].input_norm, model.layers[0].input_norm.float())
    decode = prep.step(5, False)
    mixed = prep.step(5, True)                       # the chunk in the middle of the decode rows
    chunk_at = next(i for i, r in enumerate(mixed) if len(r.token_ids) > 1)
    alone, _ = _forward_seqs(prep, decode)
    both, _ = _forward_seqs(prep, mixed)
    by_twin = twin.forward(ForwardBatch.build(decode), _cache_copy(prep), logits=False)
    assert torch.equal(alone.hidden, by_twin.hidden.to(torch.bfloat16))
    assert torch.equal(alone.logits, model.logits(alone.hidden))
    rows_of_decode = [i for i in range(len(mixed)) if i != chunk_at]
    n_chunk = len(mixed[chunk_at].token_ids)          # the chunk asks for all its logits rows
    logit_row, at = {}, 0
    for i in range(len(mixed)):
        logit_row[i] = at
        at += n_chunk if i == chunk_at else 1
    got = torch.stack([both.logits[logit_row[i]] for i in rows_of_decode])
    assert torch.equal(got, alone.logits)
    chunk_alone, _ = _forward_seqs(prep, [mixed[chunk_at]])
    assert torch.equal(both.logits[logit_row[chunk_at]:logit_row[chunk_at] + n_chunk], chunk_alone.logits)
    chunk_rows = range(chunk_at, chunk_at + n_chunk)     # every row's hidden in the call's row order
    assert torch.equal(both.all_hidden[list(chunk_rows)], chunk_alone.all_hidden)
    assert torch.equal(both.all_hidden[[r for r in range(len(both.all_hidden)) if r not in chunk_rows]],
                       alone.all_hidden)
    # a chunk's inner cuts keep their states under the chunk's index in the whole call
    import dataclasses
    cut = dataclasses.replace(mixed[chunk_at], cuts=[mixed[chunk_at].start + 7, mixed[chunk_at].start + 40])
    with_cuts = [*mixed[:chunk_at], cut, *mixed[chunk_at + 1:]]
    batch, alone_batch = ForwardBatch.build(with_cuts), ForwardBatch.build([cut])
    prep.model.forward_seqs(with_cuts, batch, _cache_copy(prep))
    prep.model.forward_seqs([cut], alone_batch, _cache_copy(prep))
    assert len(batch.cut_states) == len(alone_batch.cut_states) == len(model.cfg.linear_layers)
    for layer, alone_layer in zip(batch.cut_states, alone_batch.cut_states):
        assert list(layer) == [chunk_at]
        assert all(torch.equal(a, b) for pair, alone_pair in zip(layer[chunk_at], alone_layer[0])
                   for a, b in zip(pair, alone_pair))
    # a verify row (a draft's check) beside decode rows: its kept per-step states under its index
    verify = dataclasses.replace(decode[2], token_ids=[*decode[2].token_ids, 7, 9], logits="all", verify=True)
    with_verify = [*decode[:2], verify, *decode[3:]]
    batch, alone_batch = ForwardBatch.build(with_verify), ForwardBatch.build([verify])
    out = prep.model.forward_seqs(with_verify, batch, _cache_copy(prep))
    verify_alone = prep.model.forward_seqs([verify], alone_batch, _cache_copy(prep))
    assert torch.equal(out.logits[2:5], verify_alone.logits)
    assert torch.equal(torch.cat([out.logits[:2], out.logits[5:]]), alone.logits[[0, 1, 3, 4]])
    assert len(batch.spec_states) == len(model.cfg.linear_layers)
    for layer, alone_layer in zip(batch.spec_states, alone_batch.spec_states):
        assert list(layer) == [2] and all(torch.equal(a, b) for a, b in zip(layer[2], alone_layer[0]))
    # the twin is the CPU path's: another path set on the model runs every row itself
    ref, _ = prep.run(paths.PER_SEQUENCE, decode)
    assert not torch.equal(ref.logits, alone.logits)
