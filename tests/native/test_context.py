"""The Program as a façade over its parts (issue 36, moves 4-5): the ContextCache contract that
reclaim relies on, the draft backends' reach (the KV directory's public API only), every verb
saying what it reads and writes, and the invariants written beside the structures — each one
caught by ``check_integrity`` when it is broken on purpose."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from ninfer.errors import IntegrityError
from ninfer.native.context.contract import ContextCache
from ninfer.native.context.kv_directory import KvDirectory
from ninfer.native.program import BindMode, Program
from ninfer.protocol import Phase
from tests.native.program_driver import make_program, new_seq, step

NATIVE = Path(__file__).resolve().parents[2] / "ninfer" / "native"


def _members(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")} | set(getattr(cls, "__annotations__", {}))


def _reads_of(path: Path, name: str) -> set[str]:
    """Attributes read on the variable ``name`` anywhere in the module."""
    tree = ast.parse(path.read_text())
    return {n.attr for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name}


def test_reclaim_reads_the_context_cache_through_its_contract_only():
    used = _reads_of(NATIVE / "reclaim.py", "prog")
    assert used and used <= _members(ContextCache), sorted(used - _members(ContextCache))


def test_the_draft_backends_reach_the_kv_directory_by_its_public_api_and_never_the_program():
    api = {n for n in dir(KvDirectory) if not n.startswith("_")} | {"pools", "blocks", "host", "draft_kind"}
    for f in ("speculative.py", "dflash.py"):
        tree = ast.parse((NATIVE / f).read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not names & {"prog", "Program", "program"}, f
        used = _reads_of(NATIVE / f, "kv") | {n.attr for n in ast.walk(tree)
                                              if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self.kv"}
        assert used <= api, (f, sorted(used - api))


def test_every_verb_of_the_program_says_what_it_does():
    missing = [n for n, f in inspect.getmembers(Program, inspect.isfunction)
               if not n.startswith("_") and not (f.__doc__ or "").strip()]
    assert not missing, missing


@pytest.fixture
def prog(tiny_model):
    p = make_program(tiny_model, max_concurrency=2, kv_capacity=1024, context_cache={"host_capacity_bytes": 8 << 20})
    yield p
    p.shutdown()


def test_the_program_satisfies_the_context_cache_contract(prog):
    assert isinstance(prog, ContextCache)


def _running(prog, n=70):
    s = new_seq(prog, list(range(3, 3 + n)), 4)
    assert prog.bind(s, None, BindMode.FORK, first_tokens=n).ok
    step(prog, s)
    prog.check_integrity()
    return s


@pytest.mark.parametrize("breakage", ["holderless", "host_partial", "appender", "paused_slot", "orphan_unread"])
def test_each_written_invariant_is_checked(prog, breakage):
    """Break one invariant of one part's docstring by hand: check_integrity names it."""
    s = _running(prog)
    tail = s.blocks["main"][-1]
    if breakage == "holderless":           # kv_directory: a kept block has a holder or a reader
        tail.holders.clear()
        s.blocks["main"].pop()
    elif breakage == "host_partial":       # kv_directory: a Host replica is complete or absent
        tail.host = prog.host.allocate(prog.page_bytes)
        tail.host_filled = tail.filled - 1
    elif breakage == "appender":           # kv_directory: the append claim is a holder's
        tail.appender = 10_000
    elif breakage == "paused_slot":        # writers: a paused sequence holds no Device state
        s.phase = Phase.PAUSED
    elif breakage == "orphan_unread":      # slots: an orphaned image is being read
        ck = prog.freeze(s, "rec")
        prog.slots.orphan(ck.image)
    with pytest.raises(IntegrityError):
        prog.check_integrity()


def test_a_checkpoint_digest_hashes_the_same_bytes_as_before():
    """``Checkpoints.digest`` packs tokens through ``struct``: the bytes torch's int64 tensor held
    (so every digest is what it was), a float truncated as torch did, out of range refused as torch
    refused it."""
    import random

    import torch

    from ninfer.native.context.checkpoints import _int64_bytes
    rng = random.Random(3)
    for n, hi in ((0, 1), (1, 1 << 63), (17, 1 << 63), (300, 152_000), (2049, 152_000)):
        toks = [rng.randrange(-hi, hi) if hi > 1 << 32 else rng.randrange(hi) for _ in range(n)]
        want = torch.tensor(toks, dtype=torch.int64).numpy().tobytes()
        assert _int64_bytes(toks) == want and _int64_bytes(tuple(toks)) == want
    assert _int64_bytes([1, 2.7, 3]) == torch.tensor([1, 2.7, 3], dtype=torch.int64).numpy().tobytes()
    with pytest.raises(ValueError, match="Overflow"):
        _int64_bytes([1 << 63])
