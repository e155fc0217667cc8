"""The tiny DFlash drafts (tiny/dflash.py) and their fit (tiny/dflash_fit.py).

Generation is deterministic (same seed, same bytes); the fit is deterministic too and its
drafts are accepted far above chance (1/2048) where the random draft's almost never are; the
default fit of ``make_tiny_dflash`` reaches the documented floor (slow).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ninfer.native.model.dflash import DFlashDraft
from ninfer.native.model.model import HybridModel
from ninfer.tiny.build import make_tiny_model
from ninfer.tiny.dflash import make_tiny_dflash
from ninfer.tiny.dflash_fit import dflash_acceptance, fit_dflash
from ninfer.tiny.mtp_fit import corpus_stream

# Measured (seed 0): the default fit's first drafts 0.039 (dflash) / 0.059 (dflash2) of ~1000
# held-out blocks; the small fit below ~0.04 of ~400; a random draft <= 0.001. Chance: 0.0005.
FIRST_DRAFT_FLOOR = 0.02
SMALL = {"steps": 3, "sequences": 32, "new_tokens": 32, "measure": False}
TINY = {"steps": 3, "sequences": 8, "new_tokens": 12, "batch": 4, "measure": False}   # bytes only
MEASURE = {"prompts": 12}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("dflash_fit_target"), seed=0, arch="qwen3_next", fit_mtp=False)


def _bytes(d) -> bytes:
    return (d / "model.safetensors").read_bytes() + (d / "config.json").read_bytes()


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_generation_is_deterministic(target_dir, tmp_path, kind):
    a = make_tiny_dflash(target_dir, tmp_path / "a", kind, seed=3, fit=False)
    b = make_tiny_dflash(target_dir, tmp_path / "b", kind, seed=3, fit=False)
    c = make_tiny_dflash(target_dir, tmp_path / "c", kind, seed=4, fit=False)
    assert _bytes(a) == _bytes(b) != _bytes(c)
    draft = DFlashDraft.load(a, HybridModel.load(target_dir, "float32"))
    assert draft.cfg.kind == kind and draft.cfg.block_size == 8
    assert draft.cfg.mask_token_id not in corpus_stream(target_dir)      # text never encodes to it


@pytest.mark.slow          # fits a draft (seconds of training)
def test_fit_is_deterministic(target_dir, tmp_path):
    """Same seed, same written bytes (DFlash2: every tensor kind, the selector's included)."""
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        runs[name] = fit_dflash(target_dir, make_tiny_dflash(target_dir, tmp_path / name, "dflash2", fit=False),
                                seed=seed, **TINY)
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "b") != _bytes(tmp_path / "c")
    a, b = runs["a"], runs["b"]
    assert all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
    assert a["loss_warm"] < a["loss_before"] and a["loss_after"] < a["loss_before"]
    stored = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert stored.keys() == a["tensors"].keys() and all(v.dtype == torch.bfloat16 for v in stored.values())


@pytest.mark.slow          # fits a draft (seconds of training)
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_small_fit_beats_chance(target_dir, tmp_path, kind):
    random = make_tiny_dflash(target_dir, tmp_path / "random", kind, fit=False)
    fit_dflash(target_dir, make_tiny_dflash(target_dir, tmp_path / "fitted", kind, fit=False), **SMALL)
    fitted = dflash_acceptance(target_dir, tmp_path / "fitted", **MEASURE)
    base = dflash_acceptance(target_dir, random, **MEASURE)
    assert fitted["positions"] >= 200
    assert fitted["first"] >= FIRST_DRAFT_FLOOR > 10 * base["first"]
    assert fitted["first"] <= fitted["mean_accepted"] <= fitted["drafts"] * fitted["first"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_default_fit_reaches_the_floor(target_dir, tmp_path, kind):
    d = make_tiny_dflash(target_dir, tmp_path / kind, kind)
    acc = dflash_acceptance(target_dir, d)
    assert acc["positions"] >= 1000
    assert acc["first"] >= FIRST_DRAFT_FLOOR
