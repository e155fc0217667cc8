"""The Program's CUDA graphs of the forward (seed: CUDA graph 由 Program 拥有，按实际成员数和
执行 profile 选择).

A graph is keyed by (execution profile, member-count bucket, row length, chunk length). Three
profiles:

* ``decode`` — every row of the call is one decode row;
* ``verify`` (with a draft backend) — every row is a row of 1 + k inputs: the speculating
  decode step. A verify row with fewer drafts (its budget near ``max_tokens`` or the context)
  and a plain decode row beside verify rows are padded inside their rows (``_PaddedRows``);
* ``chunk`` — one prefill/replay chunk of up to L tokens beside 0 .. B decode rows, or (with a
  draft backend) beside 1 .. B rows of the verify profile: the chunked-prefill step. L runs over
  ``chunk_sizes`` (64, 128, 256, … up to the prefill chunk budget), the chunk padded to it.

Every other call — a chunk longer than the budget, two chunks, image embeddings or MRoPE rows,
unusual logits rows, a chunk with inner save cuts — runs eagerly (the fallback, counted in ``GraphStats.eager``).

Buckets are vLLM's capture sizes cut at ``max_concurrency``: 1, 2, 4, 8, then every multiple
of 8 (and 0 for a chunk alone). A call of n rows replays the smallest bucket >= n; rows n .. B-1
are padding rows: token 0 at position 0 (a verify padding row: positions 0 .. k), its KV
written into the scratch page, its state read and written in the scratch slot (``Memory``'s
extra page and slot, outside every pool the policy sees), so a padding row never touches a page
or slot of a sequence. Every row of a forward is independent of the others (attention, GDN,
MoE and norms are per row), so padding changes no real row. A padded chunk's or verify row's
real inputs come first: attention is causal and the GDN masks the padding inputs out
(``paths._gdn_padded``, ``paths._gdn_verify``), so its state and outputs are the unpadded
ones.

**Never stale:** every tensor the captured forward reads is a static buffer of its graph, and
every replay rewrites all of it — the real rows from the call's ``ForwardBatch``, the padding
rows to their fixed values, the block tables to the real pages padded with each row's own first
page (the scratch page for padding rows), a chunk's start, length and mask — before the graph
runs. The outputs are the graph's static tensors (hidden states: the LM head runs after the
replay, on the real rows only); the caller reads them (put back into the call's row order)
before the next replay — a verify graph's kept per-step states too (handed to
the call's batch for ``HybridModel.roll_back``).

Backends: ``CudaBackend`` captures with ``torch.cuda.CUDAGraph`` into one shared memory pool
(largest graph first, after two warm-up runs on a side stream, so autotuned kernels have picked
their configs before capture). ``ReplayBackend`` is the CPU stand-in the tests use
(``NINFER_GRAPHS=replay``): "capture" runs the function once, "replay" runs it again on the same
static buffers and copies its results into the captured outputs — so a buffer that a replay did
not refresh would feed the previous call's values, as it would on the GPU. Inside the function
it forbids reading a tensor back to Python (``no_host_reads``): on CUDA that is a sync the
capture refuses, and a decision on the value would be frozen into the graph — so the stand-in
shows both. The captured forward decides on shapes only (the bucket, the row and chunk lengths,
the tables' widths). What it cannot show is a Python value the loaders change between replays
(they write only tensors).

MoE layers need a form without data-dependent shapes. On the kernel path (CUDA) that is the
fused MoE (``kernels/moe.py``: one program per token and chosen expert), for any expert count.
On the torch path a graph takes the dense-over-experts form (``sparse_moe(dense=True)``: the
routing weights are zero for unselected experts, so the sum equals the sparse one to rounding),
which reads every expert per step — so there graphs serve models of at most
``DENSE_MOE_MAX_EXPERTS`` experts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import torch

from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.forward import ForwardBatch, ForwardOutput, ModelCache, PaddedChunk
from ninfer.protocol import GraphStats

log = logging.getLogger("ninfer.graphs")

DENSE_MOE_MAX_EXPERTS = 64
DECODE = "decode"
VERIFY = "verify"
CHUNK = "chunk"


def not_capturable(cfg, fused_moe: bool = False) -> str:
    """Why a model of this config gets no graphs ('' when it does). ``fused_moe``: the kernel
    path's MoE (``kernels/moe.py``), capture-safe for any expert count."""
    if fused_moe:
        return ""
    if cfg.num_experts > DENSE_MOE_MAX_EXPERTS and any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        return (f"{cfg.num_experts} experts: the capture-safe MoE reads every expert "
                f"(at most {DENSE_MOE_MAX_EXPERTS}); the forward runs eagerly")
    return ""


def buckets(max_rows: int) -> list[int]:
    """Member-count buckets up to ``max_rows`` (always including it)."""
    return sorted({b for b in [1, 2, 4, *range(8, max_rows, 8)] if b < max_rows} | {max_rows})


def chunk_cap(cfg, fused_moe: bool) -> int | None:
    """The longest chunk a graph takes (None: up to the budget). On the kernel path a MoE
    layer's capture-safe form is the fused kernel, one program per (token, chosen expert): for a
    long chunk that reads each chosen expert once per token instead of once (≈ 1.3 s for a
    2,048-token chunk at Qwen3-Next's size). Until a grouped kernel exists, such chunks run
    eagerly on the grouped torch op; chunks up to ``FUSED_MAX_ROWS`` tokens are still graphed.
    The torch path's dense form (at most ``DENSE_MOE_MAX_EXPERTS`` experts) keeps every size."""
    from ninfer.native.model.moe import FUSED_MAX_ROWS
    if fused_moe and cfg.num_experts and any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        return FUSED_MAX_ROWS
    return None


def chunk_sizes(chunk_tokens: int, cap: int | None = None) -> list[int]:
    """The chunk profile's padded lengths: 64, 128, 256, … below the prefill chunk budget, and
    the budget itself (none for a budget under 2: such a chunk is a decode row); none past
    ``cap`` (``chunk_cap``)."""
    if chunk_tokens < 2:
        return []
    sizes, n = [], PAGE_SIZE
    while n < chunk_tokens:
        sizes.append(n)
        n *= 2
    return [n for n in sizes + [chunk_tokens] if cap is None or n <= cap]


def plan(max_rows: int, verify_tokens: int = 0, chunk_tokens: int = 0,
         cap: int | None = None) -> list[tuple[str, int, int, int]]:
    """Every graph a Program captures, as (profile, rows bucket, row length, chunk length),
    largest first (tokens per call): the capture order, and what the layout reserves for.
    Profile "chunk" with row length 1 is a chunk beside decode rows, with 1 + k beside verify
    rows; ``cap``: the longest chunk (``chunk_cap``)."""
    rows = buckets(max_rows)
    verify = 1 < verify_tokens <= PAGE_SIZE
    chunks = chunk_sizes(chunk_tokens, cap)
    keys = [(DECODE, b, 1, 0) for b in rows]
    keys += [(CHUNK, b, 1, n) for b in [0, *rows] for n in chunks]
    if verify:
        keys += [(VERIFY, b, verify_tokens, 0) for b in rows]
        keys += [(CHUNK, b, verify_tokens, n) for b in rows for n in chunks]
    return sorted(keys, key=lambda k: (-tokens(k), k))


def tokens(key: tuple[str, int, int, int]) -> int:
    """The rows of one graph's forward."""
    _, b, n, length = key
    return b * n + length


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


# the ways a tensor's values reach Python (each a device-to-host sync on CUDA)
_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "__array__")


class HostRead(RuntimeError):
    """A captured forward read a tensor's value back to Python."""


_reads = threading.local()
_guards_lock = threading.Lock()
_guarded = False


def _install_guards() -> None:
    """Wrap each host read of ``torch.Tensor`` once per process; a wrapper raises only in a
    thread inside ``no_host_reads`` (so concurrent users never undo each other's guards)."""
    global _guarded
    with _guards_lock:
        if _guarded:
            return

        def guard(name: str, orig):
            def read(self, *args, **kwargs):
                if getattr(_reads, "on", False):
                    raise HostRead(f"Tensor.{name} inside a captured forward: a CUDA graph capture cannot read a "
                                   "value back to the host, and a decision on it would be frozen into the graph")
                return orig(self, *args, **kwargs)
            return read
        for n in _HOST_READS:
            setattr(torch.Tensor, n, guard(n, getattr(torch.Tensor, n)))
        _guarded = True


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """In this thread, reading a tensor's values back to Python (``item``, ``int(t)``, ``if t``,
    ``tolist``, ``t.cpu()`` …) raises ``HostRead``; other threads are unaffected."""
    _install_guards()
    before, _reads.on = getattr(_reads, "on", False), True
    try:
        yield
    finally:
        _reads.on = before


class ReplayBackend:
    name = "replay"

    def capture(self, fn: Callable[[], ForwardOutput]) -> tuple[Callable[[], None], ForwardOutput]:
        def run() -> ForwardOutput:
            with no_host_reads():
                return fn()
        out = run()

        def replay() -> None:
            new = run()
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


class _PaddedRows:
    """B rows of n inputs each over a graph's buffers (views): the call's verify rows first (in
    its order), then its decode rows, then padding rows. A row with fewer than n real inputs —
    fewer drafts, or a plain decode row — is padded after its real ones (``ends``: its real
    count): the padding inputs are token 0 at positions 0 .. n-1 writing into the scratch page,
    masked out of the GDN. A padding row is all padding, on the scratch page and slot."""

    def __init__(self, rows: int, n: int, input_ids, positions, slot_mapping, pad_positions, pad_slot_mapping,
                 state_slots, starts, ends, table, scratch_page: int, scratch_slot: int):
        self.rows, self.n = rows, n
        self.input_ids, self.positions, self.slot_mapping = input_ids, positions, slot_mapping
        self.pad_positions, self.pad_slot_mapping = pad_positions, pad_slot_mapping
        self.state_slots, self.starts, self.ends, self.table = state_slots, starts, ends, table
        self.scratch_page, self.scratch_slot = scratch_page, scratch_slot

    @staticmethod
    def uniform(b: ForwardBatch, n: int) -> bool:
        """The call's rows are verify rows of n inputs each (the usual speculating step)."""
        return not b.decode_seqs and b.verify_len == n

    def load(self, b: ForwardBatch) -> None:
        """Every buffer rewritten: the call's rows, then padding."""
        n, ver, dec = self.n, b.verify_seqs, b.decode_seqs
        v, c = len(ver), len(ver) + len(dec)
        t = c * n
        if self.uniform(b, n):                   # no padding inside a row: slices of the call's rows
            for buf, src in ((self.input_ids, b.input_ids), (self.positions, b.positions),
                             (self.slot_mapping, b.slot_mapping)):
                buf[:t].copy_(src.index_select(0, b.verify_rows) if b.chunk_seqs else src)
            self.ends.fill_(n)
        else:
            src, ends = [], []
            for i in ver + dec:
                lo, e = b.cu[i], b.cu[i + 1] - b.cu[i]
                src += [*range(lo, lo + e), *[-1] * (n - e)]
                ends.append(e)
            meta = torch.tensor(src + ends, dtype=torch.long).to(self.ends.device)
            idx, pad = meta[:t].clamp_min(0), meta[:t] < 0
            self.input_ids[:t].copy_(torch.where(pad, 0, b.input_ids[idx]))
            self.positions[:t].copy_(torch.where(pad, self.pad_positions[:t], b.positions[idx]))
            self.slot_mapping[:t].copy_(torch.where(pad, self.pad_slot_mapping[:t], b.slot_mapping[idx]))
            self.ends[:c].copy_(meta[t:])
            self.ends[c:].fill_(n)
        self.input_ids[t:].zero_()
        self.positions[t:].copy_(self.pad_positions[t:])
        self.slot_mapping[t:].copy_(self.pad_slot_mapping[t:])
        if v:
            self.state_slots[:v].copy_(b.verify_slots)
            self.starts[:v].copy_(b.verify_starts)
            _load_table(self.table[:v], b.verify_block_table, v, self.scratch_page)
        if dec:
            self.state_slots[v:c].copy_(b.decode_slots)
            self.starts[v:c].copy_(b.decode_kv_lens - 1)
            _load_table(self.table[v:c], b.decode_block_table, len(dec), self.scratch_page)
        self.state_slots[c:self.rows].fill_(self.scratch_slot)
        self.starts[c:self.rows].zero_()
        self.table[c:self.rows].fill_(self.scratch_page)

    def order(self, b: ForwardBatch, chunk_row: int) -> tuple[list[int], list[int]]:
        """The graph's token rows and logits rows in the call's order: the call's a-th verify
        row is graph row a (all its real inputs), its q-th decode row graph row v + q (its one
        input), its chunk the graph's rows from ``chunk_row`` on (logits: the chunk's last)."""
        n, rank = self.n, {s: j for j, s in enumerate(b.verify_seqs + b.decode_seqs)}
        rows, logits = [], []
        for i in range(b.num_seqs):
            e = b.cu[i + 1] - b.cu[i]
            if i in rank:
                own = range(rank[i] * n, rank[i] * n + e)
                rows.extend(own)
                logits.extend(own)
            else:
                rows.extend(range(chunk_row, chunk_row + e))
                logits.append(chunk_row)
        return rows, logits


class _StaticVerify:
    """The input buffers of one bucket's verify graph: ``rows`` rows of ``n`` inputs (an input
    and n - 1 drafts each), packed row by row (``_PaddedRows``: a call's verify rows with fewer
    drafts and its plain decode rows padded inside their rows, then padding rows). The kernel
    path's prefill launch reads a prepared ``kernel_meta["multi"]`` over the same buffers (its
    longest row known: n; each row's real queries: ``ends``)."""

    def __init__(self, rows: int, n: int, width: int, device, scratch_page: int, scratch_slot: int):
        from ninfer.native.model.paths import MultiRows
        lt = lambda k, v: torch.full((k,), v, dtype=torch.long, device=device)  # noqa: E731
        t = rows * n
        self.rows, self.n, self.width = rows, n, width
        step = torch.arange(n, dtype=torch.long, device=device)
        pad_positions = step.repeat(rows)
        pad_slot_mapping = scratch_page * PAGE_SIZE + pad_positions
        self.input_ids = lt(t, 0)
        self.positions = pad_positions.clone()
        self.slot_mapping = pad_slot_mapping.clone()
        self.state_slots = lt(rows, scratch_slot)
        self.starts = lt(rows, 0)
        self.ends = lt(rows, n)
        self.block_table = torch.full((rows, width), scratch_page, dtype=torch.long, device=device)
        self.part = _PaddedRows(rows, n, self.input_ids, self.positions, self.slot_mapping, pad_positions,
                                pad_slot_mapping, self.state_slots, self.starts, self.ends, self.block_table,
                                scratch_page, scratch_slot)
        arange = torch.arange(t, dtype=torch.long, device=device)
        empty = lt(0, 0)
        self.batch = ForwardBatch(
            input_ids=self.input_ids, positions=self.positions, cu=list(range(0, t + 1, n)), starts=[0] * rows,
            page_tables=[], state_slots=self.state_slots, slot_mapping=self.slot_mapping, logits_rows=arange,
            verify_seqs=list(range(rows)), decode_rows=empty, decode_slots=empty, decode_kv_lens=empty,
            decode_block_table=empty.view(0, 0), verify_len=n, verify_rows=arange, verify_slots=self.state_slots,
            verify_starts=self.starts, verify_block_table=self.block_table, verify_ends=self.ends)
        self.batch.kernel_meta["multi"] = MultiRows(arange, torch.arange(0, t + 1, n, device=device), self.starts,
                                                     self.block_table, contiguous=True, max_q=n, lens=self.ends)

    def load(self, b: ForwardBatch) -> None:
        self.part.load(b)

    def order(self, b: ForwardBatch) -> tuple[list[int], list[int]] | None:
        """The graph's rows in the call's order (None: they are the call's, as in a uniform call)."""
        return None if self.part.uniform(b, self.n) else self.part.order(b, -1)


class _StaticChunk:
    """The input buffers of one (rows bucket B, row length n, chunk length L) graph: B rows of n
    inputs first — decode rows (n = 1, as ``_Static``) or verify rows (n = 1 + k, as
    ``_StaticVerify``: decode rows beside verify rows padded inside theirs) — then the chunk's L
    rows, real tokens first. Its padding rows write their K/V into the scratch page; its state
    slot is the chunk's own (``PaddedChunk``). One block table holds both parts (the rows', then
    the chunk's), so on the kernel path the verify rows and the chunk are one prefill launch as
    in an eager call."""

    def __init__(self, rows: int, n: int, length: int, width: int, device, scratch_page: int, scratch_slot: int):
        from ninfer.native.model.paths import MultiRows
        lt = lambda k, v: torch.full((k,), v, dtype=torch.long, device=device)  # noqa: E731
        ar = lambda lo, hi: torch.arange(lo, hi, dtype=torch.long, device=device)  # noqa: E731
        m = rows * n
        t = m + length
        self.rows, self.n, self.m, self.length = rows, n, m, length
        self.scratch_page, self.scratch_slot = scratch_page, scratch_slot
        step = ar(0, n).repeat(rows)                 # a padding verify row: positions 0 .. n-1
        self.pad_positions = torch.cat([step, lt(length, 0)])
        self.pad_slot_mapping = scratch_page * PAGE_SIZE + torch.cat([step, ar(0, length) % PAGE_SIZE])
        self.input_ids = lt(t, 0)
        self.positions = self.pad_positions.clone()
        self.slot_mapping = self.pad_slot_mapping.clone()
        self.state_slots = lt(rows + 1, scratch_slot)
        self.starts = lt(rows + 1, 0)                # the rows' starts, then the chunk's
        self.lens = lt(rows + 1, n)                  # the rows' real inputs, then the chunk's
        self.kv_lens = lt(rows, 1)
        # a padding row of the chunk may look up to L - 1 positions past the real end
        self.tables = torch.full((rows + 1, width + -(-length // PAGE_SIZE)), scratch_page, dtype=torch.long,
                                 device=device)
        self.logits_rows = ar(0, m + 1)
        self.chunk = PaddedChunk(length=length, rows=ar(m, t), slot=self.state_slots[rows:], start=self.starts[rows:],
                                 end=self.lens[rows:], valid=torch.zeros(length, dtype=torch.bool, device=device),
                                 block_table=self.tables[rows:])
        verify = n > 1
        empty = lt(0, 0)
        part = ar(0, m)
        common = dict(input_ids=self.input_ids, positions=self.positions, cu=[*range(0, m + 1, n), t],
                      starts=[0] * (rows + 1), page_tables=[], state_slots=self.state_slots,
                      slot_mapping=self.slot_mapping, logits_rows=self.logits_rows, chunk_seqs=[rows],
                      chunk=self.chunk, usual_logits=True)
        if verify:
            self.part = _PaddedRows(rows, n, self.input_ids, self.positions, self.slot_mapping, self.pad_positions,
                                    self.pad_slot_mapping, self.state_slots, self.starts, self.lens[:rows],
                                    self.tables[:rows], scratch_page, scratch_slot)
            self.batch = ForwardBatch(
                **common, verify_seqs=list(range(rows)), decode_rows=empty, decode_slots=empty, decode_kv_lens=empty,
                decode_block_table=empty.view(0, 0), verify_len=n, verify_rows=part,
                verify_slots=self.state_slots[:rows], verify_starts=self.starts[:rows],
                verify_block_table=self.tables[:rows], verify_ends=self.lens[:rows])
            # the kernel path's prefill launch: rows at [0, n, 2n, .., m], the chunk at m, with
            # their real queries (``lens``)
            cu = torch.cat([ar(0, m + 1)[::n], lt(1, t)])
            multi = MultiRows(ar(0, t), cu, self.starts, self.tables, contiguous=True, max_q=max(n, length),
                               lens=self.lens)
        else:
            self.part = None
            self.batch = ForwardBatch(
                **common, decode_seqs=list(range(rows)), decode_rows=part, decode_slots=self.state_slots[:rows],
                decode_kv_lens=self.kv_lens, decode_block_table=self.tables[:rows], decode_kv_slots=None)
            # beside decode rows (they take the decode kernel): the chunk alone, its real queries
            multi = MultiRows(self.chunk.rows, torch.tensor([0, length], device=device), self.chunk.start,
                               self.chunk.block_table, contiguous=rows == 0, max_q=length, lens=self.chunk.end)
        self.batch.kernel_meta["multi"] = multi

    def load(self, b: ForwardBatch) -> None:
        """Every buffer rewritten: the call's decode or verify rows, then padding; its chunk,
        then padding."""
        m = self.m
        (s,) = b.chunk_seqs
        lo, hi = b.cu[s], b.cu[s + 1]
        nr = hi - lo
        if self.part is not None:
            self.part.load(b)
        else:
            c = len(b.decode_seqs)
            for buf, src, pad in ((self.input_ids, b.input_ids, None), (self.positions, b.positions, self.pad_positions),
                                  (self.slot_mapping, b.slot_mapping, self.pad_slot_mapping)):
                if c:
                    buf[:c].copy_(src.index_select(0, b.decode_rows))
                if pad is None:
                    buf[c:m].zero_()
                else:
                    buf[c:m].copy_(pad[c:m])
            self.state_slots[:c].copy_(b.decode_slots)
            self.state_slots[c:self.rows].fill_(self.scratch_slot)
            self.kv_lens[:c].copy_(b.decode_kv_lens)
            self.kv_lens[c:].fill_(1)
            if c:
                _load_table(self.tables[:self.rows], b.decode_block_table, c, self.scratch_page)
            else:
                self.tables[:self.rows].fill_(self.scratch_page)
        for buf, src, pad in ((self.input_ids, b.input_ids, None), (self.positions, b.positions, self.pad_positions),
                              (self.slot_mapping, b.slot_mapping, self.pad_slot_mapping)):
            buf[m:m + nr].copy_(src[lo:hi])
            if pad is None:
                buf[m + nr:].zero_()
            else:
                buf[m + nr:].copy_(pad[m + nr:])
        self.state_slots[self.rows:].copy_(b.state_slots[s:s + 1])
        _load_table(self.chunk.block_table, b.page_tables[s][None], 1, self.scratch_page)
        self.chunk.start.fill_(b.starts[s])
        self.chunk.end.fill_(nr)
        self.chunk.valid[:nr].fill_(True)
        self.chunk.valid[nr:].fill_(False)
        self.logits_rows[m:].fill_(m + nr - 1)

    def order(self, b: ForwardBatch) -> tuple[list[int], list[int]]:
        """The graph's rows and logits rows in the call's order (the call's j-th decode row is
        the graph's j-th, verify rows as ``_PaddedRows.order``, its chunk the graph's rows m ..)."""
        if self.part is not None:
            return self.part.order(b, self.m)
        rows, logits, j = [], [], 0
        for i in range(b.num_seqs):
            if i in b.chunk_seqs:
                rows.extend(range(self.m, self.m + b.cu[i + 1] - b.cu[i]))
                logits.append(self.m)
            else:
                rows.append(j)
                logits.append(j)
                j += 1
        return rows, logits


class _Graph:
    def __init__(self, static, replay: Callable[[], None], out: ForwardOutput):
        self.static, self.replay, self.out = static, replay, out


class GraphRunner:
    """The Program's graphs; ``forward`` replays one when the call's shape has one, else runs
    the model eagerly. ``verify_tokens``: the inputs of a speculating row (1 + k drafts; 0
    without a draft backend) — the verify rows' length; ``chunk_tokens``: the prefill chunk
    budget (0: no "chunk" profile)."""

    def __init__(self, model, cache: ModelCache, backend, max_rows: int, max_context: int,
                 scratch_page: int, scratch_slot: int, taps: tuple[int, ...] = (), verify_tokens: int = 0,
                 chunk_tokens: int = 0):
        self.model, self.cache, self.backend, self.taps = model, cache, backend, taps
        from ninfer.native.model.paths import KERNELS
        self.sizes = buckets(max_rows)
        cap = chunk_cap(model.cfg, fused_moe=model.path is KERNELS)
        self.chunk_sizes = chunk_sizes(chunk_tokens, cap)
        self.width = -(-max_context // PAGE_SIZE)
        self.scratch_page, self.scratch_slot = scratch_page, scratch_slot
        self.verify_tokens = verify_tokens if 1 < verify_tokens <= PAGE_SIZE else 0
        self.plan = plan(max_rows, self.verify_tokens, chunk_tokens, cap)
        self.graphs: dict[tuple[str, int, int, int], _Graph] = {}
        self.stats = GraphStats(backend=backend.name)
        # the verify rows' per-step states: one buffer for every graph (ForwardBatch.spec_steps),
        # allocated outside the graphs' pool; the layout's workspace reserves C x (1 + k) images for it
        self.spec_steps = None
        if self.verify_tokens and cache is not None and cache.ssm.numel():
            ll, _, hv, dk, dv = cache.ssm.shape
            self.spec_steps = torch.empty(ll, max_rows, self.verify_tokens, hv, dk, dv, dtype=cache.ssm.dtype,
                                          device=cache.ssm.device)

    @staticmethod
    def usable(model) -> str:
        """Why this model's forward cannot be captured ('' when it can)."""
        from ninfer.native.model.paths import KERNELS, PER_SEQUENCE
        if model.path is PER_SEQUENCE:
            return "the per-sequence reference path reads its rows' bounds on the host"
        return not_capturable(model.cfg, fused_moe=model.path is KERNELS)

    def capture_all(self) -> None:
        """Every graph of the plan, largest first (smaller graphs reuse its pool)."""
        t0 = time.perf_counter()
        for key in self.plan:
            self._capture(key)
        self.stats.capture_s = time.perf_counter() - t0
        self.stats.buckets = sorted(b for p, b, _, _ in self.graphs if p == DECODE)
        self.stats.verify_buckets = sorted(b for p, b, _, _ in self.graphs if p == VERIFY)
        self.stats.chunk_buckets = sorted([b, n] for p, b, k, n in self.graphs if p == CHUNK and k == 1)
        self.stats.verify_chunk_buckets = sorted([b, n] for p, b, k, n in self.graphs if p == CHUNK and k > 1)

    def _capture(self, key: tuple[str, int, int, int]) -> _Graph:
        profile, rows, n, length = key
        dev, args = self.model.device, (self.scratch_page, self.scratch_slot)
        static = (_Static(rows, self.width, dev, *args) if profile == DECODE else
                  _StaticVerify(rows, n, self.width, dev, *args) if profile == VERIFY else
                  _StaticChunk(rows, n, length, self.width, dev, *args))

        static.batch.spec_steps = self.spec_steps

        def fn() -> ForwardOutput:
            static.batch.spec_states.clear()     # the verify rows' kept states: this run's
            return self.model.forward(static.batch, self.cache, taps=self.taps, static=True, logits=False)
        self._clear_scratch()
        replay, out = self.backend.capture(fn)
        g = self.graphs[key] = _Graph(static, replay, out)
        self._clear_scratch()
        return g

    def _clear_scratch(self) -> None:
        c = self.cache
        if c.conv.numel():
            c.conv[:, self.scratch_slot].zero_()
            c.ssm[:, self.scratch_slot].zero_()

    def _key(self, batch: ForwardBatch, embeds, taps) -> tuple[tuple[str, int, int, int], bool] | None:
        """The graph that may run the call, and whether it pads (None: none may). With verify
        rows every decode and verify row of the call is a row of 1 + k inputs (fewer real ones
        padded inside it)."""
        if (embeds is not None or batch.rope_positions is not None or tuple(taps) != tuple(self.taps)
                or not batch.usual_logits or batch.cuts):        # a chunk with inner cuts: eager
            return None
        n_dec, n_ver = len(batch.decode_seqs), len(batch.verify_seqs)
        if n_dec and batch.decode_block_table.shape[1] > self.width:
            return None
        ragged = False
        if n_ver:
            longest = batch.verify_len or max(batch.cu[s + 1] - batch.cu[s] for s in batch.verify_seqs)
            if longest > self.verify_tokens or batch.verify_block_table.shape[1] > self.width:
                return None
            ragged = not _PaddedRows.uniform(batch, self.verify_tokens)
        members, n = (n_dec + n_ver, self.verify_tokens) if n_ver else (n_dec, 1)
        if not batch.chunk_seqs:
            b = bucket_for(members, self.sizes)
            return ((VERIFY if n_ver else DECODE, b, n, 0), members < b or ragged) if b else None
        if len(batch.chunk_seqs) != 1:
            return None
        (s,) = batch.chunk_seqs
        real = batch.cu[s + 1] - batch.cu[s]
        b, length = bucket_for(members, [0, *self.sizes]), bucket_for(real, self.chunk_sizes)
        if b is None or length is None or batch.page_tables[s].numel() > self.width:
            return None
        return (CHUNK, b, n, length), members < b or ragged or real < length

    def forward(self, batch: ForwardBatch, embeds: torch.Tensor | None, taps: tuple[int, ...]) -> ForwardOutput:
        found = self._key(batch, embeds, taps)
        g = self.graphs.get(found[0]) if found is not None else None
        if g is None:
            self.stats.eager += 1
            return self.model.forward(batch, self.cache, embeds, taps)
        (profile, b, n, _), padded = found
        order = g.static.order(batch) if profile != DECODE else None
        if order is not None:                    # built before the replay: no host wait on it
            dev = g.out.hidden.device
            order = tuple(torch.tensor(x, device=dev) for x in order)
        g.static.load(batch)
        self._clear_scratch()
        g.replay()
        self.stats.replays += 1
        self.stats.padded += padded
        o = g.out
        if batch.verify_seqs:                    # the kept states, for HybridModel.roll_back, by call index
            self.stats.verify_replays += 1
            batch.spec_states = [{s: d[j] for j, s in enumerate(batch.verify_seqs)} for d in g.static.batch.spec_states]
        if profile == CHUNK:
            self.stats.chunk_replays += 1
        if order is not None:
            rows, logits = order
            hidden, all_hidden, taps_out = o.hidden[logits], o.all_hidden[rows], o.taps[rows] if o.taps is not None else None
        else:
            t = (len(batch.verify_seqs) or len(batch.decode_seqs)) * n
            hidden, all_hidden, taps_out = o.hidden[:t], o.all_hidden[:t], o.taps[:t] if o.taps is not None else None
        # the LM head runs outside the graph, on the real rows only: a graph's outputs stay
        # hidden-sized ([rows, H], not [rows, vocab]) in the pool
        return ForwardOutput(hidden=hidden, logits=self.model.logits(hidden), all_hidden=all_hidden, taps=taps_out)
