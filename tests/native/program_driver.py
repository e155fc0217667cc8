"""A minimal single-threaded driver of the Program for tests: it plays the worker's part
(reserve, prepare saves, execute, settle, progress the transaction) without any policy."""

from __future__ import annotations

import torch

from ninfer.config import EngineConfig
from ninfer.faults import FaultPlan
from ninfer.native.layout import resolve_layout
from ninfer.native.program import Program, UnitKind, UnitRow
from ninfer.reference import load_cached
from ninfer.sampling_params import SamplingParams


def make_program(model_dir: str, dtype: str = "float64", faults=(), copy_engine: str = "thread", **cfg) -> Program:
    model, _ = load_cached(model_dir, dtype)
    ec = EngineConfig(dtype=dtype, **{"max_context": 1024, "max_concurrency": 4, **cfg})
    return Program(model, resolve_layout(model.cfg, ec, torch.device("cpu")), FaultPlan(list(faults)), copy_engine)


def new_seq(prog: Program, prompt: list[int], max_tokens: int = 8, **params):
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return prog.new_sequence(prompt, len(prompt), p, eos_ids=())


def settle_transfers(prog: Program, timeout: float = 5.0) -> list:
    """Progress until no transaction is running; the settled reports, in order."""
    out = []
    for _ in range(1000):
        out += prog.progress()
        if prog.tx is None and not prog.transfers.pending:
            return out
        prog.wait_transfers(timeout)
    raise AssertionError("the transaction never settled")


def row(prog: Program, seq, n: int, kind: UnitKind, capture_owner=None) -> UnitRow:
    dest = prog.prepare_capture(capture_owner) if capture_owner is not None else None
    return UnitRow(seq, n, kind, [(None, dest)] if dest is not None else [])


def step(prog: Program, seq, chunk: int = 1000, capture_owner=None, stop_at: int | None = None):
    """One unit for one sequence: a chunk while input remains, else a decode row."""
    remaining = len(seq.ledger) - seq.frontier
    if stop_at is not None:
        remaining = min(remaining, stop_at - seq.frontier)
    n = min(chunk, remaining) if remaining > 1 else remaining
    kind = UnitKind.PREFILL if n > 1 else UnitKind.DECODE
    short = prog.reserve_unit(seq, n)
    assert not short, short
    [res] = prog.execute([row(prog, seq, n, kind, capture_owner)])
    prog.settle(seq)
    settle_transfers(prog)
    return res


def run_to_end(prog: Program, seq, chunk: int = 1000) -> list[int]:
    while not seq.finished:
        step(prog, seq, chunk)
    return seq.outputs


def run_batch(prog: Program, seqs, chunk: int = 48) -> None:
    """Decode rows of every sequence with nothing left to prefill, plus one chunk per call."""
    live = list(seqs)
    while live:
        rows = []
        chunk_taken = False
        for s in live:
            remaining = len(s.ledger) - s.frontier
            if remaining > 1:
                if chunk_taken:
                    continue
                n, chunk_taken = min(chunk, remaining), True
            else:
                n = remaining
            assert not prog.reserve_unit(s, n)
            rows.append(UnitRow(s, n, UnitKind.PREFILL if n > 1 else UnitKind.DECODE))
        prog.execute(rows)
        for s in live:
            prog.settle(s)
        live = [s for s in live if not s.finished]
