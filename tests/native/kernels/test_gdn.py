"""The GDN dispatch: our torch reference on the CPU; fla-core's kernels (the optional ``gpu``
extra) checked against that reference where they can run.

Under TRITON_INTERPRET=1 on the CPU, fla-core 0.6.0's fused recurrent kernel and causal conv
run (the conv only with its autotuner's timing stubbed); its chunked kernel cannot (its
autotuner asks for a GPU driver to time configs, and a loop index is used as a tensor), so that one is checked by ``ninfer bench gpu`` on a GPU only.
Bounds (relative Frobenius, against the reference in fp32 on the same inputs):
    final state <= 1e-5 in every dtype (fp32 in both);  output fp32 <= 1e-5, fp16 <= 2e-3, bf16 <= 1e-2
"""

from __future__ import annotations

import pytest
import torch

from ninfer.native.kernels import gdn
from tests.native.kernels.conftest import rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = [str(d).removeprefix("torch.") for d in DTYPES]
OUT_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(n, t, hk, hv, dk, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    return (r(n, t, hk, dk).to(dtype), r(n, t, hk, dk).to(dtype), r(n, t, hv, dv).to(dtype),
            -torch.rand(n, t, hv, generator=g) * 0.5,                # log decay, fp32 as the model makes it
            torch.rand(n, t, hv, generator=g).to(dtype), r(n, hv, dk, dv) * 0.1)


def test_dispatch_on_cpu_is_the_reference():
    q, k, v, g, beta, s = _inputs(2, 3, 1, 2, 16, 16, torch.float32)
    o1, s1 = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s)
    o2, s2 = gdn.recurrent_gated_delta_rule_ref(q, k, v, g, beta, s)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    o1, s1 = gdn.chunk_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], s[0])
    o2, s2 = gdn.chunk_gated_delta_rule_ref(q[0], k[0], v[0], g[0], beta[0], s[0])
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("shape", [(3, 1, 1, 2, 32, 32), (1, 9, 2, 4, 64, 64)],
                         ids=["decode-n3-gva2-d32", "t9-gva2-d64"])
def test_fla_fused_recurrent_matches_reference(shape, dtype):
    pytest.importorskip("fla")
    q, k, v, g, beta, s = _inputs(*shape, dtype)
    o, st = gdn.recurrent_gated_delta_rule_fla(q, k, v, g, beta, s.clone())
    o_ref, st_ref = gdn.recurrent_gated_delta_rule_ref(q.float(), k.float(), v.float(), g, beta.float(), s)
    assert o.dtype == dtype and st.dtype == torch.float32
    assert rel_err(st, st_ref) <= 1e-5
    assert rel_err(o, o_ref) <= OUT_BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_fla_causal_conv_matches_reference(dtype, monkeypatch):
    pytest.importorskip("fla")
    if not torch.cuda.is_available():
        # The interpreter has no driver to time autotune configs with; time each as 0 (the
        # first config is taken). Test-only: on a GPU the autotuner runs as shipped.
        from triton.runtime import autotuner
        monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, config=None, **k: [0.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    t, c, kw = 9, 16, 4
    x, w, st = (torch.randn(*s, generator=g).to(dtype) for s in ((t, c), (c, kw), (c, kw - 1)))
    y, s2 = gdn.causal_conv1d_fla(x, st, w)
    y_ref, s_ref = gdn.causal_conv1d_ref(x.float(), st.float(), w.float())
    assert rel_err(y, y_ref) <= OUT_BOUND[dtype] and torch.equal(s2.float(), s_ref)
    xs, ss = x[:3], st[None].expand(3, -1, -1).contiguous()
    y, s2 = gdn.causal_conv1d_step_fla(xs, ss, w)
    y_ref, s_ref = gdn.causal_conv1d_step_ref(xs.float(), ss.float(), w.float())
    assert rel_err(y, y_ref) <= OUT_BOUND[dtype] and torch.equal(s2.float(), s_ref)


def test_an_fla_import_failure_is_kept_whole_and_logged(monkeypatch, caplog):
    """fla failing to import (here: planted) is not swallowed: ``fla_status`` holds the error
    as raised and ``fla_available`` logs it once, so a CUDA model silently running the torch
    reference shows in the log."""
    import builtins
    import logging

    from ninfer.native.kernels import gdn
    real = builtins.__import__

    def planted(name, *a, **k):
        if name.startswith("fla"):
            raise RuntimeError("fla 0.6.0 needs a newer triton (planted)")
        return real(name, *a, **k)
    gdn.fla_status.cache_clear()
    gdn.fla_available.cache_clear()
    monkeypatch.setattr(builtins, "__import__", planted)
    try:
        with caplog.at_level(logging.WARNING, logger="ninfer.kernels"):
            assert gdn.fla_available() is False
        assert gdn.fla_status() == "RuntimeError: fla 0.6.0 needs a newer triton (planted)"
        assert "planted" in caplog.text and "torch reference" in caplog.text
    finally:
        monkeypatch.undo()
        gdn.fla_status.cache_clear()
        gdn.fla_available.cache_clear()
