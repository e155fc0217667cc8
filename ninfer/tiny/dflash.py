"""A tiny DFlash / DFlash2 draft directory for the tiny target, made without a hub.

Writes config.json (the reference's layout: draft parameters under ``dflash_config``) and
model.safetensors (seeded random weights in bfloat16, the reference's state-dict names), and
nothing else: the draft uses the target's embedding, lm_head and tokenizer. ``fit`` then trains
it on the target's own greedy continuations (ninfer/tiny/dflash_fit.py) so that some first
drafts are accepted; a random draft's almost never are.

The mask token is the byte symbol 0xFF: it never occurs in UTF-8 text, so encoding a string
never yields it, and the target has an embedding row for it (the byte-level BPE keeps all 256
byte symbols).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ninfer.native.model.config import ModelConfig, load_config
from ninfer.native.model.dflash_config import (
    ARCHITECTURES,
    DFlashConfig,
    expected_tensors,
    parse_draft_config,
)

KINDS = {kind: arch for arch, kind in ARCHITECTURES.items()}   # "dflash" -> "DFlashDraftModel"
MASK_SYMBOL = "ÿ"          # byte 0xFF in the byte-level alphabet: never produced from text
TAP_LAYERS = (1, 3)        # of the tiny target's 5 layers


def mask_token_id(target_dir: Path) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return tok.token_to_id(MASK_SYMBOL)


def tiny_draft_config(target: ModelConfig, kind: str, mask_id: int, *, layers: int = 2, block_size: int = 8,
                      window: int = 2048, taps: tuple[int, ...] = TAP_LAYERS) -> dict:
    """The config.json dict of a tiny draft: 4 heads of 64 (2 KV heads), intermediate 256; DFlash2
    with sliding windows of ``window``, a kernel-2 conv of 16-channel groups and a rank-32 top-8
    selector."""
    if kind not in KINDS:
        raise ValueError(f"unknown draft kind {kind!r} (choose from {', '.join(KINDS)})")
    # a small embedding scale keeps the mask rows' own embedding from drowning what attention
    # brings them (dflash_fit.warm_start): in the residual stream it is a fixed bias of every row
    draft: dict = {"block_size": block_size, "mask_token_id": mask_id, "target_layer_ids": list(taps),
                   "input_embedding_scale": 0.01}
    raw: dict = {
        "architectures": [KINDS[kind]], "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False,
        "hidden_size": target.hidden_size, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "vocab_size": target.vocab_size, "max_position_embeddings": 4096,
        "num_target_layers": target.num_hidden_layers, "tie_word_embeddings": False, "dtype": "bfloat16",
        "dflash_config": draft,
    }
    if kind == "dflash2":
        raw.update(layer_types=["sliding_attention"] * layers, sliding_window=window, use_sliding_window=True,
                   is_causal=False)
        draft.update(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=8,
                     output_multiplier=1.0, final_logit_softcapping=30.0)
    return raw


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Initial value of one tensor, by its role: norms near 1, projections of unit gain, convs
    near the identity (offset 0) with a clear dynamic part, codebooks whose bigram term is of the
    order of one logit."""
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    if name.endswith("norm.weight"):
        return normal(0.1, 1.0)
    if name.endswith("base_kernel"):
        t = normal(0.3)
        t[:, 0] += 1.0
        return t
    if name.endswith("kernel_projection.weight"):
        return normal(0.3 / math.sqrt(shape[1]))
    if name.endswith("codebook.weight"):
        return normal(shape[1] ** -0.25)
    return normal(1.0 / math.sqrt(shape[1]))


def random_draft_tensors(cfg: DFlashConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``expected_tensors(cfg)``, seeded (float32)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_tensors(cfg)
    return {name: _init(name, shapes[name], gen).contiguous() for name in sorted(shapes)}


def write_weights(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The draft's model.safetensors, in bfloat16 (the dtype its config names)."""
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})


def write_draft(out: Path, raw: dict, tensors: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_weights(out, tensors)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def make_tiny_dflash(target_dir: str | Path, out_dir: str | Path, kind: str = "dflash", *, seed: int = 0,
                     layers: int = 2, block_size: int = 8, window: int = 2048, fit: bool = True) -> Path:
    """Create (or overwrite) a draft directory for the tiny target in ``target_dir``; returns its
    path. ``fit``: train it on the target's continuations (``dflash_fit.fit_dflash``, seeded by
    ``seed``)."""
    target, out = Path(target_dir), Path(out_dir)
    raw = tiny_draft_config(load_config(target), kind, mask_token_id(target), layers=layers,
                            block_size=block_size, window=window)
    write_draft(out, raw, random_draft_tensors(parse_draft_config(raw), seed))
    if fit:
        from ninfer.tiny.dflash_fit import fit_dflash

        fit_dflash(target, out, seed=seed, measure=False)
    return out
