"""Speculative decoding on and off, same machine, one run (issues 16, 17): decode tok/s per C,
tokens committed per target step, accepted length per block (drafts kept per verify row),
acceptance by draft position, and the on/off ratio — for the MTP head or a DFlash / DFlash2 draft
(``--method``; without ``--draft`` a fitted tiny draft is built next to the tiny model).

Each engine (in-process; one per setting: off, then each k of ``--drafts``) runs C concurrent requests
on prompts drawn from the tiny corpus (``--prompt-tokens`` each), ``--max-tokens`` greedy output
tokens each (temperature ``--temperature``, seeded). Every output is checked against the
speculation-off engine's: speculation must not change one token.
"""

from __future__ import annotations

import time

from ninfer.api import Engine
from ninfer.benchmarks.common import decode_window


def _prompts(tokenizer_dir: str, n: int, length: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens of the tiny corpus (the text the tokenizer was trained on)."""
    from tokenizers import Tokenizer

    from ninfer.tiny.corpus import CORPUS
    ids = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json").encode("\n".join(CORPUS)).ids
    step = max(length, (len(ids) - length) // max(n, 1))
    return [ids[i * step:i * step + length] for i in range(n)]


def measure(engine: Engine, prompts: list[list[int]], max_tokens: int, temperature: float) -> tuple[dict, list]:
    before = engine.stats().get("speculative") or {}
    t0 = time.perf_counter()
    hs = [engine.generate(p, max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=i)
          for i, p in enumerate(prompts)]
    firsts, outs, end = decode_window(hs)
    after = engine.stats().get("speculative") or {}
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    row = {"C": len(prompts), "decode_tok_s": decoded / max(1e-9, end - min(firsts)), "wall_s": end - t0}
    if after:
        steps = after["decode_steps"] - before.get("decode_steps", 0)
        drafted = after["drafted"] - before.get("drafted", 0)
        row["tokens_per_step"] = (after["tokens_per_step"] * after["decode_steps"]
                                  - before.get("tokens_per_step", 0) * before.get("decode_steps", 0)) / max(steps, 1)
        row["acceptance"] = (after["accepted"] - before.get("accepted", 0)) / max(drafted, 1)
        blocks = after["verify_rows"] - before.get("verify_rows", 0)
        row["accepted_per_block"] = (after["accepted"] - before.get("accepted", 0)) / max(blocks, 1)
    return row, [o.token_ids for o in outs]


def ensure_draft(model_dir: str, method: str) -> str:
    """The fitted tiny DFlash / DFlash2 draft of the tiny model at ``model_dir`` (built once,
    next to it)."""
    from pathlib import Path

    from ninfer.tiny.dflash import make_tiny_dflash
    path = Path(model_dir).parent / f"{Path(model_dir).name}-{method}"
    if not (path / "config.json").exists():
        make_tiny_dflash(model_dir, path, kind=method)
    return str(path)


def run(model_dir: str, out: str | None = None, plot: str | None = None, drafts=None,
        concurrency=(1, 4, 8), max_tokens: int = 64, prompt_tokens: int = 32, temperature: float = 0.0,
        dtype: str = "float32", method: str = "mtp", draft: str | None = None) -> dict:
    from ninfer.benchmarks.common import ensure_model, report
    from ninfer.progress import bar
    model_dir = ensure_model(model_dir)
    if method != "mtp" and draft is None:
        draft = ensure_draft(model_dir, method)
    drafts = drafts or ((1, 2, 3) if method == "mtp" else (3, 7))
    cfg = {"max_concurrency": max(concurrency), "max_context": 512, "cost_calibration": False}
    prompts = _prompts(model_dir, max(concurrency), prompt_tokens)
    rows, by_position, baseline = [], {}, {}
    settings = (0, *drafts)
    progress = bar(total=len(settings) * len(concurrency), desc="speculative", unit="run")
    for k in settings:
        spec = {"speculative": {"method": method, "num_tokens": k, **({"draft": draft} if draft else {})}} if k else {}
        eng = Engine.start(model_dir, config={**cfg, **spec}, dtype=dtype, transport="inproc")
        try:
            measure(eng, prompts[:1], 8, temperature)            # warm up
            for c in concurrency:
                row, tokens = measure(eng, prompts[:c], max_tokens, temperature)
                if k == 0:
                    baseline[c] = (row["decode_tok_s"], tokens)
                row["same_tokens"] = tokens == baseline[c][1]
                row["ratio_on_off"] = row["decode_tok_s"] / baseline[c][0]
                rows.append({"drafts": k, **row})
                progress.update()
            if k:
                by_position[k] = eng.stats()["speculative"]["acceptance_by_position"]
        finally:
            eng.shutdown()
    progress.close()
    drafter = "MTP head fitted by make-tiny-model" if method == "mtp" else f"{method} draft {draft}"
    result = {"method": method,
              "note": f"tiny model ({drafter}), {dtype}, CPU, in-process; "
                      f"{prompt_tokens}-token corpus prompts, {max_tokens} output tokens, temperature {temperature}",
              "acceptance_by_position": {str(k): v for k, v in by_position.items()},
              "all_same_tokens": all(r["same_tokens"] for r in rows)}
    report("speculative", result, rows, ["drafts", "C", "decode_tok_s", "ratio_on_off", "tokens_per_step",
                                         "accepted_per_block", "acceptance", "same_tokens"], out, plot)
    for k, v in by_position.items():
        print(f"k={k}: acceptance by draft position " + ", ".join(f"{a:.2f}" for a in v))
    return {**result, "rows": rows}
