"""The model runner: one call of the forward over the rows of a step, then sampling and commit.

A call carries decode rows (one token; with a draft backend, one verify row of 1 + k inputs) and
at most one prefill/replay chunk. The runner grows each row's KV directory first (growth pages,
the tail COW: kv_directory.py), runs the forward (a CUDA graph when one fits, graphs.py), then per
row: keeps the verified drafts and rolls the GDN/conv state back past a rejected one, marks the
written positions, gives back the pages past the new frontier, stores the continuation hidden,
samples where the ledger ends (seeded per position: sampler.py) and lets the draft backend catch
up. It never reserves, binds or captures: those are the caller's, before and after.

After a call a running sequence's directory covers its frontier exactly (kv_directory.py checks
it) and its slot's continuation hidden is the hidden at frontier - 1 (what an exact hit samples
from).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ninfer.native import graphs
from ninfer.native.context.captures import CaptureDest
from ninfer.native.context.kv_directory import KvDirectory
from ninfer.native.layout import MAIN, Layout
from ninfer.native.memory import Memory
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from ninfer.native.objects import Checkpoint, NativeError, Sequence
from ninfer.native.sampler import PROMPT_ROWS, prompt_logprobs, sample_token, stop_reason, token_logprobs
from ninfer.native.speculative import DraftBackend, Pending
from ninfer.protocol import Phase, PromptLogprob, TokenLogprob, UnitKind


@dataclass
class UnitRow:
    """One row of an execute call. ``n_tokens == 0`` samples from the continuation hidden
    (an exact hit); otherwise ledger[frontier : frontier + n_tokens] are computed."""

    seq: Sequence
    n_tokens: int
    kind: UnitKind = UnitKind.DECODE
    # the saves prepared for the unit, in order: (an inner cut's position, or None for the
    # unit's end; its destination) — finished by the caller after the call
    captures: list[tuple[int | None, CaptureDest]] = field(default_factory=list)

    @property
    def cuts(self) -> list[int]:
        return [at for at, _ in self.captures if at is not None]


@dataclass
class RowResult:
    sid: int
    frontier: int
    committed: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # one per committed token, when asked
    finish_reason: str | None = None
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)   # prompt tokens prompt_from.. (asked)
    prompt_from: int = 0
    cut_images: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # per UnitRow.captures entry: the checkpoint made and its Host copy's transaction (the caller's)
    saved: list[tuple[Checkpoint, int | None]] = field(default_factory=list)

    @property
    def captured(self) -> Checkpoint | None:
        """The last save's checkpoint (the unit's end's, when it had one)."""
        return self.saved[-1][0] if self.saved else None

    @property
    def capture_tid(self) -> int | None:
        return self.saved[-1][1] if self.saved else None


class ModelRunner:
    def __init__(self, model: HybridModel, mem: Memory, kv: KvDirectory, spec: DraftBackend | None,
                 encoder, layout: Layout, backend=None):
        """``backend``: graphs.backend_for's, or None (eager)."""
        self.model = model
        self.device = model.device
        self.mem = mem
        self.kv = kv
        self.spec = spec                             # the draft backend, when configured
        self.encoder = encoder                       # media.EncoderCache, when a vision tower is loaded
        self.grammar_stats = None                    # structured.GrammarStats once a grammar ran
        self.graphs: graphs.GraphRunner | None = None   # the forward's graphs (graphs.py)
        if backend is not None:
            self.graphs = graphs.GraphRunner(model, mem.cache, backend, layout.max_concurrency,
                                             layout.max_context, *mem.scratch,
                                             taps=spec.taps if spec is not None else (),
                                             verify_tokens=layout.spec_tokens + 1 if layout.spec_tokens else 0,
                                             chunk_tokens=layout.prefill_chunk_tokens)
            self.graphs.capture_all()

    def execute(self, rows: list[UnitRow]) -> list[RowResult]:
        """Run one call: rows of at most one token and at most one multi-token chunk, sample
        where the ledger ends and commit. Rows must hold their reservations. With a draft
        backend a decode row also verifies its sequence's drafts, and the backend catches up
        and drafts after the forward (speculative.py). Captures are the caller's, after this;
        a row's inner cuts (``UnitRow.captures``) leave their images in ``RowResult.cut_images``."""
        if sum(1 for r in rows if r.n_tokens > 1) > 1:
            raise NativeError("at most one prefill/replay chunk per call")
        compute = [r for r in rows if r.n_tokens > 0]
        seqs_in, drafts = [], []
        for r in compute:
            seq = r.seq
            if seq.phase is not Phase.RUNNING:
                raise NativeError(f"sequence {seq.sid} is {seq.phase.name}, not bound")
            end = seq.frontier + r.n_tokens
            if end > len(seq.ledger):
                raise NativeError(f"unit beyond the ledger of sequence {seq.sid}")
            d = self.spec.drafts_for(seq, r.n_tokens) if self.spec is not None else []
            if r.cuts and (d or self.spec is not None):
                raise NativeError("inner save cuts need a forward without a draft backend")
            drafts.append(d)
            self.kv.prepare(seq, end + len(d))
            seqs_in.append(SeqInput(token_ids=seq.ledger[seq.frontier:end] + d, start=seq.frontier,
                                    page_table=[b.page for b in seq.blocks[MAIN]], state_slot=seq.slot,
                                    logits="all" if d else "last", verify=bool(d), cuts=r.cuts,
                                    rope_positions=seq.media.rows(seq.frontier, end + len(d)) if seq.media else None))
        results = {r.seq.sid: RowResult(sid=r.seq.sid, frontier=r.seq.frontier) for r in rows}
        pending = []
        if seqs_in:
            batch = ForwardBatch.build(seqs_in, self.device)
            prev = {r.seq.sid: self.mem.hidden[r.seq.slot].clone() for r in compute
                    if self.spec is not None and self.spec.needs_prev and r.seq.frontier > 0}
            embeds = None
            if any(r.seq.media is not None and r.seq.media.overlapping(r.seq.frontier, r.seq.frontier + r.n_tokens)
                   for r in compute):
                from ninfer.native.media import call_embeds
                embeds = call_embeds(self.model.embed, [t for s_in in seqs_in for t in s_in.token_ids],
                                     batch.cu[:-1], [(r.seq.frontier, r.n_tokens, r.seq.media) for r in compute],
                                     self.encoder, self.model.cfg.vocab_size)
            taps = self.spec.taps if self.spec is not None else ()
            if self.graphs is not None:
                out = self.graphs.forward(batch, embeds, taps)
            elif embeds is None and not taps:
                out = self.model.forward_seqs(seqs_in, batch, self.mem.cache)
            else:
                out = self.model.forward(batch, self.mem.cache, embeds, taps)
            # the grammar masks of the rows about to sample, on the CPU while the device runs
            # the forward (its launches are asynchronous; sampling reads the logits after this)
            for r in compute:
                if r.seq.params.structured is not None and r.seq.frontier + r.n_tokens == len(r.seq.ledger):
                    self._grammar(r.seq).allowed()
            li = 0                                # the row of out.logits of the sequence's first logits row
            for i, r in enumerate(compute):
                seq, d, res = r.seq, drafts[i], results[r.seq.sid]
                f0, lo = seq.frontier, batch.cu[i]
                if d:
                    keep = self._verify(seq, res, d, out.logits[li:li + len(d) + 1])
                    li += len(d) + 1
                    if keep < len(d) + 1:
                        self.model.roll_back(self.mem.cache, batch, i, seq.slot, keep)
                else:
                    keep = r.n_tokens
                    li += 1
                self.kv.mark_written(seq, f0, f0 + keep)
                seq.frontier = f0 + keep
                self.kv.trim(seq)
                self.mem.hidden[seq.slot] = out.all_hidden[lo + keep - 1]
                if r.cuts:
                    self._cut_images(batch, i, r.cuts, f0, lo, out.all_hidden, res)
                res.frontier = seq.frontier
                if not d and seq.params.prompt_logprobs is not None:
                    self._prompt_logprobs(seq, res, out.all_hidden[lo:lo + keep], f0)
                if not d and seq.frontier == len(seq.ledger) and not seq.finished:
                    self._sample(seq, res, out.logits[li - 1])
                if self.spec is not None:
                    if r.kind in (UnitKind.DECODE, UnitKind.VERIFY):
                        self.spec.note_verify(d, res.committed)
                    pending.append((seq, f0, prev.get(seq.sid), self.spec.rows(out, lo, keep), bool(res.committed)))
        for r in rows:
            seq, res = r.seq, results[r.seq.sid]
            if r.n_tokens == 0 and seq.frontier == len(seq.ledger) and not seq.finished:
                prev_h = self.mem.hidden[seq.slot].clone() if self.spec is not None and self.spec.needs_prev else None
                self._sample(seq, res, None)
                if self.spec is not None:
                    pending.append((seq, seq.frontier, prev_h, None, True))
        if self.spec is not None:
            self.spec.after_call([Pending(*p) for p in pending])
        return [results[r.seq.sid] for r in rows]

    @staticmethod
    def _cut_images(batch: ForwardBatch, i: int, cuts: list[int], f0: int, lo: int, hidden: torch.Tensor,
                    res: RowResult) -> None:
        """The StateImage at each inner cut of row ``i``: every GDN layer's kept conv and ssm state
        there (cache order) and the hidden at the position before it (what an exact hit samples)."""
        for j, at in enumerate(cuts):
            conv = torch.stack([layer[i][j][0] for layer in batch.cut_states])
            ssm = torch.stack([layer[i][j][1] for layer in batch.cut_states])
            res.cut_images[at] = (conv, ssm, hidden[lo + at - f0 - 1].clone())

    def _prompt_logprobs(self, seq: Sequence, res: RowResult, hidden: torch.Tensor, f0: int) -> None:
        """vLLM's prompt_logprobs from the rows this call computed (positions f0 ..): the logits
        of position i give prompt token i + 1's entry. Each position's entry is made once: a
        Replay recomputing positions this sequence already reported skips them
        (``seq.prompt_next``)."""
        a, b = max(f0, seq.prompt_next), min(f0 + hidden.shape[0], seq.prompt_len - 1)
        if a >= b:
            return
        res.prompt_from = a + 1
        for i in range(a, b, PROMPT_ROWS):
            e = min(b, i + PROMPT_ROWS)
            logits = self.model.logits(hidden[i - f0:e - f0])
            res.prompt_logprobs += prompt_logprobs(logits, seq.ledger[i + 1:e + 1], seq.params.prompt_logprobs)
        seq.prompt_next = b

    def _verify(self, seq: Sequence, res: RowResult, drafts: list[int], logits: torch.Tensor) -> int:
        """Sample every verified position in order (the seeded per-position sampler, as without
        drafts) and keep a draft only while it equals the sampled token. Returns how many inputs
        of the verify row stand (1 + the drafts kept)."""
        for i in range(len(drafts) + 1):
            tok = self._sample(seq, res, logits[i])
            if seq.finished or i == len(drafts) or tok != drafts[i]:
                return i + 1
        raise AssertionError("unreachable")

    def _sample(self, seq: Sequence, res: RowResult, logits: torch.Tensor | None) -> int:
        if logits is None:       # exact hit: sample from the continuation hidden
            logits = self.model.logits(self.mem.hidden[seq.slot][None])[0]
        pos = len(seq.ledger)
        g = self._grammar(seq) if seq.params.structured is not None else None
        allowed = g.allowed().to(logits.device) if g is not None else None
        tok = sample_token(logits, seq.params, pos, seq.ledger[:seq.prompt_len], seq.outputs, seq.eos_ids, allowed)
        seq.ledger.append(tok)
        res.committed.append(tok)
        if seq.params.logprobs is not None:
            # only a newly sampled token gets an entry: Replay recomputes committed positions
            # as inputs and never samples them again, so each token's logprob is made once
            res.logprobs.append(token_logprobs(logits, tok, seq.params.logprobs))
        seq.finished = stop_reason(tok, seq.n_generated, seq.params, seq.eos_ids)
        if g is not None:
            g.accept(tok)
            if g.complete and seq.finished is None:
                seq.finished = "stop"            # the grammar is done: nothing else may follow
        res.finish_reason = seq.finished
        return tok

    def _model_dir(self):
        if self.model.source is None:
            raise NativeError("structured outputs need the model's directory (its tokenizer.json)")
        return self.model.source

    def _grammar(self, seq: Sequence):
        """The sequence's grammar state, rebuilt from its committed output when it has none (a
        destructive pause dropped it, or the sequence came with outputs): never sampled again."""
        if seq.grammar is None:
            from ninfer.structured import GrammarState, GrammarStats, book_for
            book = book_for(self._model_dir(), self.model.cfg.vocab_size, seq.eos_ids)
            if self.grammar_stats is None:
                self.grammar_stats = GrammarStats()
            seq.grammar = GrammarState.rebuilt(seq.params.structured, book, seq.ledger[:seq.prompt_len],
                                               seq.outputs, self.grammar_stats)
        else:
            seq.grammar.sync(seq.outputs)
        return seq.grammar
