"""A Qwen3.5 prompt with images at the model level: embeddings + MRoPE rows for the text model.

    input ids   text … <|vision_start|> <|image_pad|>×N <|vision_end|> … text      [T]
    tower       VisionTower.encode(pixel_values, image_grid_thw)  -> [ΣN, hidden]
    embeds      token embeddings, the image-pad rows replaced by the tower's rows in order
    positions   mrope.mrope_positions -> [3, T] and the decode delta

then ``HybridModel.forward(batch, cache, embeds)`` with ``SeqInput.rope_positions`` = the rows
(``prefill_with_images``); a later decode token at absolute index i runs at i + delta on all three
rows (``decode_rope_positions``). Equal to transformers' Qwen3_5ForConditionalGeneration.forward
(tests/native/model/test_multimodal.py). Not wired into the engine or the frontend yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ninfer.errors import ModelLoadError
from ninfer.native.model.forward import (
    ForwardBatch,
    ForwardOutput,
    ModelCache,
    SeqInput,
)
from ninfer.native.model.model import HybridModel
from ninfer.native.model.mrope import mrope_positions
from ninfer.native.model.vision import VisionConfig, VisionTower, parse_vision_config


class VisionLanguageModel:
    """The text model and the vision tower of one Qwen3.5 directory, with its image token id."""

    def __init__(self, text: HybridModel, tower: VisionTower, vision_cfg: VisionConfig, image_token_id: int):
        self.text = text
        self.tower = tower
        self.vision_cfg = vision_cfg
        self.image_token_id = image_token_id

    @staticmethod
    def load(model_dir: str | Path, dtype: str | torch.dtype = "float32",
             device: torch.device | str = "cpu") -> VisionLanguageModel:
        path = Path(model_dir)
        text = HybridModel.load(path, dtype, device)
        raw = json.loads((path / "config.json").read_text())
        if not isinstance(raw.get("image_token_id"), int):
            raise ModelLoadError(f"{path / 'config.json'}: no integer 'image_token_id'")
        vcfg = parse_vision_config(raw)
        tower = VisionTower.load(path, vcfg, text.dtype, device)
        return VisionLanguageModel(text, tower, vcfg, raw["image_token_id"])

    def prompt_embeddings(self, input_ids: list[int] | torch.Tensor, pixel_values: torch.Tensor,
                          image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """-> (embeds [T, hidden] in the model dtype, rope positions [3, T], delta)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
        grid = torch.as_tensor(image_grid_thw, dtype=torch.long).reshape(-1, 3)
        positions, delta = mrope_positions(ids, self.image_token_id, grid, self.vision_cfg.spatial_merge_size)
        dev = self.text.device
        embeds = F.embedding(ids.to(dev), self.text.embed)
        image = self.tower.encode(pixel_values.to(dev), grid.to(dev)).to(embeds.dtype)
        mask = ids.to(dev) == self.image_token_id
        if int(mask.sum()) != image.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens but the images give {image.shape[0]} embeddings")
        embeds = embeds.clone()
        embeds[mask] = image
        return embeds, positions, delta

    def prefill_with_images(self, input_ids: list[int], pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                            cache: ModelCache, page_table: list[int], state_slot: int = 0,
                            logits: str = "all") -> tuple[ForwardOutput, int]:
        """The whole prompt as one chunk from position 0; returns (output, delta)."""
        embeds, positions, delta = self.prompt_embeddings(input_ids, pixel_values, image_grid_thw)
        seq = SeqInput(token_ids=list(input_ids), start=0, page_table=page_table, state_slot=state_slot,
                       logits=logits, rope_positions=positions)
        return self.text.forward(ForwardBatch.build([seq], self.text.device), cache, embeds), delta


def decode_rope_positions(start: int, n: int, delta: int) -> torch.Tensor:
    """Rotary rows [3, n] of n text tokens at absolute indices start .. start+n-1 after the prompt."""
    return torch.arange(start + delta, start + delta + n).expand(3, -1)
