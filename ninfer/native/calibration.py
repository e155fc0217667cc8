"""Calibration of the source cost model (seed: 机器传输与 artifact prefill 校准影响排序).

Two measured numbers the controller's cost model weighs restores against recomputation with:
the Host→Device copy rate of a StateImage-sized buffer, and the seconds one prefill token costs
through the real execute path. Run once when the worker starts (``cost_calibration``).

``auto_chunk`` sizes ``prefill_chunk_tokens="auto"`` the same way: two scratch prefill sizes through
the real execute path give the forward's fixed cost and its cost per token, and the chunk is the
largest of ``AUTO_CHUNKS`` the forward computes within ``AUTO_CHUNK_STEP_S`` — the longest a
cycle's decode rows wait behind the one prefill chunk it runs (the seed's one chunk a cycle).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ninfer.native.runner import UnitRow
from ninfer.protocol import UnitKind
from ninfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ninfer.native.program import Program


PREFILL_RUNS = 3       # timed scratch prefills after the warm-up; the fastest counts


def _prefill_s(prog: "Program", tokens: int, runs: int = PREFILL_RUNS) -> float | None:
    """Seconds of one scratch prefill of ``tokens`` tokens through the Program's verbs: the
    fastest of ``runs`` after a warm-up (on a machine shared with other work a run can take
    several times its time: one such run, taken alone, once sized a 2-core machine's chunk at
    512 tokens instead of 2,048 — 200 us a token against its 53); None if the layout cannot hold
    it. Leaves nothing held."""
    vocab = prog.model.cfg.vocab_size
    best = None
    for run in range(runs + 1):
        seq = prog.new_sequence([(7 * i + 3) % vocab for i in range(tokens + 1)], tokens + 1,
                                SamplingParams(max_tokens=1, ignore_eos=True), eos_ids=())
        if not prog.bind(seq, None).ok or prog.reserve_unit(seq, tokens):
            prog.release(seq)
            return None
        t0 = time.perf_counter()
        prog.execute([UnitRow(seq, tokens, UnitKind.PREFILL)])
        took = time.perf_counter() - t0
        prog.settle(seq)
        prog.release(seq)
        if run:                     # the first warms up
            best = took if best is None else min(best, took)
    return best


def auto_chunk(prog: "Program", small: int = 64) -> tuple[int, float, float]:
    """``prefill_chunk_tokens="auto"``: (the chunk, the forward's fixed seconds, seconds per
    token) from a ``small``-token and a budget-long scratch prefill — the largest of
    ``AUTO_CHUNKS`` (at most the layout's budget) whose predicted forward, fixed + n x per token,
    fits ``AUTO_CHUNK_STEP_S``; the smallest when none does."""
    from ninfer.config import AUTO_CHUNK_STEP_S, AUTO_CHUNKS
    lay = prog.layout
    fits = [c for c in AUTO_CHUNKS if c <= lay.prefill_chunk_tokens]
    big = min(fits[-1], lay.max_context - 1, lay.main_pages * 64 - 1)
    t_small, t_big = _prefill_s(prog, small), _prefill_s(prog, big)
    if t_small is None or t_big is None or big <= small:
        return fits[0], 0.0, 0.0
    per_token = max(t_big - t_small, 0.0) / (big - small)
    fixed = max(t_small - small * per_token, 0.0)
    chosen = [c for c in fits if fixed + c * per_token <= AUTO_CHUNK_STEP_S]
    return (chosen[-1] if chosen else fits[0]), fixed, per_token


def calibrate(prog: "Program", tokens: int = 32) -> tuple[float, float]:
    """Measured (Host→Device bytes/s, prefill seconds per token): a StateImage-sized copy from
    (pinned) Host memory to the device, and a scratch prefill through the Program's verbs (the
    fastest of ``PREFILL_RUNS`` after a warm-up). Leaves nothing held."""
    n = max(prog.mem.image_bytes, 1 << 16)
    pin = prog.device.type == "cuda"
    src = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(n, dtype=torch.uint8, device=prog.device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(prog.device)
        best = min(best, time.perf_counter() - t0)
    h2d = n / max(best, 1e-9)
    tokens = max(2, min(tokens, prog.layout.max_context - 1, prog.layout.main_pages * 64 - 1))
    took = _prefill_s(prog, tokens - 1)
    return h2d, 0.0 if took is None else took / (tokens - 1)
