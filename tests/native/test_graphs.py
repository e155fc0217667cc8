"""The Program's graphs (native/graphs.py) on the CPU stand-in backend: a sequence of decode,
verify or chunk calls of changing membership, lengths, starts and page tables, each replayed on
its graph's static buffers, equals the same calls run eagerly — logits, every KV page and every state slot
of the pools (the scratch page and slot excepted) — so no replay read a previous call's inputs
and no padding row wrote outside the scratch."""

from __future__ import annotations

import pytest
import torch

from ninfer.native import graphs
from ninfer.native.model.forward import ForwardBatch, ModelCache
from tests.native.model.test_batched_forward import ORDER, prepared, rel_err


def _with_scratch(cache: ModelCache) -> ModelCache:
    """The prepared cache plus one page and one slot (the scratch), filled with NaN: a real row
    that read them would show it."""
    grow = lambda t, dim: torch.cat([t, torch.full_like(t.narrow(dim, 0, 1), float("nan"))], dim)  # noqa: E731
    return ModelCache(grow(cache.k, 1), grow(cache.v, 1), grow(cache.conv, 1), grow(cache.ssm, 1))


# buckets 4, 8, 4 (full), 4 (one padding row after a full call: stale unless refreshed), 2, 1,
# 8 (full), 4, 1
def _assert_pools_equal(replayed: ModelCache, eager: ModelCache, pages: int, slots: int, bound: float) -> None:
    """Every state slot and KV page of the pools (the scratch ones excepted) alike: the same
    slots written (NaN where neither wrote), to ``bound``."""
    for a, b in ((replayed.ssm, eager.ssm), (replayed.conv, eager.conv)):
        assert rel_err(a[:, :slots], b[:, :slots]) < bound
    for a, b in ((replayed.k, eager.k), (replayed.v, eager.v)):
        a, b = a[:, :pages], b[:, :pages]
        assert torch.equal(a.isnan(), b.isnan())
        assert rel_err(torch.nan_to_num(a), torch.nan_to_num(b)) < bound


def _runner(prep, max_rows: int, **kw) -> tuple[graphs.GraphRunner, ModelCache]:
    """A captured runner on a scratch-extended copy of the prepared cache, and the eager copy
    beside it."""
    eager, replayed = _with_scratch(prep.cache), _with_scratch(prep.cache)
    runner = graphs.GraphRunner(prep.model, replayed, graphs.ReplayBackend(), max_rows=max_rows, max_context=512,
                                scratch_page=prep.cache.k.shape[1], scratch_slot=prep.cache.conv.shape[1], **kw)
    runner.capture_all()
    return runner, eager


def _check_call(runner: graphs.GraphRunner, eager: ModelCache, rows, bound: float) -> None:
    """One call replayed (``runner``) and run eagerly on ``eager``: logits (and their argmax),
    every row's hidden, and every page and slot of the pools alike."""
    batch = ForwardBatch.build(rows)
    want = runner.model.forward(batch, eager)
    got = runner.forward(batch, None, ())
    assert rel_err(got.logits, want.logits) < bound
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
    assert rel_err(got.all_hidden, want.all_hidden) < bound
    _assert_pools_equal(runner.cache, eager, eager.k.shape[1] - 1, eager.conv.shape[1] - 1, bound)


CALLS = [[0, 1, 2], [3, 4, 5, 6, 7], [2, 3, 4, 1], [0, 7, 5], [1, 2], [6], [6, 5, 4, 3, 2, 1, 0, 7], [4, 1, 0], [4]]


def test_bucket_sizes():
    assert graphs.buckets(1) == [1]
    assert graphs.buckets(6) == [1, 2, 4, 6]
    assert graphs.buckets(8) == [1, 2, 4, 8]
    assert graphs.buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert graphs.bucket_for(3, [1, 2, 4, 8]) == 4 and graphs.bucket_for(9, [1, 2, 4, 8]) is None


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_replayed_decode_calls_equal_eager_calls(tiny_model, dtype):
    prep = prepared(tiny_model, dtype)
    runner, eager = _runner(prep, 8)
    assert runner.stats.buckets == [1, 2, 4, 8]
    lens = {i: 0 for i in range(len(ORDER))}        # decode steps taken by each sequence
    bound = 1e-12 if dtype == "float64" else 1e-5
    for call in CALLS:
        rows = []
        for i in call:
            (row,) = [r for r in prep.step(len(ORDER), False) if r.state_slot == prep.slots[i]]
            row.start += lens[i]                     # one position further each time it decodes
            row.token_ids = [(7 * i + lens[i]) % 2000 + 1]
            rows.append(row)
            lens[i] += 1
        _check_call(runner, eager, rows, bound)
    assert runner.stats.replays == len(CALLS) and runner.stats.padded > 0 and runner.stats.eager == 0


def test_calls_without_a_graph_run_eagerly(tiny_model):
    prep = prepared(tiny_model, "float64")
    runner, _ = _runner(prep, 2)
    for rows in (prep.step(2, True), prep.step(3, False)):   # a chunk; more rows than any bucket
        batch = ForwardBatch.build(rows)
        out = runner.forward(batch, None, ())
        assert out.logits.shape[0] == batch.logits_rows.numel()
    assert runner.stats.eager == 2 and runner.stats.replays == 0


def test_a_moe_too_wide_for_the_dense_form_is_captured_only_on_the_kernel_path(tiny_model):
    """The torch path's capture-safe MoE reads every expert (512 would be too many); the kernel
    path's fused MoE serves any expert count."""
    from ninfer.native.model import paths
    prep = prepared(tiny_model, "float64")
    assert graphs.GraphRunner.usable(prep.model) == ""
    cfg = type("C", (), {"num_experts": 512, "num_hidden_layers": 1, "is_moe_layer": lambda self, i: True})()
    wide = type("M", (), {"cfg": cfg, "path": paths.BATCHED})()
    assert "512 experts" in graphs.GraphRunner.usable(wide)
    wide.path = paths.KERNELS
    assert graphs.GraphRunner.usable(wide) == ""


def test_the_backend_follows_the_device_and_enforce_eager(monkeypatch):
    monkeypatch.delenv("NINFER_GRAPHS", raising=False)
    cpu = torch.device("cpu")
    assert graphs.backend_for(cpu, False) is None
    monkeypatch.setenv("NINFER_GRAPHS", "replay")
    assert isinstance(graphs.backend_for(cpu, False), graphs.ReplayBackend)
    assert graphs.backend_for(cpu, True) is None


def test_the_stand_in_refuses_host_reads_inside_a_captured_forward():
    """A read of a tensor's value back to Python inside the captured function — a sync a CUDA
    capture refuses, a decision it would freeze — raises in the stand-in at capture and at
    replay; outside it, and in other threads meanwhile, reads work."""
    import threading
    from ninfer.native.model.forward import ForwardOutput
    x = torch.tensor([1.0, 5.0])
    reads = {"replay": False}

    def fn():
        if reads["replay"]:
            int(x.argmax())                       # a host read only on a replay
        return ForwardOutput(hidden=x * 2, logits=None, all_hidden=x)
    replay, out = graphs.ReplayBackend().capture(fn)
    replay()
    reads["replay"] = True
    with pytest.raises(graphs.HostRead, match="Tensor.__int__"):
        replay()
    for read in (lambda: x.item(), lambda: bool(x[0]), lambda: x.tolist(), lambda: x.cpu(), lambda: [0, 1][x.long()[0]]):
        with graphs.no_host_reads(), pytest.raises(graphs.HostRead):
            read()
    seen = []
    with graphs.no_host_reads():
        t = threading.Thread(target=lambda: seen.append(int(x[1])))
        t.start()
        t.join()
    assert seen == [5] and int(x.argmax()) == 1 and x.tolist() == [1.0, 5.0]


def test_replayed_verify_calls_equal_eager_calls(tiny_model):
    """The "verify" profile (rows of an input and 3 drafts): over changing membership in one
    bucket, a replay equals the eager call in logits, every page and slot, and the kept
    per-step states — so rolling a rejected row back gives the same state either way."""
    from tests.native.model.test_batched_forward import CONTEXTS, _verify_rows
    prep = prepared(tiny_model, "float64")
    model = prep.model
    runner, eager = _runner(prep, 4, verify_tokens=4)
    replayed, pages, slots = runner.cache, prep.cache.k.shape[1], prep.cache.conv.shape[1]
    assert runner.stats.verify_buckets == [1, 2, 4]
    steps = {i: 0 for i in range(len(CONTEXTS))}
    for call in ([1, 6, 2, 3], [0, 4, 5], [3, 1], [6, 0, 2, 4]):
        rows = _verify_rows(prep, call, 4)
        for r, i in zip(rows, call):
            r.start += 4 * steps[i]                 # each call of a sequence 4 positions on
            steps[i] += 1
        want_b, got_b = ForwardBatch.build(rows), ForwardBatch.build(rows)
        want = model.forward(want_b, eager)
        got = runner.forward(got_b, None, ())
        assert rel_err(got.logits, want.logits) < 1e-12
        assert len(got_b.spec_states) == len(want_b.spec_states) > 0
        for g_layer, w_layer in zip(got_b.spec_states, want_b.spec_states):
            assert sorted(g_layer) == sorted(w_layer) == list(range(len(call)))
            for s in w_layer:
                for a, b in zip(g_layer[s], w_layer[s]):
                    assert rel_err(a, b) < 1e-12
        s, slot = 1, rows[1].state_slot           # the second row kept only its input and one draft
        model.roll_back(eager, want_b, s, slot, 2)
        model.roll_back(replayed, got_b, s, slot, 2)
        _assert_pools_equal(replayed, eager, pages, slots, 1e-12)
    assert runner.stats.verify_replays == 4 and runner.stats.padded > 0


# (decode members, chunk length, whose chunk) of each call: the chunk sequence continuing from
# its prefix (None), last sequence 3 from where it decoded to (other pages, slot and start);
# buckets (4, 64) full, (4, 64) with a padding row and a shorter chunk after a longer one,
# (1, 100), (0, 64) the chunk alone, (2, 64); the chunk sits among the decode rows
CHUNK_CALLS = [([4, 5, 6, 7], 60, None), ([0, 1, 2], 5, None), ([3], 70, None), ([], 34, None), ([6, 2], 17, 3)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_replayed_chunk_calls_equal_eager_calls(tiny_model, dtype):
    """The "chunk" profile (a prefill chunk padded to its length beside 0 .. B decode rows): a
    replay equals the eager call in logits, every row's hidden (in the call's order), every page
    and slot — so the padded chunk's state is the unpadded one's and its padding wrote nothing
    of a sequence's."""
    from ninfer.native.model.config import PAGE_SIZE
    from ninfer.native.model.forward import SeqInput
    from tests.native.model.test_batched_forward import CHUNK_PREFIX, CONTEXTS
    prep = prepared(tiny_model, dtype)
    runner, eager = _runner(prep, 4, chunk_tokens=100)
    assert runner.stats.chunk_buckets == [[b, n] for b in (0, 1, 2, 4) for n in (64, 100)]
    c = len(CONTEXTS)
    assert CHUNK_PREFIX + sum(n for _, n, who in CHUNK_CALLS if who is None) <= len(prep.tables[c]) * PAGE_SIZE
    lens = {i: 0 for i in range(c)}
    at = CHUNK_PREFIX
    bound = 1e-12 if dtype == "float64" else 1e-5
    for members, n, who in CHUNK_CALLS:
        rows = []
        for i in members:
            rows.append(SeqInput([(7 * i + lens[i]) % 2000 + 1], CONTEXTS[i] - 1 + lens[i], prep.tables[i],
                                 prep.slots[i]))
            lens[i] += 1
        start = at if who is None else CONTEXTS[who] - 1 + lens[who]
        chunk = [(11 * p) % 1900 + 3 for p in range(start, start + n)]
        seq = c if who is None else who
        rows.insert(len(rows) // 2, SeqInput(chunk, start, prep.tables[seq], prep.slots[seq]))
        if who is None:
            at += n
        _check_call(runner, eager, rows, bound)
    assert runner.stats.chunk_replays == len(CHUNK_CALLS) and runner.stats.eager == 0
    assert runner.stats.padded == len(CHUNK_CALLS)


def test_calls_outside_the_chunk_profile_run_eagerly(tiny_model):
    """A chunk longer than the budget, a chunk returning every row's logits and a verify row of
    more inputs than the graphs' 1 + k have no graph; the same chunk cut to the budget has, and
    so has one beside a verify row and a decode row."""
    from tests.native.model.test_batched_forward import _verify_rows
    prep = prepared(tiny_model, "float64")
    runner, _ = _runner(prep, 4, chunk_tokens=32, verify_tokens=4)
    assert runner.stats.chunk_buckets == [[b, 32] for b in (0, 1, 2, 4)]
    assert runner.stats.verify_chunk_buckets == [[b, 32] for b in (1, 2, 4)]

    def decode_and_chunk(n: int, logits: str):
        rows = prep.step(1, True)
        (chunk,) = [r for r in rows if len(r.token_ids) > 1]
        chunk.token_ids, chunk.logits = chunk.token_ids[:n], logits
        return rows, chunk
    long_chunk, _ = decode_and_chunk(60, "last")
    every_row, _ = decode_and_chunk(20, "all")
    for rows in (long_chunk, every_row, _verify_rows(prep, [1, 2], 5)):
        runner.forward(ForwardBatch.build(rows), None, ())
    assert runner.stats.eager == 3 and runner.stats.replays == 0
    runner.forward(ForwardBatch.build(decode_and_chunk(32, "last")[0]), None, ())
    assert runner.stats.eager == 3 and runner.stats.chunk_replays == 1
    mixed = _verify_rows(prep, [1], 4) + decode_and_chunk(20, "last")[0]
    runner.forward(ForwardBatch.build(mixed), None, ())
    assert runner.stats.eager == 3 and runner.stats.chunk_replays == 2 and runner.stats.verify_replays == 1


# (sequence, drafts) of each call's rows — 0 drafts: a plain decode row — and its chunk's length
# (None: no chunk): rows of 2, 3 and 4 inputs and decode rows padded to 4 inside their rows,
# a decode row first and among verify rows; buckets 4 (full), 4 (a padding row), chunk (2, 64),
# chunk (4, 64) with a padding row
MIXED_CALLS = [([(1, 3), (6, 0), (2, 1), (3, 2)], None), ([(0, 0), (4, 2), (5, 0)], None),
               ([(3, 1), (1, 0)], 40), ([(6, 2), (2, 3), (0, 0)], 20)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_replayed_ragged_and_mixed_verify_calls_equal_eager_calls(tiny_model, dtype):
    """Verify rows with fewer drafts than k (a budget near max_tokens) and plain decode rows
    beside verify rows, with and without a chunk, replay the verify profile padded inside their
    rows: equal to the eager call in logits, every row's hidden (in the call's order), every
    page and slot — the padding inputs changed no state and wrote nothing of a sequence's — and
    the kept per-step states, so a short row's roll-back gives the same state either way."""
    from ninfer.native.model.forward import SeqInput
    from tests.native.model.test_batched_forward import CHUNK_PREFIX, CONTEXTS
    prep = prepared(tiny_model, dtype)
    model = prep.model
    runner, eager = _runner(prep, 4, verify_tokens=4, chunk_tokens=64)
    replayed, pages, slots = runner.cache, prep.cache.k.shape[1], prep.cache.conv.shape[1]
    bound = 1e-12 if dtype == "float64" else 1e-5
    c, at = len(CONTEXTS), CHUNK_PREFIX
    moved = {i: 0 for i in range(c)}
    for call, n in MIXED_CALLS:
        rows = []
        for i, d in call:
            start = CONTEXTS[i] - 1 + moved[i]
            tokens = [(7 * i + start) % 2000 + 1, *[(13 * i + j) % 1000 + 5 for j in range(d)]]
            rows.append(SeqInput(tokens, start, prep.tables[i], prep.slots[i], "all" if d else "last", verify=d > 0))
            moved[i] += 1 + d
        if n is not None:
            rows.insert(1, SeqInput([(11 * p) % 1900 + 3 for p in range(at, at + n)], at, prep.tables[c], prep.slots[c]))
            at += n
        want_b, got_b = ForwardBatch.build(rows), ForwardBatch.build(rows)
        want = model.forward(want_b, eager)
        got = runner.forward(got_b, None, ())
        assert rel_err(got.logits, want.logits) < bound
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        assert rel_err(got.all_hidden, want.all_hidden) < bound
        _assert_pools_equal(replayed, eager, pages, slots, bound)
        for g_layer, w_layer in zip(got_b.spec_states, want_b.spec_states, strict=True):
            assert sorted(g_layer) == sorted(w_layer) == want_b.verify_seqs
            for s in w_layer:
                for a, b in zip(g_layer[s], w_layer[s]):      # a padded row's: its real steps first
                    assert rel_err(a[:b.shape[0]], b) < bound
        s = min(want_b.verify_seqs, key=lambda j: len(rows[j].token_ids))   # the shortest verify row
        model.roll_back(eager, want_b, s, rows[s].state_slot, 1)
        model.roll_back(replayed, got_b, s, rows[s].state_slot, 1)
        _assert_pools_equal(replayed, eager, pages, slots, bound)
    st = runner.stats
    assert st.verify_replays == 4 and st.chunk_replays == 2 and st.eager == 0 and st.padded == 4


def test_replayed_verify_and_chunk_calls_equal_eager_calls(tiny_model):
    """Verify rows beside a padded chunk (the chunked prefill of a new request while others
    speculate): a replay equals the eager call in logits, hidden, pages and slots, and hands
    the kept per-step states over by the call's own row index (the chunk sits among the verify
    rows), so a roll-back gives the same state either way."""
    from ninfer.native.model.forward import SeqInput
    from tests.native.model.test_batched_forward import CHUNK_PREFIX, CONTEXTS, _verify_rows
    prep = prepared(tiny_model, "float64")
    model = prep.model
    runner, eager = _runner(prep, 4, verify_tokens=4, chunk_tokens=64)
    replayed, pages, slots = runner.cache, prep.cache.k.shape[1], prep.cache.conv.shape[1]
    assert runner.stats.verify_chunk_buckets == [[1, 64], [2, 64], [4, 64]]
    c, at = len(CONTEXTS), CHUNK_PREFIX
    steps = {i: 0 for i in range(c)}
    for call, n in (([1, 6, 2, 3], 50), ([0, 4, 5], 9), ([3], 33)):
        rows = _verify_rows(prep, call, 4)
        for r, i in zip(rows, call):
            r.start += 4 * steps[i]
            steps[i] += 1
        chunk = [(13 * p) % 1800 + 4 for p in range(at, at + n)]
        rows.insert(1, SeqInput(chunk, at, prep.tables[c], prep.slots[c]))
        at += n
        want_b, got_b = ForwardBatch.build(rows), ForwardBatch.build(rows)
        want = model.forward(want_b, eager)
        got = runner.forward(got_b, None, ())
        assert rel_err(got.logits, want.logits) < 1e-12
        assert rel_err(got.all_hidden, want.all_hidden) < 1e-12
        assert len(got_b.spec_states) == len(want_b.spec_states) > 0
        for g_layer, w_layer in zip(got_b.spec_states, want_b.spec_states):
            assert sorted(g_layer) == sorted(w_layer) == want_b.verify_seqs
            for s in w_layer:
                for a, b in zip(g_layer[s], w_layer[s]):
                    assert rel_err(a, b) < 1e-12
        s = want_b.verify_seqs[-1]                 # the last verify row kept its input and one draft
        model.roll_back(eager, want_b, s, rows[s].state_slot, 2)
        model.roll_back(replayed, got_b, s, rows[s].state_slot, 2)
        _assert_pools_equal(replayed, eager, pages, slots, 1e-12)
    assert runner.stats.chunk_replays == 3 and runner.stats.verify_replays == 3 and runner.stats.eager == 0


def test_a_moe_model_on_the_kernel_path_graphs_chunks_up_to_the_fused_kernels_reach(tiny_model):
    """The runner's plan and chunk lengths follow ``chunk_cap``: on the kernel path the tiny MoE
    model's chunk graphs stop at 256 tokens (a 300-token chunk runs eagerly), on the torch path
    they reach the budget."""
    import types

    from ninfer.native.model.model import HybridModel
    from ninfer.native.model.paths import BATCHED, KERNELS
    cfg = HybridModel.load(tiny_model, "float32").cfg
    for path, sizes in ((KERNELS, [64, 128, 256]), (BATCHED, [64, 128, 256, 512])):
        model = types.SimpleNamespace(cfg=cfg, path=path)
        r = graphs.GraphRunner(model, None, graphs.ReplayBackend(), max_rows=4, max_context=1024, scratch_page=0,
                               scratch_slot=0, chunk_tokens=512)
        assert r.chunk_sizes == sizes and max(k[3] for k in r.plan) == sizes[-1]
        assert graphs.bucket_for(300, r.chunk_sizes) == (512 if path is BATCHED else None)


def test_every_verify_graph_keeps_its_per_step_states_in_one_shared_buffer(tiny_model):
    """The verify rows' kept states of every captured graph (verify, and chunk beside verify
    rows) are views of the runner's one buffer — no graph holds its own copy (13.8 GiB over 21
    graphs for Qwen3-Next at k = 3 before) — and the buffer fits the layout's reserve for them
    (C x (1 + k) StateImages of workspace)."""
    from ninfer.config import EngineConfig
    from ninfer.native.layout import resolve_layout
    prep = prepared(tiny_model, "float32")
    runner, _ = _runner(prep, 4, verify_tokens=4, chunk_tokens=64)
    buf = runner.spec_steps
    assert buf is not None and buf.shape[1:3] == (4, 4)
    base = buf.untyped_storage().data_ptr()
    verify_graphs = [g for key, g in runner.graphs.items() if key[2] > 1]
    assert len(verify_graphs) == 3 + 3              # verify rows 1, 2, 4; a 64-token chunk beside 1, 2, 4 of them
    for g in verify_graphs:
        kept = g.static.batch.spec_states
        assert kept and all(t[2].untyped_storage().data_ptr() == base for layer in kept for t in layer.values())
    lay = resolve_layout(prep.model.cfg, EngineConfig(max_concurrency=4, max_context=512), torch.device("cpu"))
    reserve = 4 * 4 * lay.state_image_bytes
    assert buf.numel() * buf.element_size() <= reserve
