"""``ninfer demo``: the main job on the built-in tiny model.

A short agent conversation — shared system prompt with tools, a user question, a tool call and
its result, a follow-up — rendered with the model's chat template and generated turn by turn.
The tiny model's weights are random, so its words are noise; what the demo shows is the path
(template → exact tokens → generation) and its timings.

At this stage generation runs through the reference generator (the oracle); the engine and
its actors replace it as they land.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ninfer.frontend.render import load_chat_tokenizer, render_chat
from ninfer.reference import generate_with_model, load_cached
from ninfer.sampling_params import SamplingParams

SYSTEM = "You are a helpful travel assistant. Answer briefly and use tools when they help."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


def _turns() -> list[tuple[str, dict | None]]:
    """(label, message appended before generating) — None means 'generate after the tool result'."""
    call = {"role": "assistant", "content": None, "tool_calls": [{
        "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    return [
        ("user asks", {"role": "user", "content": "What should I pack for Paris tomorrow?"}),
        ("tool result", [call, {"role": "tool", "content": '{"temp_c": 14, "sky": "rain"}'}]),
        ("follow-up", {"role": "user", "content": "And for Lyon the day after?"}),
    ]


def ensure_model(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        from ninfer.tiny.build import make_tiny_model

        print(f"building the tiny model in {path} ...")
        make_tiny_model(path)
    return path


def run_demo(model_dir: str | Path = "models/tiny", dtype: str = "float32", max_tokens: int = 24) -> int:
    torch.set_num_threads(1)
    path = ensure_model(model_dir)
    model, eos = load_cached(path, dtype)
    tok = load_chat_tokenizer(str(path.resolve()))
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    rows = []
    print(f"model {path} ({model.cfg.model_type}, {dtype}); generation: reference path (no cache)\n")
    for label, new in _turns():
        messages.extend(new if isinstance(new, list) else [new])
        prompt = render_chat(path, messages, tools=TOOLS)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.95, seed=len(rows))
        t0 = time.perf_counter()
        out = generate_with_model(model, eos, prompt, params)
        dt = time.perf_counter() - t0
        text = tok.decode(out)
        messages.append({"role": "assistant", "content": text})
        rows.append((label, len(prompt), len(out), dt))
        print(f"[{label}] prompt {len(prompt)} tokens -> {len(out)} tokens in {dt * 1000:.0f} ms")
        print(f"  assistant: {text[:100]!r}\n")
    print(f"{'turn':<12} {'prompt':>7} {'output':>7} {'ms':>8} {'tok/s':>7}")
    for label, p, o, dt in rows:
        print(f"{label:<12} {p:>7} {o:>7} {dt * 1000:>8.0f} {o / dt:>7.1f}")
    return 0
