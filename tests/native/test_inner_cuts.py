"""Saves inside a unit (inner cuts): one forward keeps the StateImage at each save point it crosses.

A unit that crosses save points runs its GDN segment by segment — each segment as a separate unit
would run it, from the state the previous one left — and keeps the conv and recurrent states at
each cut, with the hidden before it. The checkpoints it makes are the ones separate units ending
on those points would make (float64: the same images to rounding, the same tokens after a
restore), on a Device slot or on the Host, and a failed Host copy loses only its own save.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.faults import Fault, FaultPlan
from ninfer.native.layout import MAIN, STATE
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.program import BindMode, UnitKind, UnitRow
from ninfer.reference import reference_generate
from tests.factories import random_prompt
from tests.native.program_driver import make_program, new_seq, run_to_end, settle_transfers


@pytest.fixture
def oracle(tiny_model):
    def run(prompt, n=6):
        return reference_generate(tiny_model, prompt, max_tokens=n, dtype="float64", ignore_eos=True)
    return run


def _program(tiny_model, **cc):
    return make_program(tiny_model, max_concurrency=4, kv_capacity=2048,
                        context_cache={"host_capacity_bytes": 32 << 20, **cc})


def _image(prog, ck) -> tuple[torch.Tensor, ...]:
    if ck.image.slot is not None:
        c, s = prog.mem.cache, ck.image.slot
        return c.conv[:, s].clone(), c.ssm[:, s].clone(), prog.mem.hidden[s].clone()
    return tuple(t.clone() for t in prog.mem._image_views(ck.image.host))


def _closed(prog) -> None:
    """Nothing is held any more; the Program shuts down."""
    prog.check_integrity(idle=True)
    assert prog.is_empty()
    prog.shutdown()


def _unit(prog, seq, n, saves):
    """One prefill unit of ``n`` tokens saving at ``saves`` (positions; the end as None)."""
    assert not prog.reserve_unit(seq, n)
    r = UnitRow(seq, n, UnitKind.PREFILL)
    for at in saves:
        dest = prog.prepare_capture(f"cap{at}")
        assert dest is not None
        r.captures.append((at, dest))
    [res] = prog.execute([r])
    prog.settle(seq)
    return res


def test_one_unit_saves_at_its_inner_cuts_what_units_ending_there_would(tiny_model, oracle):
    prog = _program(tiny_model)
    prompt = random_prompt(150, seed=41)
    a = new_seq(prog, prompt, 4)
    assert prog.bind(a, None).ok
    res = _unit(prog, a, 150, [40, 100, None])            # 40: a page inside; 100: past one
    cks = [ck for ck, _ in res.saved]
    assert [ck.frontier for ck in cks] == [40, 100, 150]
    assert cks[1].tokens == tuple(prompt[:100])
    assert cks[1].blocks[MAIN] == a.blocks[MAIN][:2]      # a prefix of the writer's blocks
    b = new_seq(prog, prompt, 4)
    assert prog.bind(b, None).ok
    sep = [_unit(prog, b, n, [None]).captured for n in (40, 60, 50)]   # units ending on each point
    for ck, ref in zip(cks, sep):
        for x, y in zip(_image(prog, ck), _image(prog, ref)):
            assert torch.allclose(x, y, rtol=0, atol=1e-10), (ck.frontier, (x - y).abs().max())
    assert torch.equal(prog.mem.cache.ssm[:, a.slot], prog.mem.cache.ssm[:, b.slot]) or torch.allclose(
        prog.mem.cache.ssm[:, a.slot], prog.mem.cache.ssm[:, b.slot], rtol=0, atol=1e-10)
    assert run_to_end(prog, a) == run_to_end(prog, b) == oracle(prompt, 4)
    for s in (a, b):
        prog.release(s)
    for ck in sep:
        prog.release_owner(ck, "capNone")
    # each inner point restores exactly: a Fork continues a new prompt from it
    for ck in cks:
        f = ck.frontier
        s = new_seq(prog, prompt[:f] + [7], 6)
        assert prog.bind(s, ck, BindMode.FORK, first_tokens=1).ok
        settle_transfers(prog)
        assert run_to_end(prog, s) == oracle(prompt[:f] + [7], 6), f
        prog.release(s)
        prog.release_owner(ck, f"cap{f if f < 150 else None}")
    _closed(prog)


def test_the_cpu_path_takes_its_inner_cuts_in_one_pass_with_the_same_images(tiny_model):
    """fp32 runs the CPU path, whose chunk rule gives the states at the cuts from one pass
    (``paths._chunk_cut_pass``): the images equal, to fp32 rounding, those units ending on each
    point make; the writer's own state after the unit is the one pass's. The first cut lies
    before the conv's window is full, so its conv state is partly the one the chunk started from."""
    prog = make_program(tiny_model, dtype="float32", max_concurrency=4, kv_capacity=2048,
                        context_cache={"host_capacity_bytes": 32 << 20})
    prompt = random_prompt(200, seed=44)
    a = new_seq(prog, prompt, 4)
    assert prog.bind(a, None).ok
    # a chunk from position 40: cuts in its first block (the conv state partly the one it started
    # from), on a block boundary, inside a later block
    _unit(prog, a, 40, [])
    res = _unit(prog, a, 160, [42, 104, 170, None])
    cks = [ck for ck, _ in res.saved]
    assert [ck.frontier for ck in cks] == [42, 104, 170, 200]
    b = new_seq(prog, prompt, 4)
    assert prog.bind(b, None).ok
    _unit(prog, b, 40, [])
    sep = [_unit(prog, b, n, [None]).captured for n in (2, 62, 66, 30)]
    settle_transfers(prog)                # eight saves: the last ones' images go to the Host
    for ck, ref in zip(cks, sep):
        for x, y in zip(_image(prog, ck), _image(prog, ref)):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-5), (ck.frontier, (x - y).abs().max())
    assert run_to_end(prog, a) == run_to_end(prog, b)
    for s in (a, b):
        prog.release(s)
    for ck in cks:
        prog.release_owner(ck, f"cap{ck.frontier if ck.frontier < 200 else None}")
    for ck in sep:
        prog.release_owner(ck, "capNone")
    _closed(prog)


def test_an_inner_save_with_no_device_slot_goes_to_the_host_and_restores(tiny_model, oracle):
    prog = _program(tiny_model)
    prompt = random_prompt(120, seed=42)
    s = new_seq(prog, prompt, 4)
    assert prog.bind(s, None).ok
    held = prog.pools[STATE].available
    prog.pools[STATE].reserve(held)                       # no free Device slot
    res = _unit(prog, s, 120, [70])
    prog.pools[STATE].unreserve(held)
    [(ck, tid)] = res.saved
    assert ck.image.slot is None and ck.image.host is not None and tid is not None
    [t] = settle_transfers(prog)
    assert t.ok and ck.image.leases == 0
    assert run_to_end(prog, s) == oracle(prompt, 4)
    prog.release(s)
    r = new_seq(prog, prompt[:70] + [9], 6)
    assert prog.bind(r, ck, BindMode.FORK, first_tokens=1).ok
    settle_transfers(prog)
    assert run_to_end(prog, r) == oracle(prompt[:70] + [9], 6)
    prog.release(r)
    prog.release_owner(ck, "cap70")
    _closed(prog)


def test_a_failed_host_copy_of_an_inner_save_loses_only_that_save(tiny_model, oracle):
    prog = _program(tiny_model)
    prog.transfers.faults = FaultPlan([Fault(kind="copy_error")])      # the next copy fails
    prompt = random_prompt(100, seed=43)
    s = new_seq(prog, prompt, 4)
    assert prog.bind(s, None).ok
    held = prog.pools[STATE].available
    prog.pools[STATE].reserve(held)
    res = _unit(prog, s, 100, [30])
    prog.pools[STATE].unreserve(held)
    [(ck, tid)] = res.saved
    [t] = settle_transfers(prog)
    assert not t.ok and t.lost_cids == [ck.cid] and ck.cid not in prog.checkpoints
    assert run_to_end(prog, s) == oracle(prompt, 4)       # the writer goes on untouched
    prog.release(s)
    _closed(prog)


@pytest.mark.parametrize("cuts", [[0], [5], [3, 3], [4, 2], [8]])
def test_cuts_must_lie_strictly_inside_the_chunk_in_order(cuts):
    with pytest.raises(ValueError, match="cuts"):
        ForwardBatch.build([SeqInput(list(range(5)), start=0, page_table=[0], cuts=cuts)])
    with pytest.raises(ValueError, match="cuts"):
        ForwardBatch.build([SeqInput([1], start=3, page_table=[0], cuts=[2])])     # a decode row has none
