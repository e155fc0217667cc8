"""``ninfer make-tiny-model``: a complete Hugging Face model directory, made without a hub.

Writes config.json, model.safetensors (seeded random weights, one MTP layer for qwen3_next in
the layout real Qwen3-Next checkpoints use), a locally trained byte-level BPE tokenizer with a
Qwen-style chat template, and generation_config.json. ``qwen3_5_vision`` is a Qwen3.5
vision-language directory (ninfer/tiny/vision.py), with a preprocessor_config.json and a chat
template that renders image parts; NInfer loads its text model and vision tower
(native/model/multimodal.py) and prepares its images (frontend/media.py). The directory loads
unchanged in transformers and goes through the same loader as a real checkpoint.

A random MTP head's drafts would never match the random target, so for qwen3_next the head is
then fitted to it (ninfer/tiny/mtp_fit.py: ~5 s of fitting on the target's own
trajectories; only the ``mtp.*`` tensors change) and some drafts are accepted.
``fit_mtp=False`` (CLI ``--no-fit-mtp``) keeps the random head.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from ninfer.native.model.config import parse_config
from ninfer.tiny.vision import (
    preprocessor_config,
    qwen3_5_vision_config,
    random_vision_model,
)
from ninfer.tiny.weights import qwen3_config, qwen3_next_config, random_tensors

TEXT_CONFIGS = {"qwen3_next": qwen3_next_config, "qwen3": qwen3_config}
ARCHES = (*TEXT_CONFIGS, "qwen3_5_vision")
VOCAB_SIZE = 2048


def write_model_files(out: Path, arch: str, seed: int, vocab_size: int, eos: list[int], pad: int,
                      vision_ids: dict[str, int] | None = None) -> None:
    """config.json + model.safetensors (+ generation_config.json) for ``arch``.

    ``qwen3_5_vision`` needs ``vision_ids``: the ids of the tokenizer's VISION_TOKENS.
    """
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r} (choose from {', '.join(ARCHES)})")
    out.mkdir(parents=True, exist_ok=True)
    if arch == "qwen3_5_vision":
        raw = qwen3_5_vision_config(vocab_size, eos, pad, vision_ids)
        tensors = random_vision_model(raw, seed)
        (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    else:
        raw = TEXT_CONFIGS[arch](vocab_size, eos, pad)
        tensors = random_tensors(parse_config(raw, mtp_layers=1 if arch == "qwen3_next" else 0), seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def make_tiny_model(out_dir: str | Path, seed: int = 0, arch: str = "qwen3_next", fit_mtp: bool = True) -> Path:
    """Create (or overwrite) a tiny model directory with tokenizer files; returns its path.

    ``fit_mtp``: fit the qwen3_next MTP head (seeded by ``seed``; ignored for arches without one)."""
    from ninfer.tiny.tokenizer import build_tokenizer, token_ids

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=VOCAB_SIZE, vision=arch == "qwen3_5_vision")
    ids = token_ids(out)
    write_model_files(out, arch, seed, VOCAB_SIZE, [ids["<|im_end|>"], ids["<|endoftext|>"]], ids["<|endoftext|>"],
                      vision_ids=ids)
    if fit_mtp and arch == "qwen3_next":
        from ninfer.tiny.mtp_fit import fit_mtp as fit

        fit(out, seed=seed, measure=False)
    return out
