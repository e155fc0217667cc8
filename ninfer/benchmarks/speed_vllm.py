"""The vLLM side of ``ninfer bench speed --vs-vllm``: run by vLLM's own Python (its venv, not
ours), so it imports nothing from ninfer — only the standard library and vllm.

    VLLM_CPU_KVCACHE_SPACE=1 /work/vllm-venv/bin/python speed_vllm.py MODEL_DIR LANES MAX_CONTEXT

One engine (``LLMEngine``: bf16, eager, ``LANES`` sequences at most, ``MAX_CONTEXT`` positions)
serves JSON commands, one per line on stdin; each answer is one stdout line starting with
``@@speed `` (vLLM's own log lines go to stderr, and any other stdout line is not an answer):

    {"op": "batch", "reqs": [{"prompt": [ids], "max_tokens": m, "arrival_s": s}, ...],
     "time_scale": x | null, "reset_cache": bool}
        -> {"records": [{"first_s", "end_s", "tokens"}, ...]}   seconds since the batch began,
           each request submitted at arrival_s * x (all at once when x is null); greedy, ignore_eos
    {"op": "quit"}  -> the engine is shut down and the process exits

Started in a session of its own by the caller, which ends the whole process group after
"quit": vLLM's engine-core and worker processes outlive a driver that exits with os._exit.
"""

from __future__ import annotations

import json
import sys
import time

MARK = "@@speed "


def _answer(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _batch(engine, cmd: dict, counter: list[int]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if cmd.get("reset_cache"):
        engine.reset_prefix_cache()
    reqs, scale = cmd["reqs"], cmd.get("time_scale")
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].get("arrival_s", 0.0))
    records = [{"first_s": None, "end_s": None, "tokens": 0} for _ in reqs]
    ids: dict[str, int] = {}
    t0, nxt = time.monotonic(), 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while nxt < len(order) and (scale is None or reqs[order[nxt]].get("arrival_s", 0.0) * scale <= now):
            i = order[nxt]
            counter[0] += 1
            rid = f"r{counter[0]}"
            ids[rid] = i
            params = SamplingParams(max_tokens=reqs[i]["max_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=reqs[i]["prompt"]), params)
            nxt += 1
        if not engine.has_unfinished_requests():
            due = reqs[order[nxt]].get("arrival_s", 0.0) * scale
            time.sleep(max(0.0, min(0.005, due - (time.monotonic() - t0))))
            continue
        for out in engine.step():
            rec = records[ids[out.request_id]]
            t = time.monotonic() - t0
            if rec["first_s"] is None and out.outputs and out.outputs[0].token_ids:
                rec["first_s"] = t
            if out.finished:
                rec["end_s"] = t
                rec["tokens"] = len(out.outputs[0].token_ids)
    return {"records": records}


def main(argv: list[str]) -> int:
    model, lanes, max_context = argv[0], int(argv[1]), int(argv[2])
    from vllm import EngineArgs, LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(model=model, dtype="bfloat16", max_model_len=max_context,
                                                   max_num_seqs=lanes, enforce_eager=True, seed=0))
    import vllm
    _answer({"ready": True, "version": getattr(vllm, "__version__", None) or _version()})
    counter = [0]
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            _answer(_batch(engine, cmd, counter))
        except Exception as exc:            # noqa: BLE001 — reported to the caller, which stops
            _answer({"error": f"{type(exc).__name__}: {exc}"})
    try:
        engine.engine_core.shutdown()
    finally:
        _answer({"bye": True})
    return 0


def _version() -> str | None:
    from importlib import metadata
    for dist in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


if __name__ == "__main__":          # vLLM starts its engine core by spawn: the guard is required
    import os
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
