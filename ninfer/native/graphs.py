"""The Program's CUDA graphs of the decode forward (seed: CUDA graph 由 Program 拥有，按实际成员数和
执行 profile 选择).

A graph is keyed by (member-count bucket, execution profile). Two profiles are captured:
``decode`` (every row of the call is one decode row) and, with a draft backend, ``verify``
(every row is a verify row of 1 + k inputs: the speculating decode step). Every other call — a
prefill or replay chunk, decode and verify rows mixed, rows with fewer drafts, image
embeddings or MRoPE rows — runs eagerly (the fallback, counted in ``GraphStats.eager``).

Buckets are vLLM's capture sizes cut at ``max_concurrency``: 1, 2, 4, 8, then every multiple
of 8. A call of n rows replays the smallest bucket >= n; rows n .. B-1 are padding rows: token 0
at position 0 (a verify padding row: positions 0 .. k), its KV written into the scratch page,
its state read and written in the scratch slot (``Memory``'s extra page and slot, outside every pool the policy sees), so a padding row
never touches a page or slot of a sequence. Every row of a forward is independent of the others
(attention, GDN, MoE and norms are per row), so padding changes no real row.

**Never stale:** every tensor the captured forward reads is a static buffer of its graph, and
every replay rewrites all of it — the real rows from the call's ``ForwardBatch``, the padding
rows to their fixed values, the block table to the real pages padded with each row's own first
page (the scratch page for padding rows) — before the graph runs. The outputs are the graph's
static tensors; the caller reads them before the next replay — a verify graph's kept per-step
states too (handed to the call's batch for ``HybridModel.roll_back``).

Backends: ``CudaBackend`` captures with ``torch.cuda.CUDAGraph`` into one shared memory pool
(largest bucket first, after two warm-up runs on a side stream, so autotuned kernels have picked
their configs before capture). ``ReplayBackend`` is the CPU stand-in the tests use
(``NINFER_GRAPHS=replay``): "capture" runs the function once, "replay" runs it again on the same
static buffers and copies its results into the captured outputs — so a buffer that a replay did
not refresh would feed the previous call's values, as it would on the GPU. What the stand-in
cannot show is a Python decision frozen at capture; the captured forward makes none on values
(shapes only: the bucket and the table's width).

MoE layers need a form without data-dependent shapes. On the kernel path (CUDA) that is the
fused MoE (``kernels/moe.py``: one program per token and chosen expert), for any expert count.
On the torch path a graph takes the dense-over-experts form (``sparse_moe(dense=True)``: the
routing weights are zero for unselected experts, so the sum equals the sparse one to rounding),
which reads every expert per step — so there graphs serve models of at most
``DENSE_MOE_MAX_EXPERTS`` experts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.forward import ForwardBatch, ForwardOutput, ModelCache
from ninfer.protocol import GraphStats

log = logging.getLogger("ninfer.graphs")

DENSE_MOE_MAX_EXPERTS = 64
DECODE = "decode"
VERIFY = "verify"


def not_capturable(cfg, fused_moe: bool = False) -> str:
    """Why a model of this config gets no graphs ('' when it does). ``fused_moe``: the kernel
    path's MoE (``kernels/moe.py``), capture-safe for any expert count."""
    if fused_moe:
        return ""
    if cfg.num_experts > DENSE_MOE_MAX_EXPERTS and any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        return (f"{cfg.num_experts} experts: the capture-safe MoE reads every expert "
                f"(at most {DENSE_MOE_MAX_EXPERTS}); decode runs eagerly")
    return ""


def buckets(max_rows: int) -> list[int]:
    """Member-count buckets up to ``max_rows`` (always including it)."""
    return sorted({b for b in [1, 2, 4, *range(8, max_rows, 8)] if b < max_rows} | {max_rows})


def bucket_for(n: int, sizes: list[int]) -> int | None:
    for b in sizes:
        if b >= n:
            return b
    return None


def backend_for(device: torch.device, enforce_eager: bool):
    """The graph backend of a Program on ``device``: CUDA graphs on CUDA unless the config says
    ``enforce_eager``; on the CPU none, except the tests' stand-in (``NINFER_GRAPHS=replay``)."""
    if enforce_eager:
        return None
    if device.type == "cuda":
        return CudaBackend(device)
    if os.environ.get("NINFER_GRAPHS") == "replay":
        return ReplayBackend()
    return None


class CudaBackend:
    name = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], ForwardOutput]) -> tuple[Callable[[], None], ForwardOutput]:
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            for _ in range(2):                 # warm-up: autotuners pick their configs here
                fn()
        main.wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


class ReplayBackend:
    name = "replay"

    def capture(self, fn: Callable[[], ForwardOutput]) -> tuple[Callable[[], None], ForwardOutput]:
        out = fn()

        def replay() -> None:
            new = fn()
            for dst, src in ((out.hidden, new.hidden), (out.logits, new.logits),
                             (out.all_hidden, new.all_hidden), (out.taps, new.taps)):
                if dst is not None:
                    dst.copy_(src)
        return replay, out


def _load_table(buf: torch.Tensor, table: torch.Tensor, n: int, scratch_page: int) -> None:
    """A graph's block table from the call's: its n rows' pages, padded with each row's own
    first page to the static width; padding rows on the scratch page."""
    w = table.shape[1]
    buf[:n, :w].copy_(table)
    buf[:n, w:].copy_(table[:, :1].expand(n, buf.shape[1] - w))
    buf[n:].fill_(scratch_page)


class _Static:
    """The input buffers of one bucket's graph and the ForwardBatch over them."""

    def __init__(self, rows: int, width: int, device, scratch_page: int, scratch_slot: int):
        lt = lambda n, v: torch.full((n,), v, dtype=torch.long, device=device)  # noqa: E731
        self.rows, self.width = rows, width
        self.pad_slot_mapping, self.scratch_page, self.scratch_slot = scratch_page * PAGE_SIZE, scratch_page, scratch_slot
        self.input_ids = lt(rows, 0)
        self.positions = lt(rows, 0)
        self.slot_mapping = lt(rows, self.pad_slot_mapping)
        self.state_slots = lt(rows, scratch_slot)
        self.kv_lens = lt(rows, 1)
        self.block_table = torch.full((rows, width), scratch_page, dtype=torch.long, device=device)
        arange = torch.arange(rows, dtype=torch.long, device=device)
        self.batch = ForwardBatch(
            input_ids=self.input_ids, positions=self.positions, cu=list(range(rows + 1)), starts=[0] * rows,
            page_tables=[], state_slots=self.state_slots, slot_mapping=self.slot_mapping, logits_rows=arange,
            decode_seqs=list(range(rows)), decode_rows=arange, decode_slots=self.state_slots,
            decode_kv_lens=self.kv_lens, decode_block_table=self.block_table, decode_kv_slots=None)

    def load(self, b: ForwardBatch) -> None:
        """Every buffer rewritten: the call's rows, then padding."""
        n = len(b.decode_seqs)
        for buf, src, pad in ((self.input_ids, b.input_ids, 0), (self.positions, b.positions, 0),
                              (self.slot_mapping, b.slot_mapping, self.pad_slot_mapping),
                              (self.state_slots, b.state_slots, self.scratch_slot),
                              (self.kv_lens, b.decode_kv_lens, 1)):
            buf[:n].copy_(src)
            buf[n:].fill_(pad)
        _load_table(self.block_table, b.decode_block_table, n, self.scratch_page)


class _StaticVerify:
    """The input buffers of one bucket's verify graph: ``rows`` verify rows of ``n`` inputs
    (an input and n - 1 drafts each), packed row by row; padding rows decode positions 0..n-1
    on the scratch page and slot. The kernel path's prefill launch reads a prepared
    ``kernel_meta["multi"]`` over the same buffers (its longest row known: n)."""

    def __init__(self, rows: int, n: int, width: int, device, scratch_page: int, scratch_slot: int):
        from ninfer.native.model.paths import _MultiRows
        lt = lambda k, v: torch.full((k,), v, dtype=torch.long, device=device)  # noqa: E731
        t = rows * n
        self.rows, self.n, self.width, self.scratch_page, self.scratch_slot = rows, n, width, scratch_page, scratch_slot
        step = torch.arange(n, dtype=torch.long, device=device)
        self.pad_positions = step.repeat(rows)
        self.pad_slot_mapping = scratch_page * PAGE_SIZE + self.pad_positions
        self.input_ids = lt(t, 0)
        self.positions = self.pad_positions.clone()
        self.slot_mapping = self.pad_slot_mapping.clone()
        self.state_slots = lt(rows, scratch_slot)
        self.starts = lt(rows, 0)
        self.block_table = torch.full((rows, width), scratch_page, dtype=torch.long, device=device)
        arange = torch.arange(t, dtype=torch.long, device=device)
        empty = lt(0, 0)
        self.batch = ForwardBatch(
            input_ids=self.input_ids, positions=self.positions, cu=list(range(0, t + 1, n)), starts=[0] * rows,
            page_tables=[], state_slots=self.state_slots, slot_mapping=self.slot_mapping, logits_rows=arange,
            verify_seqs=list(range(rows)), decode_rows=empty, decode_slots=empty, decode_kv_lens=empty,
            decode_block_table=empty.view(0, 0), verify_len=n, verify_rows=arange, verify_slots=self.state_slots,
            verify_starts=self.starts, verify_block_table=self.block_table)
        self.batch.kernel_meta["multi"] = _MultiRows(arange, torch.arange(0, t + 1, n, device=device), self.starts,
                                                     self.block_table, contiguous=True, max_q=n)

    def load(self, b: ForwardBatch) -> None:
        v = len(b.verify_seqs)
        t = v * self.n
        for buf, src, pad in ((self.input_ids, b.input_ids, None), (self.positions, b.positions, self.pad_positions),
                              (self.slot_mapping, b.slot_mapping, self.pad_slot_mapping)):
            buf[:t].copy_(src)
            if pad is None:
                buf[t:].zero_()
            else:
                buf[t:].copy_(pad[t:])
        self.state_slots[:v].copy_(b.verify_slots)
        self.state_slots[v:].fill_(self.scratch_slot)
        self.starts[:v].copy_(b.verify_starts)
        self.starts[v:].zero_()
        _load_table(self.block_table, b.verify_block_table, v, self.scratch_page)


class _Graph:
    def __init__(self, static, replay: Callable[[], None], out: ForwardOutput):
        self.static, self.replay, self.out = static, replay, out


class GraphRunner:
    """The Program's graphs; ``forward`` replays one when the call's shape has one, else runs
    the model eagerly. ``verify_tokens``: the inputs of a speculating row (1 + k drafts; 0
    without a draft backend) — the "verify" profile's row length."""

    def __init__(self, model, cache: ModelCache, backend, max_rows: int, max_context: int,
                 scratch_page: int, scratch_slot: int, taps: tuple[int, ...] = (), verify_tokens: int = 0):
        self.model, self.cache, self.backend, self.taps = model, cache, backend, taps
        self.sizes = buckets(max_rows)
        self.width = -(-max_context // PAGE_SIZE)
        self.scratch_page, self.scratch_slot = scratch_page, scratch_slot
        self.verify_tokens = verify_tokens if 1 < verify_tokens <= PAGE_SIZE else 0
        self.graphs: dict[tuple[int, str], _Graph] = {}
        self.stats = GraphStats(backend=backend.name)

    @staticmethod
    def usable(model) -> str:
        """Why this model's decode forward cannot be captured ('' when it can)."""
        from ninfer.native.model.paths import KERNELS
        return not_capturable(model.cfg, fused_moe=model.path is KERNELS)

    def capture_all(self) -> None:
        """Every bucket's graph of every profile, largest first (smaller graphs reuse its pool)."""
        t0 = time.perf_counter()
        for b in sorted(self.sizes, reverse=True):
            if self.verify_tokens:
                self._capture(b, VERIFY)
            self._capture(b, DECODE)
        self.stats.capture_s = time.perf_counter() - t0
        self.stats.buckets = sorted(b for b, p in self.graphs if p == DECODE)
        self.stats.verify_buckets = sorted(b for b, p in self.graphs if p == VERIFY)

    def _capture(self, rows: int, profile: str) -> _Graph:
        dev = self.model.device
        static = (_Static(rows, self.width, dev, self.scratch_page, self.scratch_slot) if profile == DECODE else
                  _StaticVerify(rows, self.verify_tokens, self.width, dev, self.scratch_page, self.scratch_slot))

        def fn() -> ForwardOutput:
            static.batch.spec_states.clear()     # the verify rows' kept states: this run's
            return self.model.forward(static.batch, self.cache, taps=self.taps, static=True)
        replay, out = self.backend.capture(fn)
        g = self.graphs[(rows, profile)] = _Graph(static, replay, out)
        self._clear_scratch()
        return g

    def _clear_scratch(self) -> None:
        c = self.cache
        if c.conv.numel():
            c.conv[:, self.scratch_slot].zero_()
            c.ssm[:, self.scratch_slot].zero_()

    def _profile(self, batch: ForwardBatch, embeds, taps) -> tuple[str, int] | None:
        """The call's (profile, member count) when a graph may run it."""
        if embeds is not None or batch.rope_positions is not None or tuple(taps) != tuple(self.taps):
            return None
        if batch.all_decode:
            return (DECODE, len(batch.decode_seqs)) if batch.decode_block_table.shape[1] <= self.width else None
        if (self.verify_tokens and not batch.decode_seqs and not batch.chunk_seqs
                and batch.verify_len == self.verify_tokens and batch.verify_block_table.shape[1] <= self.width):
            return VERIFY, len(batch.verify_seqs)
        return None

    def forward(self, batch: ForwardBatch, embeds: torch.Tensor | None, taps: tuple[int, ...]) -> ForwardOutput:
        shape = self._profile(batch, embeds, taps)
        b = bucket_for(shape[1], self.sizes) if shape is not None else None
        g = self.graphs.get((b, shape[0])) if b is not None else None
        if g is None:
            self.stats.eager += 1
            return self.model.forward(batch, self.cache, embeds, taps)
        profile, n = shape
        g.static.load(batch)
        self._clear_scratch()
        g.replay()
        self.stats.replays += 1
        self.stats.padded += n < b
        o = g.out
        t = n if profile == DECODE else n * self.verify_tokens
        if profile == VERIFY:                    # the kept states, for HybridModel.roll_back
            self.stats.verify_replays += 1
            batch.spec_states = [{s: v for s, v in d.items() if s < n} for d in g.static.batch.spec_states]
        return ForwardOutput(hidden=o.hidden[:t], logits=o.logits[:t], all_hidden=o.all_hidden[:t],
                             taps=o.taps[:t] if o.taps is not None else None)
