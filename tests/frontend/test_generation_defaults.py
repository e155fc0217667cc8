"""vLLM's defaults: the model's generation_config.json sampling values apply to what a request
leaves unset (``--generation-config auto``, the server's default; ``vllm`` ignores them), and a
chat without max_tokens may use the rest of the context. The Python API keeps its documented
defaults unless ``Engine.start(generation_config="auto")``."""

from __future__ import annotations

import json
import shutil

import pytest
from starlette.testclient import TestClient

import ninfer
from ninfer.errors import ConfigError
from ninfer.frontend.options import generation_defaults
from ninfer.frontend.server import Server

CONFIG = {"max_concurrency": 2, "max_context": 256}
USER = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def tuned(tiny_model, tmp_path_factory):
    """The tiny model with Qwen3-style sampling defaults in its generation_config.json."""
    d = tmp_path_factory.mktemp("tuned") / "m"
    shutil.copytree(tiny_model, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=7)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return str(d)


def test_generation_defaults_read_the_sampling_keys(tuned, tiny_model, tmp_path):
    assert generation_defaults(tuned) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7}
    assert generation_defaults(tuned, "vllm") == {} and generation_defaults(tiny_model) == {}
    assert generation_defaults(tiny_model, tuned)["temperature"] == 0.6          # a directory
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ConfigError, match="temperature"):
        generation_defaults(bad)
    (bad / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ConfigError, match="top_p"):
        generation_defaults(bad)


def _chat(tc, **kw) -> dict:
    r = tc.post("/v1/chat/completions", json={"messages": USER, "return_token_ids": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_server_applies_the_models_defaults_unless_told_vllm(tuned):
    eng = ninfer.Engine.start(tuned, config=CONFIG, transport="inproc")
    try:
        with TestClient(Server(eng, "tiny").app) as tc:
            free = _chat(tc, seed=5)
            assert free["usage"]["completion_tokens"] == 7                 # max_new_tokens
            same = _chat(tc, seed=5, temperature=0.6, top_p=0.95, top_k=20, max_tokens=7)
            assert free["choices"][0]["token_ids"] == same["choices"][0]["token_ids"]
            hot = _chat(tc, seed=5, temperature=1.0, top_p=1.0, top_k=0, max_tokens=7)
            # (the request's own values win over the file's: a different distribution here)
            assert hot["choices"][0]["token_ids"] != same["choices"][0]["token_ids"]
        with TestClient(Server(eng, "tiny", generation_config="vllm").app) as tc:
            plain = _chat(tc, seed=5, max_tokens=7)
            assert plain["choices"][0]["token_ids"] == hot["choices"][0]["token_ids"]
    finally:
        eng.shutdown()


def test_a_chat_without_max_tokens_may_use_the_rest_of_the_context(tiny_model):
    eng = ninfer.Engine.start(tiny_model, config=CONFIG, transport="inproc")
    try:
        with TestClient(Server(eng, "tiny").app) as tc:
            r = _chat(tc, temperature=0, ignore_eos=True)
            assert r["choices"][0]["finish_reason"] == "length"
            assert r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == CONFIG["max_context"]
            legacy = tc.post("/v1/completions", json={"prompt": "hello", "ignore_eos": True}).json()
            assert legacy["usage"]["completion_tokens"] == 16                # OpenAI's default there
    finally:
        eng.shutdown()


def test_the_python_api_keeps_its_defaults_unless_started_with_auto(tuned):
    prompt = ninfer.render_chat(tuned, USER)
    plain = ninfer.Engine.start(tuned, config=CONFIG, transport="inproc")
    try:
        greedy = plain.generate(prompt, max_tokens=6, seed=2).result().token_ids
        assert greedy == plain.generate(prompt, max_tokens=6, seed=2, temperature=0.0).result().token_ids
    finally:
        plain.shutdown()
    auto = ninfer.Engine.start(tuned, config=CONFIG, transport="inproc", generation_config="auto")
    try:
        assert auto.sampling_defaults["temperature"] == 0.6
        got = auto.generate(prompt, max_tokens=6, seed=2).result().token_ids
        assert got == auto.generate(prompt, max_tokens=6, seed=2, temperature=0.6, top_p=0.95,
                                    top_k=20).result().token_ids
    finally:
        auto.shutdown()
