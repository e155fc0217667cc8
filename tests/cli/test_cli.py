"""The command line as a user runs it: make a tiny model, run the demo, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.factories import shared_build


def _ninfer(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "ninfer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``ninfer make-tiny-model DIR --seed 0`` — once for both xdist workers (shared_build)."""
    def build(d):
        r = _ninfer("make-tiny-model", str(d), "--seed", "0")
        assert r.returncode == 0, r.stderr
    return Path(shared_build(tmp_path_factory, "cli_tiny", build))


@pytest.mark.slow          # builds a tiny model through the CLI (a minute on 2 cores)
def test_make_tiny_model_writes_a_hf_directory(made):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (made / name).is_file(), name
    cfg = json.loads((made / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and "linear_attention" in cfg["layer_types"]


@pytest.mark.slow          # builds a tiny model through the CLI (a minute on 2 cores)
def test_make_tiny_model_is_deterministic(made, tiny_model):
    """The CLI's build (its own process, MTP head fitted) equals the suite's in-process build of
    the same seed byte for byte."""
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (Path(tiny_model) / name).read_bytes() == (made / name).read_bytes(), name


@pytest.mark.slow          # builds a tiny model through the CLI (a minute on 2 cores)
def test_make_tiny_vision_model(tmp_path):
    from ninfer.tiny.tokenizer import token_ids

    r = _ninfer("make-tiny-model", str(tmp_path / "v"), "--arch", "qwen3_5_vision")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and {"text_config", "vision_config"} <= set(cfg)
    ids = token_ids(tmp_path / "v")
    assert (cfg["image_token_id"], cfg["vision_start_token_id"], cfg["vision_end_token_id"]) == (
        ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"])
    assert max(ids.values()) == cfg["text_config"]["vocab_size"] - 1


@pytest.mark.slow          # builds a tiny model through the CLI (a minute on 2 cores)
def test_make_tiny_dflash_writes_a_draft_the_engine_loads(made, tmp_path):
    """`ninfer make-tiny-dflash TARGET DIR --kind dflash2 --window 128 --no-fit`: z-lab's layout
    (config.json with dflash_config, safetensors) that the engine's layout solve reads."""
    from ninfer.native.model.dflash_config import load_draft_config

    r = _ninfer("make-tiny-dflash", str(made), str(tmp_path / "d"), "--kind", "dflash2", "--window", "128",
                "--no-fit")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and "target_layer_ids" in cfg["dflash_config"]
    parsed = load_draft_config(tmp_path / "d")
    assert parsed.kind == "dflash2" and parsed.window == 128
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "d").iterdir())


@pytest.mark.ray
def test_demo_runs_through_the_ray_actors(made):
    r = _ninfer("demo", "--model", str(made))
    assert r.returncode == 0, r.stderr
    assert "transport=ray" in r.stdout
    assert "outputs compared with isolated, uncached runs — all identical" in r.stdout
    assert "leak check after drop_caches: clean" in r.stdout
    assert "pauses" in r.stdout and "ttft_ms" in r.stdout


@pytest.mark.slow          # builds a tiny model through the CLI (a minute on 2 cores)
def test_demo_builds_the_model_when_missing(tmp_path):
    r = _ninfer("demo", "--model", str(tmp_path / "fresh"), "--transport", "inproc")
    assert r.returncode == 0, r.stderr
    assert "building the tiny model" in r.stdout
    assert (tmp_path / "fresh" / "model.safetensors").is_file()
    assert "all identical" in r.stdout


@pytest.mark.slow          # needs the CLI-built model (``made``: a minute on 2 cores)
@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(model_type="mamba"), "model_type 'mamba' is not supported"),
    (lambda c: c.update(linear_num_value_heads=3), "linear_num_value_heads (3) must be a multiple"),
], ids=["model_type", "inconsistent"])
def test_bad_model_directory_gives_one_line(made, tmp_path, edit, needle):
    d = tmp_path / "bad"
    shutil.copytree(made, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    r = _ninfer("demo", "--model", str(d))
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
