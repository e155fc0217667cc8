"""The model's kernel path (``paths.KERNELS``: Triton paged attention and KV write, the GDN ops
through ``kernels.gdn``) against the batched torch path, through the whole tiny model, with the
Triton kernels interpreted on CPU tensors. This is the forward a CUDA model runs
(``paths.for_device``); here it proves the wiring — which rows go to the decode kernel, which
to the prefill launch, the padded page tables, the slot mapping — on the same prepared caches as
``tests/native/model/test_batched_forward.py``.

Bounds: fp32 differs from the torch path only by summation order (the kernels accumulate the
softmax online over pages), so ``REL["float32"]`` of that test holds; argmax tokens equal.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.native.model import paths
from ninfer.native.model.forward import SeqInput
from tests.native.model.test_batched_forward import (
    CHUNK_PREFIX,
    CONTEXTS,
    REL,
    _written_kv,
    prepared,
    rel_err,
)


def _compare(prep, rows, dtype="float32") -> None:
    got, got_cache = prep.run(paths.KERNELS, rows)
    ref, ref_cache = prep.run(paths.BATCHED, rows)
    bound = REL[dtype]
    assert rel_err(got.logits, ref.logits) < bound
    for a, b in zip(_written_kv(got_cache, rows), _written_kv(ref_cache, rows)):
        assert torch.isfinite(a).all() and rel_err(a, b) < bound
    slots = [r.state_slot for r in rows]
    if got_cache.conv.numel():
        assert rel_err(got_cache.ssm[:, slots], ref_cache.ssm[:, slots]) < bound
        assert rel_err(got_cache.conv[:, slots], ref_cache.conv[:, slots]) < bound
    assert torch.equal(got.logits.argmax(-1), ref.logits.argmax(-1))


# decode rows alone at the batch edges and between them; beside a chunk, one odd batch (each
# with-chunk case is ~15 s under the Triton interpreter)
@pytest.mark.parametrize(("n_decode", "with_chunk"), [(1, False), (5, False), (8, False), (5, True)],
                         ids=["B1-decode-only", "B5-decode-only", "B8-decode-only", "B5-with-chunk"])
def test_the_kernel_path_equals_the_batched_path(tiny_model, with_chunk, n_decode):
    prep = prepared(tiny_model, "float32")
    _compare(prep, prep.step(n_decode, with_chunk))


def test_a_chunk_alone_is_one_contiguous_prefill_launch(tiny_model, monkeypatch):
    # the fused MoE kernel sees a chunk's rows beside decode rows in the B5-with-chunk case; here,
    # interpreted, it was 60 % of this test's 25 s and nothing of the launch it is about
    monkeypatch.setattr(paths.KernelPath, "moe", paths.BatchedPath.moe)
    prep = prepared(tiny_model, "float32")
    _compare(prep, prep.step(0, True))


def test_verify_rows_beside_decode_rows(tiny_model):
    """A verify row (an input and its drafts over a cached prefix) goes to the prefill launch,
    the decode rows to the decode kernel; the GDN keeps every step's state as on the torch path."""
    prep = prepared(tiny_model, "float32")
    c = len(CONTEXTS)
    rows = prep.step(3, False)
    rows.insert(1, SeqInput(prep.chunk_tokens[CHUNK_PREFIX:CHUNK_PREFIX + 4], CHUNK_PREFIX, prep.tables[c],
                            prep.slots[c], "all", verify=True))
    _compare(prep, rows)


def test_pure_attention_model_on_the_kernel_path(tiny_qwen3):
    prep = prepared(tiny_qwen3, "float32")
    _compare(prep, prep.step(8, True))


def test_the_device_chooses_the_path():
    cuda = torch.device("cuda")
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert paths.for_device(cuda, dt) is paths.KERNELS
    assert paths.for_device(cuda, torch.float64) is paths.BATCHED      # the oracle's dtype
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert paths.for_device(torch.device("cpu"), dt) is paths.CPU     # the fused CPU chunk ops
    assert paths.for_device(torch.device("cpu"), torch.float64) is paths.BATCHED


def test_graphs_on_the_kernel_path_equal_the_eager_torch_path(tiny_model, monkeypatch):
    """The graphs a CUDA model replays run the kernel path on their static buffers (the verify
    profile's prefill launch over its prepared padded tables, its longest row given; the chunk
    profile's launch over the chunk's real queries — beside verify rows one launch for both —
    its GDN through the kernel ops): with the CPU stand-in backend, decode, verify, decode +
    chunk and verify + chunk calls of changing membership — verify rows with fewer drafts and
    decode rows beside verify rows too, padded inside their rows (the launch reads each row's
    real queries) — equal the eager batched torch path, pages and slots included."""
    from ninfer.native import graphs
    from ninfer.native.model.forward import ForwardBatch
    from tests.native.model.test_batched_forward import _verify_rows
    from tests.native.test_graphs import _assert_pools_equal, _with_scratch
    c = len(CONTEXTS)
    # the MoE runs the torch grouping here: interpreted, the fused MoE kernel was 60 % of this
    # test's 108 s, and it sees no graph buffer (token rows in, token rows out — checked on the
    # kernel path by test_the_kernel_path_equals_the_batched_path and tests/native/kernels/test_moe.py)
    monkeypatch.setattr(paths.KernelPath, "moe", paths.BatchedPath.moe)     # dense over experts in a graph

    def with_chunk(rows, start, n):
        tokens = [(5 * p) % 1700 + 9 for p in range(start, start + n)]
        return rows[:1] + [SeqInput(tokens, start, prep.tables[c], prep.slots[c])] + rows[1:]
    prep = prepared(tiny_model, "float32")
    model = prep.model
    eager, replayed = _with_scratch(prep.cache), _with_scratch(prep.cache)
    pages, slots = prep.cache.k.shape[1], prep.cache.conv.shape[1]
    before, model.path = model.path, paths.KERNELS
    try:
        runner = graphs.GraphRunner(model, replayed, graphs.ReplayBackend(), max_rows=4, max_context=512,
                                    scratch_page=pages, scratch_slot=slots, verify_tokens=3, chunk_tokens=40)
        runner.capture_all()
        def rows_of(call, inputs):     # inputs: each row's (1: a decode row)
            rows = []
            for i, n in zip(call, inputs):
                rows += _verify_rows(prep, [i], n) if n > 1 else [
                    r for r in prep.step(8, False) if r.state_slot == prep.slots[i]]
            return rows
        for call, inputs, chunk in (([1, 6, 2], [3] * 3, None), ([0, 4], [3] * 2, None), ([3, 5, 7], [1] * 3, None),
                                    ([3, 5], [1] * 2, (CHUNK_PREFIX, 25)), ([], [], (CHUNK_PREFIX + 25, 40)),
                                    ([1, 6], [3] * 2, (CHUNK_PREFIX + 65, 20)),
                                    # rows of fewer drafts, decode rows beside verify rows: padded rows
                                    # (seq 7's and 5's padding inputs sit on unwritten, NaN key slots)
                                    ([1, 6, 7], [3, 2, 1], None), ([5, 0], [1, 2], (CHUNK_PREFIX + 85, 30))):
            rows = rows_of(call, inputs)
            if chunk is not None:
                rows = with_chunk(rows, *chunk)
            model.path = paths.BATCHED
            want = model.forward(ForwardBatch.build(rows), eager)
            model.path = paths.KERNELS
            got = runner.forward(ForwardBatch.build(rows), None, ())
            assert rel_err(got.logits, want.logits) < REL["float32"]
            assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
            _assert_pools_equal(replayed, eager, pages, slots, REL["float32"])
        assert runner.stats.verify_replays == 5 and runner.stats.chunk_replays == 4 and runner.stats.replays == 8
    finally:
        model.path = before
