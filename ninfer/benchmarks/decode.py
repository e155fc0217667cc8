"""Decode throughput of the model forward: the device's path (``paths.CPU`` on the CPU in fp32,
the kernels on CUDA) against the per-sequence reference beside it (``ninfer.native.model.paths``),
at C = 1, 2, 4, 8 decode rows per call.

Each C gets C sequences with ragged contexts (``CONTEXT`` + 24 * i tokens, so the rows cross
page boundaries at different steps), prefilled alone; then ``STEPS`` greedy decode calls
of all C rows run on each path from the same cache image, alternating paths ``REPEATS`` times
(best of the repeats: the machine is shared). Both paths must produce the same tokens.
Model-level only — no engine, no sampling beyond argmax — so the ratio is the forward's own.
"""

from __future__ import annotations

import time

import torch

from ninfer.native.model import paths
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.forward import ForwardBatch, ModelCache, SeqInput
from ninfer.native.model.model import HybridModel
from ninfer.native.threads import pin as pin_threads

CONTEXT, STEPS, REPEATS = 160, 32, 3


def _prefilled(model: HybridModel, c: int):
    """A cache with c sequences prefilled (alone), their page tables and their next tokens."""
    lens = [CONTEXT + 24 * i for i in range(c)]
    per_seq = (max(lens) + STEPS + PAGE_SIZE - 1) // PAGE_SIZE
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(c)]
    cache = model.new_cache(c * per_seq, c)
    g = torch.Generator().manual_seed(c)
    nxt = []
    for i, n in enumerate(lens):
        prompt = torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
        out = model.forward(ForwardBatch.build([SeqInput(prompt, 0, tables[i], i)], model.device), cache)
        nxt.append(int(out.logits[-1].argmax()))
    return cache, tables, lens, nxt


def _decode(model: HybridModel, cache: ModelCache, tables, lens, nxt) -> tuple[float, list[list[int]]]:
    toks = [[t] for t in nxt]
    t0 = time.perf_counter()
    for step in range(STEPS):
        rows = [SeqInput([toks[i][-1]], lens[i] + step, tables[i], i) for i in range(len(lens))]
        out = model.forward(ForwardBatch.build(rows, model.device), cache)
        for i, t in enumerate(out.logits.argmax(-1).tolist()):
            toks[i].append(t)
    return time.perf_counter() - t0, toks


def measure(model: HybridModel, c: int) -> list[dict]:
    cache, tables, lens, nxt = _prefilled(model, c)
    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    chosen = model.path                     # the device's own path (cpu on the CPU in fp32, kernels on CUDA)
    for _ in range(REPEATS):
        for path in (chosen, paths.PER_SEQUENCE):
            model.path = path
            work = ModelCache(*(t.clone() for t in (cache.k, cache.v, cache.conv, cache.ssm)))
            dt, toks = _decode(model, work, tables, lens, nxt)
            best[path.name] = min(best.get(path.name, dt), dt)
            tokens[path.name] = toks
    model.path = chosen
    same = tokens[chosen.name] == tokens[paths.PER_SEQUENCE.name]
    return [{"path": name, "C": c, "ms_per_step": 1e3 * dt / STEPS, "decode_tok_s": c * STEPS / dt,
             "same_tokens": same} for name, dt in best.items()]


def run(model_dir: str, out: str | None = None, dtype: str = "float32", plot: str | None = None) -> dict:
    from ninfer.benchmarks.common import ensure_model, report
    pin_threads(1)
    model = HybridModel.load(ensure_model(model_dir), dtype)
    rows = []
    for c in (1, 2, 4, 8):
        rows.extend(measure(model, c))
    tok_s = {(r["path"], r["C"]): r["decode_tok_s"] for r in rows}
    ratio = tok_s[(model.path.name, 8)] / tok_s[("per_sequence", 8)]
    result = {"note": f"model forward only, tiny model, {dtype}, CPU, one torch thread; contexts "
                      f"{CONTEXT} + 24 i tokens, {STEPS} greedy steps, best of {REPEATS}",
              "ratio_at_C8": ratio}
    report("decode", result, rows, ["path", "C", "ms_per_step", "decode_tok_s", "same_tokens"], out, plot)
    print(f"\n{model.path.name} / per-sequence decode tok/s at C=8: {ratio:.2f}x")
    return {**result, "rows": rows}
