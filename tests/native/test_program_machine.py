"""A Hypothesis state machine over the Program: random binds (root / Fork / Move, Device or Host
sources), units of random sizes, captures, pauses (Snapshot to the Host, destructive), resumes,
freezes, demotions, deletions, owner releases, failed copies and transfer settlement — with
``check_integrity()`` and the memoised quote against one from scratch after every step, the oracle's tokens for every finished sequence, and
nothing held at the end."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ninfer.faults import Fault, FaultPlan
from ninfer.native.program import BindMode, UnitKind
from ninfer.native.reclaim import quote, quote_from_scratch
from ninfer.protocol import Delete, DemoteBlocks, DemoteState, Phase, SnapshotOwner
from ninfer.reference import reference_generate
from tests.factories import random_prompt
from tests.native.program_driver import make_program, new_seq, row

BASES = [random_prompt(n, seed=900 + n) for n in (30, 64, 100)]


class ProgramMachine(RuleBasedStateMachine):
    model_dir: str = ""

    @initialize(slots=st.integers(0, 3), pages=st.sampled_from([8, 16, 24]),
                host=st.sampled_from([0, 2 << 20, 16 << 20]))
    def setup(self, slots, pages, host):
        # inline copies: Hypothesis needs the same rules to apply when it replays a case
        self.prog = make_program(self.model_dir, max_concurrency=3, max_context=512, kv_capacity=pages * 64,
                                 context_cache={"device_state_slots": slots, "host_capacity_bytes": host},
                                 copy_engine="inline")
        self.seqs = []
        self.owned: list[tuple[object, str]] = []     # (checkpoint, owner) holds this test keeps
        self.n = 0

    # -- helpers -------------------------------------------------------------------------
    def _bound(self):
        return [s for s in self.seqs if s.phase is Phase.RUNNING and not s.finished]

    def _unbound(self):
        return [s for s in self.seqs if s.slot is None and s.phase in (Phase.MATERIALIZING, Phase.PAUSED) and s.sid in self.prog.sequences]

    def _live_owned(self):
        return [(c, o) for c, o in self.owned if c.cid in self.prog.checkpoints and o in c.owners]

    # -- rules ---------------------------------------------------------------------------
    @precondition(lambda self: len(self.seqs) < 4)
    @rule(base=st.integers(0, 2), extra=st.integers(1, 40), n=st.integers(1, 6), temp=st.sampled_from([0.0, 1.0]))
    def new(self, base, extra, n, temp):
        self.n += 1
        prompt = BASES[base][: max(1, len(BASES[base]) - extra // 2)] + random_prompt(extra, seed=self.n)
        self.seqs.append(new_seq(self.prog, prompt, n, temperature=temp, seed=self.n))

    @precondition(lambda self: self._unbound())
    @rule(data=st.data(), move=st.booleans())
    def bind(self, data, move):
        seq = data.draw(st.sampled_from(self._unbound()))
        sources = [(c, o) for c, o in self._live_owned()
                   if c.frontier <= len(seq.ledger) and tuple(seq.ledger[:c.frontier]) == c.tokens]
        if seq.snapshot is not None and seq.snapshot.cid in self.prog.checkpoints:
            sources.append((seq.snapshot, SnapshotOwner(seq.sid)))
        src, owner = data.draw(st.sampled_from([(None, None), *sources]))
        mode = BindMode.MOVE if (move and src is not None and set(src.owners) == {owner}) else BindMode.FORK
        first = min(len(seq.ledger) - (src.frontier if src else 0), 16)
        self.prog.bind(seq, src, mode, first_tokens=first, mover=owner)

    @precondition(lambda self: self._bound())
    @rule(data=st.data(), chunk=st.integers(1, 40), capture=st.booleans(), units=st.integers(1, 8))
    def step(self, data, chunk, capture, units):
        seq = data.draw(st.sampled_from(self._bound()))
        for i in range(units):
            if seq.finished or seq.phase is not Phase.RUNNING:
                return
            self._unit(seq, chunk, capture and i == 0)

    def _unit(self, seq, chunk, capture):
        remaining = len(seq.ledger) - seq.frontier
        n = min(chunk, remaining) if remaining > 1 else remaining
        if self.prog.reserve_unit(seq, n):
            return                                   # short: a policy would reclaim or pause
        owner = f"cap{self.n}" if capture else None
        self.n += 1
        [r] = self.prog.execute([row(self.prog, seq, n, UnitKind.PREFILL if n > 1 else UnitKind.DECODE, owner)])
        self.prog.settle(seq)
        if r.captured is not None:
            self.owned.append((r.captured, owner))
        if seq.finished:
            self._check_tokens(seq)

    def _check_tokens(self, seq):
        p = seq.params
        ref = reference_generate(self.model_dir, seq.ledger[: seq.prompt_len], max_tokens=p.max_tokens,
                                 temperature=p.temperature, seed=p.seed, dtype="float64", ignore_eos=True)
        assert seq.outputs == ref

    @precondition(lambda self: self._bound())
    @rule(data=st.data(), to_host=st.booleans())
    def pause(self, data, to_host):
        seq = data.draw(st.sampled_from(self._bound()))
        self.prog.pause(seq, to_host=to_host)

    @precondition(lambda self: any(s.finished and s.phase is Phase.RUNNING for s in self.seqs))
    @rule(data=st.data())
    def freeze(self, data):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.finished and s.phase is Phase.RUNNING]))
        owner = f"E{seq.sid}"
        self.owned.append((self.prog.freeze(seq, owner), owner))
        self.seqs.remove(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def cancel(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.prog.release(seq)
        if seq.phase is Phase.FINISHED:
            self.seqs.remove(seq)

    @precondition(lambda self: self._live_owned())
    @rule(data=st.data(), what=st.sampled_from(["state", "blocks", "delete", "drop"]))
    def reclaim(self, data, what):
        ck, owner = data.draw(st.sampled_from(self._live_owned()))
        if what == "drop":
            self.prog.release_owner(ck, owner)
            return
        f = quote(self.prog)
        cf = f.checkpoints[ck.cid]
        if what == "delete":
            action = Delete(ck.cid, ck.generation, cf.version)
        elif what == "state":
            if not cf.image_device:
                return
            action = DemoteState(ck.cid, ck.generation, cf.version)
        else:
            bids = tuple(b for b in cf.blocks if f.blocks[b].device and not f.blocks[b].pinned)
            if not bids:
                return
            action = DemoteBlocks(ck.cid, ck.generation, bids, tuple(f.blocks[b].version for b in bids))
        self.prog.apply([action])          # may be refused (stale, no Host room): nothing changes

    @rule()
    def fail_next_copy(self):
        self.prog.transfers.faults = FaultPlan([Fault(kind="copy_error")])

    @rule()
    def settle(self):
        self.prog.wait_transfers(2.0)
        for r in self.prog.progress():
            self.seqs = [s for s in self.seqs if s.sid not in r.failed_sids]

    @invariant()
    def books_balance(self):
        if hasattr(self, "prog"):
            self.prog.check_integrity()

    @invariant()
    def memoised_facts_equal_facts_from_scratch(self):
        """The quote's kept messages (FactsMemo) are the objects' facts after every step (the
        scoped selection is checked by test_facts_memo and the engine tests)."""
        if hasattr(self, "prog"):
            got, want = quote(self.prog), quote_from_scratch(self.prog)
            assert got == want and list(got.blocks) == list(want.blocks), (got, want)

    def teardown(self):
        if not hasattr(self, "prog"):
            return
        prog = self.prog
        while prog.tx is not None:
            prog.wait_transfers(2.0)
            prog.progress()
        for s in list(self.seqs):
            prog.release(s)
        for c, o in self._live_owned():
            if c.cid in prog.checkpoints and o in c.owners:
                prog.release_owner(c, o)
        prog.check_integrity(idle=True)
        assert prog.is_empty(), "the machine leaked"
        prog.shutdown()


@pytest.fixture
def machine(tiny_model):
    ProgramMachine.model_dir = tiny_model
    return ProgramMachine


def test_program_state_machine(machine):
    settings_ = settings(max_examples=100, stateful_step_count=50, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    run = machine.TestCase
    run.settings = settings_
    run().runTest()
