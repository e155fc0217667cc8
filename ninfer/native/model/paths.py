"""How the mixers of one call are computed over its sequences: batched (default) or one
sequence at a time (the reference beside it).

Both paths take the same inputs and must give the same result — in float64 to rounding
(tests/native/model/test_batched_forward.py) — so the per-sequence path is the oracle of the
batched one, as ``reference_generate`` is the oracle of the engine:

* ``BATCHED`` — all decode rows of a call in one op per step: attention over a padded block
  table (``decode_attention``), conv step and recurrent delta rule over states gathered from
  their slots and scattered back (``index_select`` / ``index_copy_``). The one prefill/replay
  chunk a call may carry goes through the chunk ops (``paged_attention``,
  ``chunk_gated_delta_rule``).
* Verify rows (a committed input and its drafts) of one length go through one batched
  attention op (``verify_attention``; the per-sequence attention on ``PER_SEQUENCE``) and
  through the recurrent GDN form with every step's state kept (``_gdn_verify``): a verify row
  is the decode math over several steps, so its tokens equal decoding them one by one.
* ``CPU`` — ``BATCHED`` with the fused CPU forms of the chunk ops (``cpu_ops``): what a CPU
  model in fp32 / bf16 / fp16 runs. Equal to ``BATCHED`` to the dtype's rounding, not bit for bit,
  so a float64 model (the oracle's dtype) keeps ``BATCHED``.
* ``PER_SEQUENCE`` — every sequence alone, decode rows included, with the same per-sequence
  ops. Slow; kept for tests and for the decode benchmark's comparison.
* ``KERNELS`` — the batched path on ``native/kernels``: the Triton paged attention reading the
  page tables directly (decode rows split-K, chunk and verify rows in one prefill launch over
  their cached prefixes), the Triton KV write by slot mapping, the fused RMSNorms
  (``kernels/norms.py``), the fused MoE for decode-sized calls and graphs (``kernels/moe.py``),
  and the GDN ops through
  ``kernels.gdn`` (fla-core's kernels on CUDA when installed, the reference otherwise). It is
  what a CUDA model in fp32/fp16/bf16 runs (``for_device``); on the CPU the tests run it under
  ``TRITON_INTERPRET=1`` against ``BATCHED``.

A path is chosen per model (``HybridModel.path``, by ``for_device``); nothing else reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from ninfer.native.model import cpu_ops, gdn
from ninfer.native.model.attention import decode_attention, paged_attention, verify_attention, write_kv
from ninfer.native.model.forward import ForwardBatch
from ninfer.native.model.moe import MoeWeights, sparse_moe
from ninfer.native.model.ops import gated_rms_norm, rms_norm

Split = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class ForwardPath(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
        """``ops.rms_norm``'s contract."""
        ...

    def moe(self, x: torch.Tensor, w: MoeWeights, static: bool) -> torch.Tensor:
        """``moe.sparse_moe``'s contract; ``static``: inside a CUDA graph's capture (no
        data-dependent shapes)."""
        ...

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``ops.gated_rms_norm``'s contract."""
        ...

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        """The new keys / values of the call into their flat slots (``batch.slot_mapping``)."""
        ...

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Causal attention of every row over its sequence's paged KV (new K/V already written).

        q: [T, H, D]; k_cache, v_cache: [P, 64, Hkv, D]. Returns [T, H, D] in q's dtype."""
        ...

    def gdn(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_w: torch.Tensor,
            conv_states: torch.Tensor, ssm_states: torch.Tensor, batch: ForwardBatch,
            split: Split) -> torch.Tensor:
        """Conv + gated delta rule of every row, continuing from and updating the states.

        mixed: [T, C] pre-conv q|k|v; g, beta: [T, Hv]; conv_w: [C, K];
        conv_states: [S, C, K-1] and ssm_states: [S, Hv, Dk, Dv], rows ``batch.state_slots``
        read as initial and overwritten with final states; ``split`` cuts the conv output
        [N, C] into q, k: [N, Hk, Dk] and v: [N, Hv, Dv]. Returns the core output [T, Hv, Dv]
        in mixed's dtype."""
        ...


def _attention_alone(out, q, k_cache, v_cache, batch, scale, seqs, op=paged_attention) -> None:
    """Each of ``seqs`` by itself (``paged_attention``, or ``op`` of its contract), into its rows of ``out``."""
    for s in seqs:
        lo, hi = batch.cu[s], batch.cu[s + 1]
        out[lo:hi] = op(q[lo:hi], k_cache, v_cache, batch.page_tables[s], batch.starts[s], scale)


def _gdn_alone(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split, seqs, ops=gdn) -> None:
    """Each of ``seqs`` by itself: a chunk in the chunked form, a decode row in the recurrent
    form with N = 1; its rows of ``core`` and its state slot are written. A chunk with inner cuts
    (``batch.cuts``) keeps the state at each cut (``batch.cut_states``): in one pass where the ops
    can (``_chunk_cut_pass``), else segment by segment."""
    cut: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for s in seqs:
        lo, hi = batch.cu[s], batch.cu[s + 1]
        slot = int(batch.state_slots[s])
        if hi - lo == 1:   # a decode row computed alone (the per-sequence path)
            y, new_conv = ops.causal_conv1d_step(mixed[lo:hi], conv_states[slot:slot + 1], conv_w)
            q, k, v = split(y)
            o, new_ssm = ops.recurrent_gated_delta_rule(
                q[:, None], k[:, None], v[:, None], g[lo:hi, None], beta[lo:hi, None], ssm_states[slot:slot + 1])
            core[lo:hi], new_conv, new_ssm = o[:, 0], new_conv[0], new_ssm[0]
        elif batch.cuts.get(s) and hasattr(ops, "chunk_delta_rule_cuts"):
            core[lo:hi], new_conv, new_ssm, kept = _chunk_cut_pass(
                ops, mixed[lo:hi], conv_states[slot], ssm_states[slot], conv_w, g[lo:hi], beta[lo:hi], split,
                batch.cuts[s])
            cut[s] = [(c.to(conv_states.dtype), h.to(ssm_states.dtype)) for c, h in kept]
        else:
            new_conv, new_ssm = conv_states[slot], ssm_states[slot]
            a, kept = lo, []
            for b in (*(lo + c for c in batch.cuts.get(s, ())), hi):
                # each segment as its own unit would run it: from the state the last one stored
                y, new_conv = ops.causal_conv1d(mixed[a:b], new_conv, conv_w)
                q, k, v = split(y)
                core[a:b], new_ssm = ops.chunk_gated_delta_rule(q, k, v, g[a:b], beta[a:b], new_ssm)
                new_conv, new_ssm = new_conv.to(conv_states.dtype), new_ssm.to(ssm_states.dtype)
                if b < hi:
                    kept.append((new_conv, new_ssm))
                a = b
            if kept:
                cut[s] = kept
        conv_states[slot] = new_conv.to(conv_states.dtype)
        ssm_states[slot] = new_ssm.to(ssm_states.dtype)
    if batch.cuts:
        batch.cut_states.append(cut)


def _chunk_cut_pass(ops, x, conv0, ssm0, conv_w, g, beta, split, cuts):
    """A chunk with inner cuts in one pass (ops with ``chunk_delta_rule_cuts``: the CPU's): one
    conv over the chunk (row by row the same arithmetic as segment by segment), the conv state at
    a cut r the K-1 inputs before it, the delta rule's states at the cuts from the same pass.
    Returns the chunk's outputs, its final conv and delta-rule states, and (conv, state) per cut."""
    y, new_conv = ops.causal_conv1d(x, conv0, conv_w)
    k1 = conv0.shape[1]

    def conv_at(r: int) -> torch.Tensor:        # the K-1 inputs before r: [C, K-1]
        if r >= k1:
            return x[r - k1:r].t().contiguous()
        return torch.cat([conv0[:, r:].to(x.dtype), x[:r].t()], dim=1)

    q, k, v = split(y)
    o, new_ssm, at = ops.chunk_delta_rule_cuts(q, k, v, g, beta, ssm0, cuts)
    return o, new_conv, new_ssm, [(conv_at(r), h) for r, h in zip(cuts, at)]


def _gdn_padded(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split, ops=gdn) -> None:
    """The padded chunk of a graph's "chunk" profile (``ForwardBatch.chunk``): conv over all L
    rows (causal: a real row never sees a padding row), the new conv state gathered at the real
    end, the padding rows' rate (beta) and log decay set to zero — the delta rule's write is
    beta-weighted and exp(0) = 1, so the state passes them unchanged, and a real row's output
    never reads a later row — then the chunked form over L rows from the slot's state."""
    c = batch.chunk
    x = mixed.index_select(0, c.rows)                                          # [L, C]
    conv0 = conv_states.index_select(0, c.slot)[0]                             # [C, K-1]
    y, _ = ops.causal_conv1d(x, conv0, conv_w)
    k1 = conv0.shape[1]
    xs = torch.cat([conv0.to(x.dtype), x.t()], dim=1)                          # [C, K-1+L]
    new_conv = xs.index_select(1, c.end + torch.arange(k1, device=x.device))   # inputs n .. n+K-2 of xs
    keep = c.valid[:, None]
    zero = lambda t: torch.where(keep, t.index_select(0, c.rows), torch.zeros((), dtype=t.dtype, device=t.device))  # noqa: E731
    q, k, v = split(y)
    o, new_ssm = ops.chunk_gated_delta_rule(q, k, v, zero(g), zero(beta), ssm_states.index_select(0, c.slot)[0])
    core.index_copy_(0, c.rows, o)
    conv_states.index_copy_(0, c.slot, new_conv[None].to(conv_states.dtype))
    ssm_states.index_copy_(0, c.slot, new_ssm[None].to(ssm_states.dtype))


def _gdn_chunks(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split, ops=gdn) -> None:
    """The call's chunk: padded to a graph's length, or alone at its own."""
    if batch.chunk is not None:
        _gdn_padded(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split, ops)
    else:
        _gdn_alone(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split, batch.chunk_seqs, ops)


def _gdn_verify(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split) -> None:
    """The verify rows: conv over each row, the recurrent delta rule with every step's state kept
    in ``batch.spec_states`` (one dict per call = per linear layer); the final states are written
    like any row's (``HybridModel.roll_back`` replaces them when a draft is rejected). Rows of one
    length run as one batch (usually all of them: every row carries k drafts). A graph's padded
    rows (``batch.verify_ends``): the padding inputs' rate and log decay are zero, so the state
    passes them unchanged (the final state and the kept steps from the real end on are the real
    end's), and the conv state is taken at each row's real end."""
    kept = {}
    buf, layer, off = batch.spec_steps, len(batch.spec_states), 0
    if batch.verify_len:       # one length: the batch's own index tensors (no host-built index)
        groups = [(batch.verify_len, batch.verify_seqs, batch.verify_rows, batch.verify_slots)]
    else:
        by_len: dict[int, list[int]] = {}
        for s in batch.verify_seqs:
            by_len.setdefault(batch.cu[s + 1] - batch.cu[s], []).append(s)
        groups = [(n, seqs, torch.cat([torch.arange(batch.cu[s], batch.cu[s] + n) for s in seqs]).to(mixed.device),
                   batch.state_slots[seqs]) for n, seqs in by_len.items()]
    for n, seqs, rows, slots in groups:
        conv0 = conv_states.index_select(0, slots)                                # [N, C, K-1]
        x = mixed.index_select(0, rows).view(len(seqs), n, -1)                    # [N, T, C]
        xs = torch.cat([conv0.to(x.dtype), x.transpose(1, 2)], dim=2)             # [N, C, K-1+T]
        y = F.silu(F.conv1d(xs, conv_w[:, None, :], groups=conv_w.shape[0])).transpose(1, 2)   # [N, T, C]
        q, k, v = split(y.reshape(len(seqs) * n, -1))
        shape = lambda t: t.view(len(seqs), n, *t.shape[1:])                      # noqa: E731
        gv, bv = g.index_select(0, rows).view(len(seqs), n, -1), beta.index_select(0, rows).view(len(seqs), n, -1)
        k1 = conv0.shape[2]
        ends = batch.verify_ends
        if ends is not None:
            real = (torch.arange(n, device=mixed.device)[None, :] < ends[:, None])[:, :, None]   # [N, T, 1]
            gv, bv = (torch.where(real, t, torch.zeros((), dtype=t.dtype, device=t.device)) for t in (gv, bv))
            at = (ends[:, None, None] + torch.arange(k1, device=mixed.device)).expand(-1, xs.shape[1], -1)
            new_conv = xs.gather(2, at)                                           # inputs end .. end+K-2 of xs
        else:
            new_conv = xs[:, :, xs.shape[2] - k1:]
        o, new_ssm, steps = gdn.recurrent_gated_delta_rule(
            shape(q), shape(k), shape(v), gv, bv, ssm_states.index_select(0, slots), keep_steps=True)
        if buf is not None and off + len(seqs) <= buf.shape[1] and n <= buf.shape[2]:
            view = buf[layer, off:off + len(seqs), :n]           # the shared buffer, not a new tensor
            view.copy_(steps)
            steps, off = view, off + len(seqs)
        core.index_copy_(0, rows, o.reshape(len(seqs) * n, *o.shape[2:]))
        conv_states.index_copy_(0, slots, new_conv.to(conv_states.dtype))
        ssm_states.index_copy_(0, slots, new_ssm.to(ssm_states.dtype))
        for i, s in enumerate(seqs):
            kept[s] = (conv0[i], x[i], steps[i])
    batch.spec_states.append(kept)


def _core_out(mixed: torch.Tensor, ssm_states: torch.Tensor) -> torch.Tensor:
    """An empty [T, Hv, Dv] core output in the model dtype."""
    return mixed.new_empty(mixed.shape[0], ssm_states.shape[1], ssm_states.shape[3])


class _TorchOps:
    """The per-row ops both torch paths share (``KernelPath`` replaces them with kernels)."""

    def write_kv(self, k_cache, v_cache, slots, k, v):
        write_kv(k_cache, v_cache, slots, k, v)

    rms_norm = staticmethod(rms_norm)
    gated_rms_norm = staticmethod(gated_rms_norm)

    def moe(self, x, w, static):
        return sparse_moe(x, w, static)           # grouped by expert; dense over experts in a graph

    def _gdn_ops(self):
        """The module of GDN ops this path calls (the torch reference here)."""
        return gdn


class BatchedPath(_TorchOps):
    name = "batched"
    chunk_attention = staticmethod(paged_attention)       # one chunk's queries over its paged KV
    decode_attention = staticmethod(decode_attention)     # the decode rows' one query each

    def attention(self, q, k_cache, v_cache, batch, scale):
        if batch.all_decode:
            return self.decode_attention(q, k_cache, v_cache, batch.decode_block_table, batch.decode_kv_lens,
                                         scale, batch.decode_kv_slots)
        out = torch.empty_like(q)
        if batch.decode_seqs:
            rows = batch.decode_rows
            out.index_copy_(0, rows, self.decode_attention(q.index_select(0, rows), k_cache, v_cache,
                                                           batch.decode_block_table, batch.decode_kv_lens, scale,
                                                           batch.decode_kv_slots))
        if batch.verify_len:                      # the verify rows in one op, the chunk alone
            rows = batch.verify_rows
            ends = batch.verify_starts + batch.verify_ends if batch.verify_ends is not None else None
            out.index_copy_(0, rows, verify_attention(q.index_select(0, rows), k_cache, v_cache,
                                                      batch.verify_block_table, batch.verify_starts,
                                                      batch.verify_len, scale, ends))
        elif batch.verify_seqs:
            _attention_alone(out, q, k_cache, v_cache, batch, scale, batch.verify_seqs)
        if batch.chunk is not None:               # a graph's padded chunk: one row of L queries
            c = batch.chunk
            out.index_copy_(0, c.rows, verify_attention(q.index_select(0, c.rows), k_cache, v_cache,
                                                        c.block_table, c.start, c.length, scale, c.start + c.end))
        else:
            _attention_alone(out, q, k_cache, v_cache, batch, scale, batch.chunk_seqs, self.chunk_attention)
        return out

    def gdn(self, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split):
        ops = self._gdn_ops()
        if not batch.decode_seqs:
            core = _core_out(mixed, ssm_states)
            _gdn_chunks(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split, ops)
            if batch.verify_seqs:
                _gdn_verify(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split)
            return core
        rows, slots = batch.decode_rows, batch.decode_slots
        pick = (lambda t: t) if batch.all_decode else (lambda t: t.index_select(0, rows))
        o = self._decode_rows(pick(mixed), pick(g), pick(beta), conv_w, conv_states, ssm_states, slots, split, ops,
                              batch.decode_slot_run)
        if batch.all_decode:
            return o
        core = _core_out(mixed, ssm_states)
        core.index_copy_(0, rows, o)
        _gdn_chunks(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split, ops)
        if batch.verify_seqs:
            _gdn_verify(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split)
        return core


    def _decode_rows(self, mixed, g, beta, conv_w, conv_states, ssm_states, slots, split, ops, run=None):
        """The decode rows' conv step and delta-rule step, their states gathered from their slots
        and scattered back. mixed: [B, C]; g, beta: [B, Hv] -> o [B, Hv, Dv]. ``run``: the slots
        as one ascending run (``ForwardBatch.decode_slot_run``), for a path that uses it."""
        y, new_conv = ops.causal_conv1d_step(mixed, conv_states.index_select(0, slots), conv_w)
        q, k, v = split(y)
        o, new_ssm = ops.recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], ssm_states.index_select(0, slots))
        conv_states.index_copy_(0, slots, new_conv.to(conv_states.dtype))
        ssm_states.index_copy_(0, slots, new_ssm.to(ssm_states.dtype))
        return o[:, 0]


class CpuPath(BatchedPath):
    """``BatchedPath`` with the fast CPU forms of its chunk ops (``cpu_ops``): what a CPU model in
    fp32 / bf16 / fp16 runs (``for_device``). Same results to the dtype's rounding, not bit for
    bit, so float64 — the oracle's dtype — keeps ``BATCHED``."""

    name = "cpu"
    chunk_attention = staticmethod(cpu_ops.chunk_attention)
    decode_attention = staticmethod(cpu_ops.decode_attention)
    rms_norm = staticmethod(cpu_ops.rms_norm)
    gated_rms_norm = staticmethod(cpu_ops.gated_rms_norm)

    def _gdn_ops(self):
        return cpu_ops.gdn_ops()

    def _decode_rows(self, mixed, g, beta, conv_w, conv_states, ssm_states, slots, split, ops, run=None):
        """``BatchedPath._decode_rows`` in fewer calls: the conv step's new state written from a
        view (no copy), q and k normalised together, the delta-rule state stepped in place — in
        the cache's own view where the slots are one ascending run (``cpu_ops.delta_rule_step_slots``)."""
        y = cpu_ops.conv_step_slots(mixed, conv_states, slots, conv_w)
        q, _, v = split(y)
        qk = y[:, :2 * q.shape[1] * q.shape[2]].view(y.shape[0], 2 * q.shape[1], q.shape[2])
        step = getattr(ops, "delta_rule_step_slots", cpu_ops.delta_rule_step_slots)
        return step(qk, v, g, beta, ssm_states, slots, run)

    def moe(self, x, w, static):
        if static:
            return sparse_moe(x, w, static)
        if cpu_ops.takes_dense_moe(x, w):
            return cpu_ops.dense_moe(x, w)         # few rows: two matmuls over all experts
        return cpu_ops.grouped_moe(x, w)           # grouped by expert, fewer passes


class PerSequencePath(_TorchOps):
    name = "per_sequence"

    def attention(self, q, k_cache, v_cache, batch, scale):
        out = torch.empty_like(q)
        _attention_alone(out, q, k_cache, v_cache, batch, scale, range(batch.num_seqs))
        return out

    def gdn(self, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split):
        core = _core_out(mixed, ssm_states)
        alone = [s for s in range(batch.num_seqs) if s not in batch.verify_seqs]
        _gdn_alone(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split, alone)
        if batch.verify_seqs:
            _gdn_verify(core, mixed, g, beta, conv_w, conv_states, ssm_states, batch, split)
        return core


class MultiRows:
    """The chunk and verify rows of a call as one packed prefill launch: their token rows, the
    relative ``cu_seqlens``, absolute starts and a page table padded to the widest of them;
    ``contiguous``: they are all of the call's rows (q is the launch's own); ``max_q``: the
    longest one's queries when known (else the kernel reads it from ``cu``); ``lens``: each one's
    real queries when fewer than its ``cu`` span (a graph's padded rows)."""

    def __init__(self, rows, cu, starts, tables, contiguous: bool, max_q: int | None = None, lens=None):
        self.rows, self.cu, self.starts, self.tables = rows, cu, starts, tables
        self.contiguous, self.max_q, self.lens = contiguous, max_q, lens

    @classmethod
    def of(cls, batch: ForwardBatch, device) -> "MultiRows":
        seqs = batch.multi_seqs
        lt = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + batch.cu[s + 1] - batch.cu[s])
        tables = [batch.page_tables[s] for s in seqs]
        width = max(int(t.numel()) for t in tables)
        return cls(lt([r for s in seqs for r in range(batch.cu[s], batch.cu[s + 1])]), lt(cu),
                   lt([batch.starts[s] for s in seqs]),
                   torch.stack([torch.cat([t, t[:1].expand(width - t.numel())]) for t in tables]).to(device),
                   len(seqs) == batch.num_seqs)


class KernelPath(BatchedPath):
    """``BatchedPath`` on the ``native/kernels`` ops (imported on first use: triton decides at a
    kernel's decoration whether it is interpreted, so importing them must wait for the caller's
    environment). The verify rows' GDN keeps the reference's every-step states (``_gdn_verify``)."""

    name = "kernels"

    def write_kv(self, k_cache, v_cache, slots, k, v):
        from ninfer.native.kernels.copies import write_kv_triton
        write_kv_triton(k_cache, v_cache, slots, k, v)

    def rms_norm(self, x, weight, eps, zero_centered):
        from ninfer.native.kernels.norms import rms_norm_triton
        return rms_norm_triton(x, weight, eps, zero_centered)

    def gated_rms_norm(self, x, gate, weight, eps):
        from ninfer.native.kernels.norms import gated_rms_norm_triton
        return gated_rms_norm_triton(x, gate, weight, eps)

    def moe(self, x, w, static):
        from ninfer.native.kernels.moe import fused_moe_triton, use_fused
        return fused_moe_triton(x, w) if use_fused(x.shape[0], static) else sparse_moe(x, w)

    def _gdn_ops(self):
        from ninfer.native.kernels import gdn as kernel_gdn
        return kernel_gdn

    def _decode_rows(self, mixed, g, beta, conv_w, conv_states, ssm_states, slots, split, ops, run=None):
        """In place in the rows' slots (``kernels/gdn_decode.py``): no gather and scatter of the
        states (2 MiB of fp32 per row and layer at Qwen3-Next's size, each way)."""
        from ninfer.native.kernels.gdn_decode import conv_step_triton, delta_rule_step_triton
        q, k, v = split(conv_step_triton(mixed, conv_states, slots, conv_w))
        return delta_rule_step_triton(q, k, v, g, beta, ssm_states, slots)

    def _decode(self, q, k_cache, v_cache, batch, scale):
        from ninfer.native.kernels.paged_attention import decode_splits, paged_decode_triton
        table = batch.decode_block_table
        splits = decode_splits(table.shape[1], q.shape[0], k_cache.shape[2])
        return paged_decode_triton(q, k_cache, v_cache, table, batch.decode_kv_lens, scale, splits)

    def attention(self, q, k_cache, v_cache, batch, scale):
        from ninfer.native.kernels.paged_attention import paged_prefill_triton
        if batch.all_decode:
            return self._decode(q, k_cache, v_cache, batch, scale)
        m = batch.kernel_meta.get("multi")
        if m is None:
            m = batch.kernel_meta["multi"] = MultiRows.of(batch, q.device)
        if m.contiguous:
            return paged_prefill_triton(q, k_cache, v_cache, m.tables, m.cu, m.starts, scale, max_q=m.max_q,
                                        q_lens=m.lens)
        out = torch.empty_like(q)
        rows = batch.decode_rows
        out.index_copy_(0, rows, self._decode(q.index_select(0, rows), k_cache, v_cache, batch, scale))
        out.index_copy_(0, m.rows, paged_prefill_triton(q.index_select(0, m.rows), k_cache, v_cache, m.tables,
                                                        m.cu, m.starts, scale, max_q=m.max_q, q_lens=m.lens))
        return out


BATCHED: ForwardPath = BatchedPath()
CPU: ForwardPath = CpuPath()
PER_SEQUENCE: ForwardPath = PerSequencePath()
KERNELS: ForwardPath = KernelPath()
PATHS = {p.name: p for p in (BATCHED, CPU, PER_SEQUENCE, KERNELS)}
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def for_device(device: torch.device, dtype: torch.dtype) -> ForwardPath:
    """The path a model on ``device`` runs: the kernels on CUDA (fp32/fp16/bf16), the batched
    torch path with the fast CPU chunk ops on the CPU (fp32/fp16/bf16), the batched torch path
    for float64 (the oracle's dtype: the kernels and the fused CPU ops accumulate in fp32, or in
    another order)."""
    if dtype not in KERNEL_DTYPES:
        return BATCHED
    return KERNELS if device.type == "cuda" else CPU if device.type == "cpu" else BATCHED
