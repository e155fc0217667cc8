"""Explicit forward metadata and the cache tensors the model reads and writes.

Variable-length convention (defined once, used everywhere): the N sequences of one call are
packed back to back into T tokens::

    input_ids  [T]     seq 0 tokens | seq 1 tokens | ... | seq N-1 tokens
    cu         [N+1]   cu[i] .. cu[i+1] are the rows of sequence i
    starts     [N]     absolute position of sequence i's first row (its execution_frontier)
    positions  [T]     starts[i] + 0 .. q_len-1

A sequence with q_len == 1 is a decode row (batched recurrent step); longer ones are prefill
or replay chunks (chunked form), or *verify* rows (``SeqInput.verify``: a committed input and
its drafts, recurrent form, every step's state kept in ``spec_states`` so the caller can roll
the state back to the last accepted position). Either way the state in ``state_slots[i]`` is read as the
initial state and overwritten with the final state, and the new K/V are written to the pages
of ``page_tables[i]`` before attention reads them.

The decode rows also get padded, batch-wide index tensors, built once per call and read by
every layer (the batched path computes all of them with one op per step, no Python loop)::

    decode_rows         [B]        token row of decode row b in the packed T
    decode_slots        [B]        its state slot
    decode_kv_lens      [B]        keys it attends: start + 1
    decode_block_table  [B, Pmax]  its first ceil(kv_len / 64) pages, padded with its own
                                   first page (padding is masked, never read as a key)
    decode_kv_slots     [B, Lmax]  the flat slot of each of its keys, Lmax = max kv_len
                                   (``attention.decode_kv_slots``: the gather index)

Verify rows of one length n (the usual case: every speculating row carries k drafts) get the
same treatment, so their attention and GDN run as one op per step too::

    verify_rows         [V * n]    their token rows, row by row
    verify_slots        [V]        their state slots
    verify_starts       [V]        the position of each one's first input
    verify_block_table  [V, Pmax]  their pages up to start + n, padded with their first page

(``verify_slots``, ``verify_starts`` and ``verify_block_table`` — each row's pages up to its own
end — exist for verify rows of mixed lengths too; ``verify_len`` and ``verify_rows`` only for
one length.) A CUDA graph's verify rows are all padded to n = 1 + k: ``verify_ends`` [V] holds
each one's real inputs (a row with fewer drafts, or a plain decode row beside verify rows, has
fewer than n); its padding inputs come after the real ones, write their K/V into the scratch
page and are masked out of the GDN, so the row's outputs and states are the unpadded row's.

A CUDA graph's "chunk" profile (native/graphs.py) runs the call's one prefill/replay chunk
padded to a fixed length L, described by ``ForwardBatch.chunk`` (a ``PaddedChunk``): its real
length and start live in tensors, not in ``cu`` / ``starts``, so one capture serves every
chunk of up to L tokens. The paths then take the chunk's attention as one verify-shaped row of
L queries and its GDN with the padding rows masked out (``paths._gdn_padded``).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field

import torch

from ninfer.native.model.attention import decode_kv_slots
from ninfer.native.model.config import PAGE_SIZE, ModelConfig


@dataclass
class SeqInput:
    """One sequence's slice of a call."""

    token_ids: list[int]
    start: int                      # positions start .. start + len(token_ids) - 1
    page_table: list[int]           # covers at least start + len(token_ids) positions
    state_slot: int = 0             # row of the state tensors (ignored for pure attention)
    logits: str = "last"            # "last" | "all" | "none"
    # Qwen3.5 MRoPE: rotary positions [3, len(token_ids)] (t, h, w rows: mrope.mrope_positions, or
    # start + delta on all rows when decoding after an image); None = start .. end - 1 on all rows
    rope_positions: torch.Tensor | None = None
    verify: bool = False            # a speculative verify row (see the module docstring)
    # positions strictly inside the chunk (start < p < start + len) whose GDN and conv states the
    # call keeps besides the final one (``ForwardBatch.cut_states``): an inner save's image
    cuts: list[int] = field(default_factory=list)


@dataclass
class PaddedChunk:
    """One chunk of n real tokens padded to ``length`` = L rows (a graph's static chunk).

    rows         [L]       its token rows in the packed T, real ones first
    slot         [1]       its state slot
    start        [1]       the position of its first token
    end          [1]       n: the real rows are 0 .. n-1
    valid        [L] bool  row < n
    block_table  [1, W]    its pages, padded with its first page past its own; W * 64 >= start + L
                           (a padding row's queries may look past the real end: never a real row's)

    Padding rows write their K/V into the scratch page and are masked out of the GDN (their
    rate beta and log decay zero: the state passes them unchanged); the conv state is taken at
    the real end."""

    length: int
    rows: torch.Tensor
    slot: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    valid: torch.Tensor
    block_table: torch.Tensor


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor         # [T] long
    positions: torch.Tensor         # [T] long
    cu: list[int]                   # [N+1]
    starts: list[int]               # [N]
    page_tables: list[torch.Tensor]  # N x [n_pages] long
    state_slots: torch.Tensor       # [N] long
    slot_mapping: torch.Tensor      # [T] long, flat KV slot of every new token
    logits_rows: torch.Tensor       # [M] long, rows whose hidden/logits are returned
    decode_seqs: list[int] = field(default_factory=list)   # sequences with q_len == 1
    chunk_seqs: list[int] = field(default_factory=list)    # sequences with q_len > 1 (not verify)
    verify_seqs: list[int] = field(default_factory=list)   # verify rows (q_len > 1)
    decode_rows: torch.Tensor | None = None          # [B] long (see the module docstring)
    decode_slots: torch.Tensor | None = None         # [B] long
    decode_slot_run: slice | None = None             # decode_slots as one ascending run (``slot_run``), else None
                                                     # (a graph's static batch: None, its slots change per replay)
    decode_kv_lens: torch.Tensor | None = None       # [B] long
    decode_block_table: torch.Tensor | None = None   # [B, Pmax] long
    decode_kv_slots: torch.Tensor | None = None      # [B, Lmax] long
    verify_len: int = 0                              # n when every verify row has n inputs, else 0
    verify_rows: torch.Tensor | None = None          # [V * n] long (see the module docstring)
    verify_slots: torch.Tensor | None = None         # [V] long
    verify_starts: torch.Tensor | None = None        # [V] long
    verify_block_table: torch.Tensor | None = None   # [V, Pmax] long
    verify_ends: torch.Tensor | None = None          # [V] long: real inputs per row (a graph's); None: all n
    # [3, T] long: MRoPE rotary rows (t, h, w), read only by a model with mrope_section, and only
    # set when some sequence gave SeqInput.rope_positions (text-only batches keep None: bit-identical)
    rope_positions: torch.Tensor | None = None
    # filled by the GDN layers for the verify rows, one dict per linear layer (cache order):
    # verify index s -> (conv state before [C, K-1], pre-conv inputs [T, C], states after each step [T, Hv, Dk, Dv])
    spec_states: list[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    # [Ll, R, n, Hv, Dk, Dv] (state dtype): where the verify rows' per-step states go instead of a
    # new tensor per call — the one buffer every graph of a Program shares (graphs.GraphRunner),
    # so each captured graph does not keep its own (13.8 GiB over 21 graphs for Qwen3-Next at
    # k = 3). Valid until the next forward, as the kept states are (the roll-back reads them first).
    spec_steps: torch.Tensor | None = None
    # a chunk's inner cuts (``SeqInput.cuts``): sequence index -> row offsets inside it, in order;
    # its GDN runs segment by segment as separate units would (conv, then the chunked rule, from
    # the state the previous segment left), and each GDN layer appends to ``cut_states``
    # {sequence index: [(conv state, ssm state) at each cut]} (state dtypes; cache order)
    cuts: dict[int, list[int]] = field(default_factory=dict)
    cut_states: list[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)
    # per-call metadata a forward path builds once and every layer reuses (paths.KernelPath)
    kernel_meta: dict = field(default_factory=dict)
    # the chunk of ``chunk_seqs`` padded to a static length (a graph's "chunk" profile; see the
    # module docstring); None: the chunk's rows are ``cu`` / ``starts`` as usual
    chunk: PaddedChunk | None = None
    # the logits rows Program.execute asks for: a verify row's every row, another sequence's
    # last row (the graphs' static logits rows assume it)
    usual_logits: bool = False

    @property
    def all_decode(self) -> bool:
        """Every sequence is a decode row: rows 0..B-1 are the decode rows, in order."""
        return not self.chunk_seqs and not self.verify_seqs

    @property
    def multi_seqs(self) -> list[int]:
        """Sequences with several query rows (chunks and verify rows): attention one by one."""
        return sorted(self.chunk_seqs + self.verify_seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    @staticmethod
    def build(seqs: list[SeqInput], device: torch.device | str = "cpu") -> "ForwardBatch":
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        cu = [0]
        for s in seqs:
            n = len(s.token_ids)
            if n == 0:
                raise ValueError("a sequence in a forward batch needs at least one token")
            end = s.start + n
            if len(s.page_table) * PAGE_SIZE < end:
                raise ValueError(f"page table of {len(s.page_table)} pages cannot hold position {end - 1}")
            base = cu[-1]
            ids.extend(s.token_ids)
            pos.extend(range(s.start, end))
            p = s.start
            while p < end:              # a page's run of slots at a time (a chunk: ~T / 64 runs)
                off = p % PAGE_SIZE
                run = min(PAGE_SIZE - off, end - p)
                first = s.page_table[p // PAGE_SIZE] * PAGE_SIZE + off
                slots.extend(range(first, first + run))
                p += run
            if s.cuts and (s.verify or n == 1 or not all(s.start < p < end for p in s.cuts)
                           or sorted(set(s.cuts)) != list(s.cuts)):
                raise ValueError(f"cuts {s.cuts} must lie strictly inside the chunk [{s.start}, {end}), in order")
            if s.logits == "all":
                rows.extend(range(base, base + n))
            elif s.logits == "last":
                rows.append(base + n - 1)
            cu.append(base + n)
        stage = _Staging()
        lt = stage.add
        decode = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        decode_slots = [seqs[i].state_slot for i in decode]
        tables = [seqs[i].page_table[:seqs[i].start // PAGE_SIZE + 1] for i in decode]
        width = max((len(t) for t in tables), default=0)
        block_table = lt([x for t in tables for x in t + t[:1] * (width - len(t))], (len(decode), width))
        kv_lens = lt([seqs[i].start + 1 for i in decode])
        max_len = max((seqs[i].start + 1 for i in decode), default=0)
        verify = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1 and s.verify]
        lens = {len(seqs[i].token_ids) for i in verify}
        vmeta = {}
        if verify:
            vt = [seqs[i].page_table[:(seqs[i].start + len(seqs[i].token_ids) + PAGE_SIZE - 1) // PAGE_SIZE]
                  for i in verify]
            vw = max(len(t) for t in vt)
            vmeta = dict(verify_slots=lt([seqs[i].state_slot for i in verify]),
                         verify_starts=lt([seqs[i].start for i in verify]),
                         verify_block_table=lt([x for t in vt for x in t + t[:1] * (vw - len(t))], (len(verify), vw)))
        if len(lens) == 1:
            (n,) = lens
            vmeta.update(verify_rows=lt([r for i in verify for r in range(cu[i], cu[i] + n)]))
        rope = None
        if any(s.rope_positions is not None for s in seqs):
            rope_rows = []
            for s in seqs:
                n = len(s.token_ids)
                r = s.rope_positions
                if r is None:
                    r = torch.arange(s.start, s.start + n).expand(3, -1)
                elif tuple(r.shape) != (3, n):
                    raise ValueError(f"rope_positions of shape {tuple(r.shape)} for {n} tokens (need [3, {n}])")
                rope_rows.append(r.to(torch.long))
            rope = torch.cat(rope_rows, dim=1).to(device)
        fields = dict(
            input_ids=lt(ids),
            positions=lt(pos),
            page_tables=[lt(s.page_table) for s in seqs],
            state_slots=lt([s.state_slot for s in seqs]),
            slot_mapping=lt(slots),
            logits_rows=lt(rows),
            **vmeta,
            decode_rows=lt([cu[i] for i in decode]),
            decode_slots=lt(decode_slots),
            decode_kv_lens=kv_lens,
            decode_block_table=block_table,
        )
        fields = stage.upload(fields, device)          # one copy for all of them
        return ForwardBatch(
            cu=cu,
            starts=[s.start for s in seqs],
            decode_seqs=decode,
            chunk_seqs=[i for i, s in enumerate(seqs) if len(s.token_ids) > 1 and not s.verify],
            verify_seqs=verify,
            verify_len=next(iter(lens)) if len(lens) == 1 else 0,
            decode_kv_slots=decode_kv_slots(fields["decode_block_table"], fields["decode_kv_lens"], max_len),
            decode_slot_run=slot_run(decode_slots),
            rope_positions=rope,
            cuts={i: [p - s.start for p in s.cuts] for i, s in enumerate(seqs) if s.cuts},
            usual_logits=all(s.logits == ("all" if s.verify else "last") for s in seqs),
            **fields,
        )


def slot_run(slots: list[int]) -> slice | None:
    """The slice of state slots ``slots`` is when it names one ascending run (lo, lo + 1, ..., in
    row order: a decode batch's usual slots, and any single row), else None (none for no rows)."""
    if not slots:
        return None
    lo = slots[0]
    return slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None


class _Staging:
    """A call's index tensors in one host buffer and one upload (pinned, asynchronous on CUDA)
    instead of one blocking copy each (~10 + one per sequence per call): ``add`` takes a list
    and gives a placeholder, ``upload`` replaces every placeholder by its view of the device
    copy. A placeholder is the index of its part."""

    def __init__(self):
        self.values: list[int] = []
        self.parts: list[tuple[int, int, tuple[int, ...]]] = []

    def add(self, xs: list[int], shape: tuple[int, ...] | None = None) -> int:
        self.parts.append((len(self.values), len(xs), shape or (len(xs),)))
        self.values.extend(xs)
        return len(self.parts) - 1

    def upload(self, fields: dict, device) -> dict:
        device = torch.device(device)
        # through an int64 array: ~3x faster than torch.tensor(list) (a 2,000-token chunk's ~6,000
        # indices 0.42 -> 0.14 ms); the tensor keeps the array alive
        host = (torch.frombuffer(array.array("q", self.values), dtype=torch.long) if self.values
                else torch.empty(0, dtype=torch.long))
        if device.type == "cuda":
            host = host.pin_memory()
        flat = host.to(device, non_blocking=True)
        views = [flat[lo:lo + n].view(shape) for lo, n, shape in self.parts]

        def get(v):
            return [views[i] for i in v] if isinstance(v, list) else views[v] if isinstance(v, int) else v
        return {k: get(v) for k, v in fields.items()}


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recurrent-state storage dtype: fp32 unless the model runs in fp64 (mamba_ssm_dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class ModelCache:
    """The tensors a forward pass reads and writes.

    k, v:  [La, P, 64, Hkv, D]      Main KV pages of the La attention layers
    conv:  [Ll, S, C, K-1]          conv states of the Ll GDN layers, per state slot
    ssm:   [Ll, S, Hv, Dk, Dv]      recurrent states, per state slot (fp32 / fp64)
    """

    k: torch.Tensor
    v: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor

    @staticmethod
    def allocate(cfg: ModelConfig, num_pages: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> "ModelCache":
        la, ll = len(cfg.attention_layers), len(cfg.linear_layers)
        kv_shape = (la, num_pages, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        conv_shape = (ll, num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
        ssm_shape = (ll, num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
        return ModelCache(
            k=torch.zeros(kv_shape, dtype=dtype, device=device),
            v=torch.zeros(kv_shape, dtype=dtype, device=device),
            conv=torch.zeros(conv_shape, dtype=dtype, device=device),
            ssm=torch.zeros(ssm_shape, dtype=state_dtype(dtype), device=device),
        )

    def reset_slot(self, slot: int) -> None:
        """Zero a state slot: the state of an empty prefix (position 0)."""
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()


@dataclass
class ForwardOutput:
    hidden: torch.Tensor   # [M, H] pre-final-norm hidden of the logits rows (continuation hidden)
    logits: torch.Tensor   # [M, V] in the accumulation dtype
    all_hidden: torch.Tensor | None = None   # [T, H] pre-final-norm hidden of every row (the MTP head's input)
    taps: torch.Tensor | None = None         # [T, n*H] the asked layers' outputs, every row (DFlash context)
