"""The compiled GDN chunk rule (``cpu_kernel``): the reference's results to fp32 rounding, the
states at inner cuts, a prompt cut anywhere giving the same bits, and the chunked form kept where
the kernel cannot be built or is switched off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.native.model import cpu_kernel, cpu_ops, gdn, paths

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason=f"no CPU kernel: {cpu_kernel.why()}")


def _inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 64, dv: int = 64, seed: int = 0, decay: float = 0.5,
            dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * decay
    beta = torch.rand(t, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
    return [x.to(dtype) for x in (q, k, v, g, beta, s0)]


def _reference(q, k, v, g, beta, s0):
    """The float64 chunked form (the oracle's)."""
    return gdn.chunk_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta, s0)))


@pytest.mark.parametrize("t", [1, 2, 15, 16, 17, 64, 300])
@pytest.mark.parametrize("heads", [(2, 4), (4, 4), (1, 2)])
@pytest.mark.parametrize("dv", [64, 128, 48])       # the two constant widths and one taken at run time
def test_the_kernel_matches_the_float64_reference(t, heads, dv):
    q, k, v, g, beta, s0 = _inputs(t, *heads, dv=dv, seed=t)
    o, s = cpu_kernel.delta_rule(q, k, v, g, beta, s0)
    ro, rs = _reference(q, k, v, g, beta, s0)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert o.shape == ro.shape and s.shape == rs.shape
    torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(s.double(), rs, rtol=1e-5, atol=2e-6)
    # no worse than the chunked form it replaces
    co, cs = cpu_ops.chunk_delta_rule(q, k, v, g, beta, s0)
    assert (o.double() - ro).abs().max() <= 4 * (co.double() - ro).abs().max() + 1e-7


def test_a_key_width_not_a_multiple_of_16_matches_the_reference():
    """|k|, |q| and k . q sum 16 lanes then the rest: a key width of 40 (two full lanes and 8
    left) is the reference's to rounding."""
    q, k, v, g, beta, s0 = _inputs(50, dk=40, seed=22)
    o, s = cpu_kernel.delta_rule(q, k, v, g, beta, s0)
    ro, rs = _reference(q, k, v, g, beta, s0)
    torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(s.double(), rs, rtol=1e-5, atol=2e-6)


def test_strong_decay_and_a_long_chunk():
    q, k, v, g, beta, s0 = _inputs(700, decay=8.0, seed=3)
    o, s = cpu_kernel.delta_rule(q, k, v, g, beta, s0)
    ro, rs = _reference(q, k, v, g, beta, s0)
    torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(s.double(), rs, rtol=1e-5, atol=2e-6)


def test_the_states_at_cuts_are_the_states_of_the_prefixes():
    q, k, v, g, beta, s0 = _inputs(97, seed=5)
    cuts = [1, 31, 32, 33, 96, 97]
    o, s, kept = cpu_kernel.delta_rule_cuts(q, k, v, g, beta, s0, cuts)
    assert len(kept) == len(cuts)
    for r, state in zip(cuts, kept):
        _, rs = _reference(q[:r], k[:r], v[:r], g[:r], beta[:r], s0)
        torch.testing.assert_close(state.double(), rs, rtol=1e-5, atol=2e-6)
    assert torch.equal(kept[-1], s)             # a cut at the end is the final state
    o2, s2, none = cpu_kernel.delta_rule_cuts(q, k, v, g, beta, s0, ())
    assert none == [] and torch.equal(o, o2) and torch.equal(s, s2)    # cuts change no output


@settings(max_examples=25, deadline=None)
@given(t=st.integers(2, 120), data=st.data())
def test_a_chunk_cut_anywhere_gives_the_same_bits(t, data):
    """A token's arithmetic depends only on the state before it: the same tokens in one call or
    in two, the second from the first's final state, give equal outputs and states bit for bit —
    and the state kept at a cut is the state the shorter call returns."""
    r = data.draw(st.integers(1, t - 1))
    q, k, v, g, beta, s0 = _inputs(t, seed=t)
    whole, s, (at_r,) = cpu_kernel.delta_rule_cuts(q, k, v, g, beta, s0, [r])
    first, s_r = cpu_kernel.delta_rule(q[:r], k[:r], v[:r], g[:r], beta[:r], s0)
    second, s_t = cpu_kernel.delta_rule(q[r:], k[r:], v[r:], g[r:], beta[r:], s_r)
    assert torch.equal(at_r, s_r)
    assert torch.equal(whole, torch.cat([first, second]))
    assert torch.equal(s, s_t)


def test_half_precision_inputs_give_outputs_in_their_dtype_and_an_fp32_state():
    q, k, v, g, beta, s0 = _inputs(40, seed=9, dtype=torch.bfloat16)
    o, s = cpu_kernel.delta_rule(q, k, v, g, beta, s0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    ro, rs = _reference(q, k, v, g, beta, s0)
    torch.testing.assert_close(s.double(), rs, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(o.double(), ro, rtol=1e-2, atol=1e-2)


def test_the_inputs_are_not_changed():
    args = _inputs(33, seed=2)
    before = [a.clone() for a in args]
    cpu_kernel.delta_rule_cuts(*args, [7])
    assert all(torch.equal(a, b) for a, b in zip(args, before))


def test_value_heads_not_a_multiple_of_key_heads_are_refused():
    q, k, v, g, beta, s0 = _inputs(4, hk=3, hv=4)
    with pytest.raises(ValueError, match="unsupported shapes"):
        cpu_kernel.delta_rule(q, k, v, g, beta, s0)


def test_the_cpu_path_uses_the_kernel_for_fp32_math_and_the_chunked_form_for_float64():
    assert paths.CPU._gdn_ops() is cpu_ops.KernelGdnOps
    for dtype, same_as in ((torch.float32, cpu_kernel.delta_rule_cuts), (torch.float64, cpu_ops.chunk_delta_rule_cuts)):
        args = _inputs(20, seed=4, dtype=dtype)
        got = cpu_ops.KernelGdnOps.chunk_delta_rule_cuts(*args, [5])
        want = same_as(*args, [5])
        assert all(torch.equal(a, b) for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]))


@pytest.fixture
def fresh_kernel(monkeypatch):
    cpu_kernel._reset_for_tests()
    yield monkeypatch
    monkeypatch.undo()
    cpu_kernel._reset_for_tests()


def test_switched_off_the_cpu_path_keeps_the_chunked_form(fresh_kernel):
    fresh_kernel.setenv(cpu_kernel.ENV, "0")
    assert not cpu_kernel.available()
    assert cpu_kernel.why() == f"{cpu_kernel.ENV}=0"
    assert cpu_ops.gdn_ops() is cpu_ops.GdnOps


def test_without_a_compiler_the_cpu_path_keeps_the_chunked_form(fresh_kernel, tmp_path):
    fresh_kernel.setenv("CC", str(tmp_path / "no-such-cc"))
    fresh_kernel.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))      # nothing built before
    assert not cpu_kernel.available()
    assert "no-such-cc" in cpu_kernel.why()
    assert cpu_ops.gdn_ops() is cpu_ops.GdnOps


def test_a_fresh_cache_builds_the_kernel_once(fresh_kernel, tmp_path):
    fresh_kernel.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_kernel.available()
    built = list((tmp_path / "ninfer" / "kernels").glob("gdn_rule-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_kernel._reset_for_tests()
    assert cpu_kernel.available()
    assert built[0].stat().st_mtime_ns == stamp          # loaded, not rebuilt


def _gomps() -> set[str]:
    return {ln.split()[-1] for ln in open("/proc/self/maps") if "libgomp" in ln}


def test_the_kernel_joins_torchs_openmp_or_runs_its_heads_serially_with_the_same_bits(fresh_kernel, tmp_path):
    """Where torch runs on libgomp the kernel is built with OpenMP and loads no second runtime
    (its libgomp.so.1 is torch's copy: one team, no extra threads); without that it is built
    without OpenMP and runs its heads one after another — the same bits either way."""
    fresh_kernel.setenv("XDG_CACHE_HOME", str(tmp_path))
    q, k, v, g, beta, s0 = _inputs(200, seed=23)
    before, shared = torch.get_num_threads(), cpu_kernel._shares_torchs_openmp()
    gomps = _gomps()
    try:
        torch.set_num_threads(2)
        assert cpu_kernel.available()
        team = cpu_kernel.delta_rule_cuts(q, k, v, g, beta, s0, [77])
        assert _gomps() == gomps                                   # no second OpenMP runtime loaded
        built = list((tmp_path / "ninfer" / "kernels").glob("gdn_rule-*.so"))
        assert len(built) == 1 and (b"libgomp.so.1" in built[0].read_bytes()) == shared
        cpu_kernel._reset_for_tests()
        fresh_kernel.setattr(cpu_kernel, "_shares_torchs_openmp", lambda: False)
        assert cpu_kernel.available()
        alone = cpu_kernel.delta_rule_cuts(q, k, v, g, beta, s0, [77])
    finally:
        torch.set_num_threads(before)
    serial = [p for p in (tmp_path / "ninfer" / "kernels").glob("gdn_rule-*.so") if b"libgomp.so.1" not in p.read_bytes()]
    assert len(serial) == 1
    assert torch.equal(team[0], alone[0]) and torch.equal(team[1], alone[1]) and torch.equal(team[2][0], alone[2][0])


def test_q_k_v_read_in_place_from_the_conv_output_rows():
    """The CPU path hands the rule views of the conv output [T, C] (a token's q | k | v side by side):
    read at their row strides, they give what contiguous copies give, bit for bit."""
    q, k, v, g, beta, s0 = _inputs(50, seed=7)
    t = q.shape[0]

    def rows_of(x: torch.Tensor, extra: int) -> torch.Tensor:      # x as a view of a wider [T, C]
        wide = torch.cat([torch.randn(t, extra), x.reshape(t, -1), torch.randn(t, 3)], dim=1)
        return wide[:, extra:extra + x.shape[1] * x.shape[2]].unflatten(-1, x.shape[1:])

    qv, kv, vv = rows_of(q, 5), rows_of(k, 11), rows_of(v, 2)       # three different row strides
    assert not qv.is_contiguous() and len({qv.stride(0), kv.stride(0), vv.stride(0)}) == 3
    got = cpu_kernel.delta_rule_cuts(qv, kv, vv, g, beta, s0, [20])
    want = cpu_kernel.delta_rule_cuts(q, k, v, g, beta, s0, [20])
    assert all(torch.equal(x, y) for x, y in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]))
    # layouts the kernel cannot read in place (a token's heads apart, or a head's dims strided)
    # are copied first
    gap = torch.cat([q, torch.randn(t, q.shape[1], 8)], dim=2)[:, :, :q.shape[2]]
    assert gap.stride(2) == 1 and gap.stride(1) != q.shape[2]
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    for odd in (gap, strided):
        assert torch.equal(cpu_kernel.delta_rule(odd, k, v, g, beta, s0)[0], want[0])


def test_a_decode_step_steps_each_row_in_its_slot_as_a_one_token_chunk():
    """N decode rows, each on its slot's state in place: every row's output and new state equal a
    one-token chunk's from that state, bit for bit; the other slots are untouched; the torch step
    agrees to rounding."""
    n, hk, hv, d = 5, 2, 4, 64
    q, k, v, g, beta, _ = _inputs(n, hk, hv, seed=11)
    gen = torch.Generator().manual_seed(12)
    states = torch.randn(9, hv, d, d, generator=gen) * 0.1
    slots = torch.tensor([7, 0, 3, 8, 2])
    before = states.clone()
    o = cpu_kernel.delta_rule_step_slots(q, k, v, g, beta, states, slots)
    for r, slot in enumerate(slots.tolist()):
        want_o, want_s = cpu_kernel.delta_rule(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1], beta[r:r + 1],
                                               before[slot])
        assert torch.equal(o[r], want_o[0]) and torch.equal(states[slot], want_s)
    untouched = [s for s in range(9) if s not in slots.tolist()]
    assert torch.equal(states[untouched], before[untouched])
    torch_states = before.clone()
    qk = torch.cat([q, k], dim=1)
    ref = cpu_ops.delta_rule_step_slots(qk, v, g, beta, torch_states, slots)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states, torch_states, rtol=1e-5, atol=1e-6)


def test_tokens_decoded_one_by_one_equal_the_same_tokens_in_one_chunk():
    """The GDN part of a sequence is the same bits whether its tokens came as a prompt chunk or
    as decode steps (what a Replay resume recomputes as a chunk, the decode had computed row by row)."""
    t, hv, d = 12, 4, 64
    q, k, v, g, beta, s0 = _inputs(t, 2, hv, seed=13)
    whole, final = cpu_kernel.delta_rule(q, k, v, g, beta, s0)
    states = s0.clone()[None]
    for i in range(t):
        o = cpu_kernel.delta_rule_step_slots(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], states,
                                             torch.tensor([0]))
        assert torch.equal(o[0], whole[i])
    assert torch.equal(states[0], final)


def test_the_cpu_path_steps_decode_rows_through_the_kernel_where_states_are_fp32():
    n, hk, hv, d = 3, 2, 4, 64
    q, k, v, g, beta, _ = _inputs(n, hk, hv, seed=14)
    qk = torch.cat([q, k], dim=1)
    for dtype, kernel in ((torch.float32, True), (torch.float64, False)):
        states = (torch.randn(4, hv, d, d, generator=torch.Generator().manual_seed(15)) * 0.1).to(dtype)
        a, b = states.clone(), states.clone()
        slots = torch.tensor([2, 0, 3])
        got = cpu_ops.KernelGdnOps.delta_rule_step_slots(qk.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype), a,
                                                        slots)
        if kernel:
            want = cpu_kernel.delta_rule_step_slots(q, k, v, g, beta, b, slots)
        else:
            want = cpu_ops.delta_rule_step_slots(qk.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype), b, slots)
        assert torch.equal(got, want) and torch.equal(a, b)


@pytest.mark.parametrize("t", [31, 32, 300])          # under, at and over the length that splits the heads
@pytest.mark.parametrize("heads", [(2, 4), (1, 3), (4, 4)])
def test_the_heads_split_over_threads_give_the_same_bits(t, heads):
    """A chunk's value heads split over the forward's threads (OpenMP, torch's own team): each
    head is computed whole by one thread, so outputs, final state and cut states are the bits of
    the one-thread run — and the reference's to rounding with every head present."""
    q, k, v, g, beta, s0 = _inputs(t, *heads, seed=t + heads[1])
    cuts = [1, t // 2, t]
    before = torch.get_num_threads()
    runs = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs[n] = cpu_kernel.delta_rule_cuts(q, k, v, g, beta, s0, cuts)
    finally:
        torch.set_num_threads(before)
    for n in (2, 3):
        o, s, kept = runs[n]
        assert torch.equal(o, runs[1][0]) and torch.equal(s, runs[1][1])
        assert all(torch.equal(a, b) for a, b in zip(kept, runs[1][2]))
    ro, rs = _reference(q, k, v, g, beta, s0)
    torch.testing.assert_close(runs[2][0].double(), ro, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(runs[2][1].double(), rs, rtol=1e-5, atol=2e-6)


def test_a_value_width_not_a_multiple_of_16_keeps_the_chunked_form():
    """The loop takes whole 16-float vectors: another width is refused by the kernel with a
    clear error and runs the chunked form on the CPU path (prefill and decode rows)."""
    q, k, v, g, beta, s0 = _inputs(20, dv=40, seed=21)
    assert cpu_kernel.fits(48) and cpu_kernel.fits(64) and not cpu_kernel.fits(40) and not cpu_kernel.fits(8)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernel.delta_rule(q, k, v, g, beta, s0)
    o, s, _ = cpu_ops.kernel_delta_rule_cuts(q, k, v, g, beta, s0)
    co, cs, _ = cpu_ops.chunk_delta_rule_cuts(q, k, v, g, beta, s0, ())
    assert torch.equal(o, co) and torch.equal(s, cs)
    states = s0[None].repeat(2, 1, 1, 1).contiguous()
    qk = torch.cat([q[:2], k[:2]], dim=1)
    got = cpu_ops.kernel_step_slots(qk, v[:2], g[:2], beta[:2], states.clone(), torch.tensor([1, 0]))
    want = cpu_ops.delta_rule_step_slots(qk, v[:2], g[:2], beta[:2], states.clone(), torch.tensor([1, 0]))
    assert torch.equal(got, want)


def test_shapes_the_loop_cannot_index_are_refused_before_it_runs():
    q, k, v, g, beta, s0 = _inputs(10, seed=16)
    bad = [
        ((q[:, :1], k, v, g, beta, s0), "shapes disagree"),
        ((q, k, v, g[:5], beta, s0), "shapes disagree"),
        ((q, k, v, g, beta, s0[:2]), "state is"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            cpu_kernel.delta_rule(*args)
    for cuts in ([0], [11], [5, 3]):
        with pytest.raises(ValueError, match="cuts must ascend"):
            cpu_kernel.delta_rule_cuts(q, k, v, g, beta, s0, cuts)
    states = torch.zeros(3, 4, 64, 64)
    with pytest.raises(ValueError, match="slots must be"):
        cpu_kernel.delta_rule_step_slots(q[:2], k[:2], v[:2], g[:2], beta[:2], states, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="states must be"):
        cpu_kernel.delta_rule_step_slots(q[:2], k[:2], v[:2], g[:2], beta[:2], states[:, :2], torch.tensor([0, 1]))


# ---- the GDN layer's conv + SiLU and gated norm in one compiled pass each (twenty-first session)

def _threads(n: int, fn):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("taps", [4, 2, 1])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 130, 700])
def test_the_conv_pass_equals_the_torch_conv_and_silu(t, taps):
    """``conv_silu``: ``gdn.causal_conv1d``'s outputs to fp32 rounding (rows read in place at the
    projection's stride; chunks shorter than the state included; 4, 2 and 1 taps — a one-tap
    conv's state is empty) and its new state bit for bit;
    the rows split over threads give the one-thread bits."""
    gen = torch.Generator().manual_seed(t)
    y = torch.randn(t, 776, generator=gen) * 3
    x, state, w = y[:, :512], torch.randn(512, taps - 1, generator=gen), torch.randn(512, taps, generator=gen) * 0.5
    want, want_state = gdn.causal_conv1d(x, state, w)
    one = _threads(1, lambda: cpu_kernel.conv_silu(x, state, w))
    two = _threads(2, lambda: cpu_kernel.conv_silu(x, state, w))
    torch.testing.assert_close(one[0], want, rtol=2e-6, atol=1e-6)
    assert torch.equal(one[1], want_state) and torch.equal(two[0], one[0]) and torch.equal(two[1], one[1])
    assert torch.equal(x, y[:, :512])                                    # read in place, not changed


def test_the_silu_of_the_compiled_passes_is_exact_to_a_float_over_the_whole_range():
    """The passes' own exp (no library call, the same bits every time): SiLU within 2e-7 relative
    of float64 over |x| < 80, and right where exp leaves the float range (|x| up to 120: x itself
    above, ~0 below)."""
    xs = torch.linspace(-120.0, 120.0, 48_001)
    got = cpu_kernel.conv_silu(xs[:, None].repeat(1, 16).contiguous(), torch.zeros(16, 0), torch.ones(16, 1))[0][:, 0]
    ref = F.silu(xs.double())
    near = xs.abs() < 80
    assert ((got.double() - ref).abs() / ref.abs().clamp_min(1e-30))[near].max() < 2e-7
    assert torch.equal(got[xs > 90], xs[xs > 90]) and got[xs < -90].abs().max() < 1e-30
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("t", [1, 9, 700])
def test_the_gated_norm_pass_equals_the_torch_gated_norm(t):
    """``gated_norm``: w * norm(x) * silu(z) per head to fp32 rounding, z read in place at the
    projection's strides; threads give the same bits; the CPU path's gated norm takes it in fp32."""
    gen = torch.Generator().manual_seed(100 + t)
    core = torch.randn(t, 4, 64, generator=gen)
    core[:, 1] *= 1e-3                             # a head whose mean square is eps's size
    z = (torch.randn(t, 776, generator=gen) * 3)[:, 512:768].view(t, 4, 64)
    w = torch.randn(64, generator=gen)
    acc = torch.float64
    ref = (w.double() * (core.double() * torch.rsqrt(core.double().pow(2).mean(-1, keepdim=True) + 1e-6))
           * F.silu(z.to(acc)))
    one = _threads(1, lambda: cpu_kernel.gated_norm(core, z, w, 1e-6))
    two = _threads(2, lambda: cpu_kernel.gated_norm(core, z, w, 1e-6))
    torch.testing.assert_close(one.double(), ref, rtol=2e-6, atol=2e-6)
    assert torch.equal(one, two)
    assert torch.equal(cpu_ops.gated_rms_norm(core, z, w, 1e-6), one)


def test_widths_the_passes_cannot_take_keep_torch():
    """Channels or head widths that are not whole 16-float vectors, or another dtype: the CPU path
    keeps the torch forms (bit for bit theirs); the passes themselves refuse with a clear error."""
    x, state, w = torch.randn(20, 40), torch.randn(40, 3), torch.randn(40, 4)
    got, got_state = cpu_ops.kernel_causal_conv1d(x, state, w)
    want, want_state = gdn.causal_conv1d(x, state, w)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernel.conv_silu(x, state, w)
    core, z, wn = torch.randn(5, 4, 40), torch.randn(5, 4, 40), torch.randn(40)
    torch_form = cpu_ops.gated_rms_norm(core.double(), z.double(), wn.double(), 1e-6).float()
    torch.testing.assert_close(cpu_ops.gated_rms_norm(core, z, wn, 1e-6), torch_form, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernel.gated_norm(core, z, wn, 1e-6)
    x64 = torch.randn(6, 64, dtype=torch.float64)
    got64, _ = cpu_ops.kernel_causal_conv1d(x64, torch.randn(64, 3, dtype=torch.float64),
                                            torch.randn(64, 4, dtype=torch.float64))
    assert got64.dtype == torch.float64


def test_the_cpu_path_runs_the_conv_and_the_gated_norm_passes_in_fp32():
    """The fp32 CPU path's GDN ops take the conv pass (float64 keeps ``BATCHED``'s torch conv)."""
    assert cpu_ops.gdn_ops().causal_conv1d is cpu_ops.kernel_causal_conv1d
    assert paths.CPU.gated_rms_norm is cpu_ops.gated_rms_norm


def test_tokens_through_the_conv_step_equal_the_same_tokens_in_a_chunk():
    """``conv_step_slots``: each decode row's conv + SiLU from its own slot's state, stepped in
    place — the bits the chunk pass gives the same tokens (so a sequence's conv outputs are the
    same whether its tokens came as a chunk or as decode steps, as the delta rule's are); other
    slots untouched; the torch step agrees to rounding; the CPU path's decode rows take it in fp32."""
    gen = torch.Generator().manual_seed(31)
    t, c = 9, 512
    x = (torch.randn(t, 776, generator=gen) * 2)[:, :c]
    w, st0 = torch.randn(c, 4, generator=gen) * 0.5, torch.randn(c, 3, generator=gen)
    chunk, chunk_state = cpu_kernel.conv_silu(x, st0, w)
    states = torch.randn(5, c, 3, generator=gen)
    states[3] = st0
    others = states[[0, 1, 2, 4]].clone()
    steps = torch.cat([cpu_ops.conv_step_slots(x[i:i + 1], states, torch.tensor([3]), w) for i in range(t)])
    assert torch.equal(steps, chunk) and torch.equal(states[3], chunk_state)
    assert torch.equal(states[[0, 1, 2, 4]], others)
    # several rows at once, slots out of order, against the torch step
    rows, slots = torch.randn(4, c, generator=gen), torch.tensor([4, 0, 2, 1])
    before = states.clone()
    got = cpu_ops.conv_step_slots(rows, states, slots, w)
    want, want_states = gdn.causal_conv1d_step(rows, before.index_select(0, slots), w)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    assert torch.equal(states.index_select(0, slots), want_states) and torch.equal(states[3], before[3])
    # float64 (the oracle's dtype) keeps the torch step
    s64 = before.double()
    got64 = cpu_ops.conv_step_slots(rows.double(), s64, slots, w.double())
    assert got64.dtype == torch.float64 and torch.equal(s64.index_select(0, slots), want_states.double())


@pytest.mark.parametrize("t, rot", [(1, 16), (9, 16), (300, 64), (70, 0)])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_the_qk_norm_rope_pass_equals_the_torch_norms_and_rope(t, rot, zero_centered):
    """``qk_norm_rope``: an attention layer's q heads (read in place from the q|gate rows) and k
    heads RMS-normalised by their scales and rotated on their first R values (partial, whole and
    none), into one buffer — ``scaled_norm`` twice, the concatenation and ``rope_`` to fp32
    rounding (a head whose mean square is eps's size included); threads give the same bits; the
    CPU path's attention takes it in fp32 only."""
    from ninfer.native.model import cpu_layers
    gen = torch.Generator().manual_seed(200 + t + rot)
    qkv = torch.randn(t, 1024, generator=gen)
    q, k = qkv[:, :512].view(t, 4, 128)[..., :64], qkv[:, 512:640].view(t, 2, 64)
    q[:, 2] *= 1e-3                                 # a head whose mean square is eps's size
    w_q, w_k = torch.randn(64, generator=gen) * 0.1, torch.randn(64, generator=gen) * 0.1
    qs, ks = (cpu_ops.norm_scale(w, torch.float32, zero_centered) for w in (w_q, w_k))
    ang = torch.rand(t, 1, rot // 2, generator=gen) * 6
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    want = torch.cat([cpu_ops.scaled_norm(q, qs, 1e-6, zero_centered), cpu_ops.scaled_norm(k, ks, 1e-6, zero_centered)],
                     dim=1)
    cpu_layers.rope_(want, cos, sin)
    one = _threads(1, lambda: cpu_kernel.qk_norm_rope(q, k, qs, ks, 1e-6, cos, sin))
    two = _threads(2, lambda: cpu_kernel.qk_norm_rope(q, k, qs, ks, 1e-6, cos, sin))
    torch.testing.assert_close(one, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(one, two)
    f = cpu_layers.CpuAttention.__new__(cpu_layers.CpuAttention)
    f.q_norm, f.k_norm = qs, ks
    assert cpu_layers._norm_rope_pass(q, f, cos, sin)
    assert not cpu_layers._norm_rope_pass(q.double(), f, cos, sin)
    assert not cpu_layers._norm_rope_pass(q, f, cos, torch.cat([ang.sin(), ang.sin()], 1).transpose(1, 2))
    f.q_norm, f.k_norm = qs.double(), ks.double()
    assert not cpu_layers._norm_rope_pass(q.double(), f, cos.double(), sin.double())


def test_the_qk_norm_rope_pass_refuses_what_it_cannot_take():
    q, k, s = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.ones(64)
    cos = sin = torch.ones(3, 1, 16)
    for args in ((q.double(), k, s, s, 1e-6, cos, sin),                     # float64 q
                 (q, k, s, s, 1e-6, cos[..., :15], sin[..., :15]),          # an odd rotary width
                 (q, k[:2], s, s, 1e-6, cos, sin)):                         # k of another length
        with pytest.raises(ValueError, match="qk_norm_rope takes"):
            cpu_kernel.qk_norm_rope(*args)


# ---- a MoE layer's routed experts (``moe_routed``, through ``cpu_ops.grouped_moe``) ----

def _moe(e: int = 8, h: int = 128, i: int = 64, k: int = 2, seed: int = 0, shared: bool = True, dtype=torch.float32):
    from ninfer.native.model.moe import MoeWeights
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=gen) * 0.1).to(dtype)
    return MoeWeights(router=r(e, h), gate_up=r(e, 2 * i, h), down=r(e, h, i), top_k=k, norm_topk_prob=True,
                      shared_gate_proj=r(i, h) if shared else None, shared_up_proj=r(i, h) if shared else None,
                      shared_down_proj=r(h, i) if shared else None, shared_gate=r(1, h) if shared else None)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 65, 300, 2000])
@pytest.mark.parametrize("shape", [(8, 128, 64, 2, True), (4, 48, 32, 3, True), (6, 64, 16, 1, False)],
                         ids=["tiny-model", "tail-columns-k3", "no-shared-k1"])
def test_the_routed_experts_pass_equals_the_torch_forms(rows, shape, monkeypatch):
    """``grouped_moe`` through the compiled pass: float64 ``sparse_moe`` on the same inputs to fp32
    rounding, and no worse than the torch form it replaces (the padded batched products, or
    ``sparse_moe`` without a shared expert) — block edges (7, 8, 9 rows of 8-row blocks), a width
    that is not a multiple of 32 (48: a 16-float tail), three and one experts a token, no shared
    expert."""
    from ninfer.native.model.moe import MoeWeights, sparse_moe
    e, h, i, k, shared = shape
    w = _moe(e, h, i, k, seed=rows, shared=shared)
    x = torch.randn(rows, h, generator=torch.Generator().manual_seed(rows + 1))
    assert cpu_ops.routed_kernel_fits(x, w)
    calls = []
    real = cpu_kernel.moe_routed
    monkeypatch.setattr(cpu_kernel, "moe_routed", lambda *a: calls.append(1) or real(*a))
    got = cpu_ops.grouped_moe(x, w)
    assert calls == [1] and got.dtype == torch.float32 and got.shape == x.shape
    w64 = MoeWeights(**{f: (getattr(w, f).double() if isinstance(getattr(w, f), torch.Tensor) else getattr(w, f))
                        for f in ("router", "gate_up", "down", "top_k", "norm_topk_prob", "shared_gate_proj",
                                  "shared_up_proj", "shared_down_proj", "shared_gate")})
    truth = sparse_moe(x.double(), w64)
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    torch_form = cpu_ops.grouped_moe(x, w)
    err = (got.double() - truth).abs().max()
    assert err / truth.abs().max() < 2e-6                       # fp32 rounding of the largest output
    assert err <= 4 * (torch_form.double() - truth).abs().max() + 1e-7


def test_a_tokens_routed_output_does_not_depend_on_its_batch_or_the_threads():
    """Each (token, expert) row of the pass is its own running sums, and a token's experts are added
    in one order, so a token's routed output is the same bits alone, in any batch, in any order of
    the batch, and on 1, 2 or 3 threads. (Only the pass: torch's products before it — the router,
    the shared expert — may round a row differently in a batch of another size.)"""
    from ninfer.native.model.moe import route
    w = _moe(seed=5)
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(6))
    top_w, top_i = route(x, w)
    gu, down = cpu_ops._routed_transposed(w)

    def routed(rows):
        return cpu_kernel.moe_routed(x[rows], top_i[rows], top_w[rows], gu, down, torch.zeros(len(rows), 128))
    every = list(range(300))
    before = torch.get_num_threads()
    runs = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs[n] = routed(every)
        torch.set_num_threads(2)
        perm = torch.randperm(300, generator=torch.Generator().manual_seed(7)).tolist()
        shuffled = routed(perm)
        alone = torch.cat([routed([r]) for r in (0, 9, 150, 299)])
        part = routed(list(range(100, 117)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[1], runs[2]) and torch.equal(runs[1], runs[3])
    assert torch.equal(shuffled, runs[2][perm])
    assert torch.equal(alone, runs[2][[0, 9, 150, 299]])
    assert torch.equal(part, runs[2][100:117])


def test_the_routed_outputs_are_added_in_ascending_expert_order():
    """A token's experts' outputs are added into the shared output in the experts' ascending
    order — ``index_add_`` over the pairs sorted by expert — whatever order top-k gave them. Exact
    integers where the order decides the rounding: 2^24 + 1 + 2 = 2^24 + 2, 2^24 + 2 + 1 = 2^24 + 4
    in fp32; each expert's weight scales its output."""
    e, h, i = 4, 16, 16
    gu = torch.zeros(e, h, 2 * i)
    gu[:, 0, :i] = 128.0                       # gate 128 on every column: silu(128) = 128 exactly
    for x_ in range(e):
        gu[x_, 0, i:] = float(x_)              # up: the expert's number
    down = torch.zeros(e, i, h)
    down[:, 0, :] = 1.0 / 128.0                # y = 128 * u / 128 = u, on every column
    x = torch.zeros(3, h)
    x[:, 0] = 1.0
    top_i = torch.tensor([[3, 1], [1, 3], [2, 0]])
    top_w = torch.tensor([[2.0, 1.0], [1.0, 2.0], [1.0, 1.0]])
    base = torch.full((3, h), 2.0 ** 24)
    got = cpu_kernel.moe_routed(x, top_i, top_w, gu, down, base.clone())
    # expert 1 (x1) then expert 3 (x2 = 6): 2^24 + 1 -> 2^24, + 6 -> 2^24 + 6 (the other order: 2^24 + 8)
    assert got[0].eq(2.0 ** 24 + 6).all() and got[1].eq(2.0 ** 24 + 6).all()
    assert got[2].eq(2.0 ** 24 + 2).all()                     # expert 0 adds 0, expert 2 adds 2
    order = torch.argsort(top_i.view(-1), stable=True)
    y = (torch.tensor([3.0, 1.0, 1.0, 3.0, 2.0, 0.0]) * top_w.view(-1))[order][:, None].expand(-1, h)
    assert torch.equal(got, base.clone().index_add_(0, order // 2, y))


def test_the_routed_weights_layout_follows_a_changed_weight():
    """The transposed copies the pass reads are built once per layer and built again when an
    expert weight is changed in place or replaced."""
    w = _moe(seed=8)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(9))
    a = cpu_ops.grouped_moe(x, w)
    kept = w.routed_t
    assert torch.equal(cpu_ops.grouped_moe(x, w), a) and w.routed_t is kept
    w.gate_up.mul_(2.0)
    b = cpu_ops.grouped_moe(x, w)
    assert w.routed_t is not kept and not torch.equal(a, b)
    w.down = w.down * 0.5
    c = cpu_ops.grouped_moe(x, w)
    w.routed_t = None
    assert torch.equal(c, cpu_ops.grouped_moe(x, w))


def test_the_routed_pass_refuses_what_it_cannot_take():
    """Widths that are not whole vectors, other dtypes and devices keep the torch forms; shapes
    that disagree and expert ids out of range are an error before anything is written."""
    w = _moe(e=4, h=40, i=32, seed=10)
    x = torch.randn(5, 40)
    assert not cpu_ops.routed_kernel_fits(x, w)                  # H = 40: not whole vectors
    assert not cpu_ops.routed_kernel_fits(torch.randn(5, 128).double(), _moe(dtype=torch.float64))
    assert not cpu_ops.routed_kernel_fits(torch.randn(5, 128).bfloat16(), _moe(dtype=torch.bfloat16))
    assert not cpu_ops.routed_kernel_fits(torch.randn(5, 128), _moe(i=24))
    gu, down = torch.zeros(4, 128, 64), torch.zeros(4, 32, 128)
    x, out = torch.randn(5, 128), torch.zeros(5, 128)
    ids, wts = torch.zeros(5, 2, dtype=torch.int64), torch.ones(5, 2)
    for bad in [dict(x=x.double()), dict(out=torch.zeros(4, 128)), dict(top_w=torch.ones(5, 3)),
                dict(gu=torch.zeros(4, 128, 60)), dict(down=torch.zeros(3, 32, 128)),
                dict(gu=torch.zeros(4, 64, 128).transpose(1, 2))]:
        a = dict(x=x, top_i=ids, top_w=wts, gu=gu, down=down, out=out)
        a.update(bad)
        with pytest.raises(ValueError):
            cpu_kernel.moe_routed(a["x"], a["top_i"], a["top_w"], a["gu"], a["down"], a["out"])
    before = out.clone()
    with pytest.raises(ValueError, match="expert id"):
        cpu_kernel.moe_routed(x, torch.full((5, 2), 4), wts, gu, down, out)
    assert torch.equal(out, before)


# ---- a chunk's causal attention (``chunk_attention``, through ``cpu_ops.chunk_attention``) ----

def _qkv(tq: int, n: int, hq: int = 4, hkv: int = 2, d: int = 64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tq, hq, d, generator=gen), torch.randn(n, hkv, d, generator=gen),
            torch.randn(n, hkv, d, generator=gen))


def _attention64(q, k, v, scale):
    """Float64 lower-right causal attention: query r of Tq sees keys 0 .. L - Tq + r."""
    tq, n, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("thd,lhd->htl", qd, kd) * scale
    s = s.masked_fill(torch.arange(n)[None, :] > (n - tq + torch.arange(tq))[:, None], float("-inf"))
    return torch.einsum("htl,lhd->thd", torch.softmax(s, -1), vd)


@pytest.mark.parametrize("span", [(1, 1), (5, 5), (8, 8), (9, 40), (16, 300), (257, 257), (300, 300), (100, 1500),
                                  (3, 600)], ids=lambda s: f"Tq{s[0]}-L{s[1]}")
@pytest.mark.parametrize("shape", [(4, 2, 64), (2, 2, 128), (3, 1, 48)], ids=lambda s: f"Hq{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_the_attention_pass_equals_float64_attention(span, shape):
    """The compiled chunk attention against float64 math on the same inputs, no worse than the fused
    torch op it replaces: chunks from position 0 and over a prefix, one query, block edges (8, 9
    queries of 8-query blocks; 257 and 300 keys across 256-key steps), GQA ratios 1, 2 and 3, head
    widths 64, 128 and 48."""
    import torch.nn.functional as F
    tq, n = span
    hq, hkv, d = shape
    q, k, v = _qkv(tq, n, hq, hkv, d, seed=tq + n)
    scale = d ** -0.5
    got = cpu_kernel.chunk_attention(q, k, v, scale)
    truth = _attention64(q, k, v, scale)
    mask = torch.ones(tq, n, dtype=torch.bool)
    mask[:, n - tq:] = torch.ones(tq, tq, dtype=torch.bool).tril()
    fused = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert got.dtype == torch.float32 and got.shape == q.shape
    err = (got.double() - truth).abs().max()
    assert err < 2e-6
    assert err <= 4 * (fused.double() - truth).abs().max() + 1e-7


def test_a_querys_attention_does_not_depend_on_its_chunk_or_the_threads():
    """A query's row is its own running max, sum and products over keys taken in the same 256-key
    steps from key 0, so it is the same bits computed in one chunk of a prompt or in any later
    chunk of it (over the same keys), and on 1, 2 or 3 threads — what lets a prompt cut anywhere
    give the same attention outputs."""
    q, k, v = _qkv(700, 700, seed=31)
    before = torch.get_num_threads()
    runs = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs[n] = cpu_kernel.chunk_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        tails = {cut: cpu_kernel.chunk_attention(q[cut:], k, v, 0.125) for cut in (1, 255, 256, 300, 691, 699)}
        heads = {end: cpu_kernel.chunk_attention(q[:end], k[:end], v[:end], 0.125) for end in (1, 9, 257, 512)}
    finally:
        torch.set_num_threads(before)
    assert torch.equal(runs[1], runs[2]) and torch.equal(runs[1], runs[3])
    for cut, got in tails.items():
        assert torch.equal(got, runs[2][cut:]), cut
    for end, got in heads.items():
        assert torch.equal(got, runs[2][:end]), end


def test_the_cpu_path_attends_through_the_pass_in_fp32_only(monkeypatch):
    """``cpu_ops.chunk_attention`` takes the compiled pass for fp32 queries with whole-vector heads
    and the fused torch op for float64 (the oracle's dtype), bf16 and other widths."""
    from ninfer.native.model.attention import paged_attention
    calls = []
    real = cpu_kernel.chunk_attention
    monkeypatch.setattr(cpu_kernel, "chunk_attention", lambda *a: calls.append(a[0].dtype) or real(*a))
    for dt, d, taken in ((torch.float32, 64, True), (torch.float64, 64, False), (torch.bfloat16, 64, False),
                         (torch.float32, 40, False)):
        calls.clear()
        gen = torch.Generator().manual_seed(d)
        k_cache, v_cache = (torch.randn(4, 64, 2, d, generator=gen).to(dt) for _ in range(2))
        pages = torch.tensor([2, 0, 3])
        q = torch.randn(30, 4, d, generator=gen).to(dt)
        got = cpu_ops.chunk_attention(q, k_cache, v_cache, pages, 100, d ** -0.5)
        assert calls == ([dt] if taken else [])
        ref = paged_attention(q.double(), k_cache.double(), v_cache.double(), pages, 100, d ** -0.5)
        assert (got.double() - ref).abs().max() < (2e-6 if dt == torch.float32 else 2e-2)


def test_the_attention_pass_refuses_what_it_cannot_take():
    q, k, v = _qkv(10, 20)
    for bad in [(q.double(), k, v), (q, k[:, :, :48], v), (q, k, v[:19]), (q[:, :3], k, v), (q, k[:9], v[:9]),
                (torch.randn(10, 4, 40), torch.randn(20, 2, 40), torch.randn(20, 2, 40))]:
        with pytest.raises(ValueError):
            cpu_kernel.chunk_attention(*bad, 0.125)
