"""Shared fixtures: one thread per process (DESIGN.md §8) and the tiny model directories."""

from __future__ import annotations

import os

import pytest
import torch

from tests.factories import shared_build

torch.set_num_threads(int(os.environ.get("NINFER_TORCH_THREADS", "1")))
# every engine built in the suite checks the seed's rules as invariants on every cycle
# (ninfer/engine/monitor.py) — in this process, in spawned sweep workers and in Ray actors
os.environ.setdefault("NINFER_RULE_MONITOR", "1")
# ... and every quote's memoised facts against a quote from scratch (native/reclaim.py FactsMemo)
os.environ.setdefault("NINFER_CHECK_FACTS", "1")


def _switches() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("NINFER_") or k == "TRITON_INTERPRET"}


@pytest.fixture(autouse=True)
def _no_switch_left_set():
    """A test that leaves one of NInfer's environment switches changed fails here: the xdist
    worker's later tests would run under it (``NINFER_GRAPHS=replay`` left by an in-process
    ``gpu_stages.main`` once made every later Program in its worker capture graphs). Change
    them with ``monkeypatch.setenv``, which puts them back."""
    before = _switches()
    yield
    after = _switches()
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        os.environ.update(before)
        for k in after.keys() - before.keys():
            del os.environ[k]
        pytest.fail(f"the test left environment switches changed: {changed} (use monkeypatch.setenv)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The default tiny hybrid model (qwen3_next), with tokenizer and chat template."""
    from ninfer.tiny.build import make_tiny_model

    return shared_build(tmp_path_factory, "tiny_next", lambda d: make_tiny_model(d, seed=0, arch="qwen3_next"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """The pure-attention tiny model (qwen3)."""
    from ninfer.tiny.build import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), seed=1, arch="qwen3"))


@pytest.fixture(scope="session")
def tiny_vision(tmp_path_factory) -> str:
    """The tiny Qwen3.5 vision-language model (qwen3_5_vision): text model + vision tower,
    preprocessor_config.json and a chat template with image parts."""
    from ninfer.tiny.build import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_vision"), seed=0, arch="qwen3_5_vision"))


@pytest.fixture(scope="session")
def tiny_dflash(tiny_model, tmp_path_factory) -> str:
    """A DFlash draft for the tiny model (block 8, fitted to it: drafts are really accepted)."""
    from ninfer.tiny.dflash import make_tiny_dflash

    return shared_build(tmp_path_factory, "tiny_dflash",
                        lambda d: make_tiny_dflash(tiny_model, d, kind="dflash", seed=0))


@pytest.fixture(scope="session")
def tiny_dflash2(tiny_model, tmp_path_factory) -> str:
    """A DFlash2 draft for the tiny model with a 96-position window, so that short workloads
    already slide it (the real drafts' 2,048 is tested on its own)."""
    from ninfer.tiny.dflash import make_tiny_dflash

    return shared_build(tmp_path_factory, "tiny_dflash2",
                        lambda d: make_tiny_dflash(tiny_model, d, kind="dflash2", seed=1, window=96))


MODEL_FIXTURES = {"tiny_model", "tiny_qwen3", "tiny_vision", "tiny_dflash", "tiny_dflash2"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) every test that needs
    the local Ray instance runs on one worker, so one Ray is started per suite, not per worker.

    The quick tier (``pytest -m "not slow"``) is the model-free one: a test that needs a tiny
    model (one of MODEL_FIXTURES: seconds to build, seconds per engine test) or Ray is slow
    without a marker of its own; long workloads carry ``@pytest.mark.slow`` themselves."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))
        if item.get_closest_marker("slow") is None and (
                item.get_closest_marker("ray") is not None or MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.slow)
