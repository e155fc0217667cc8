"""Qwen3.5 MRoPE: position ids of a prompt with images, and the interleaved rotary angles."""

from __future__ import annotations

import pytest
import torch

from ninfer.errors import ModelLoadError
from ninfer.native.model.config import parse_config
from ninfer.native.model.mrope import mrope_positions
from ninfer.native.model.ops import Rope
from ninfer.tiny.vision import qwen3_5_vision_config
from ninfer.tiny.weights import qwen3_next_config

IMG, START, END = 2000, 2001, 2002
VISION_IDS = {"<|image_pad|>": IMG, "<|video_pad|>": 2003, "<|vision_start|>": START, "<|vision_end|>": END}
GRIDS = [[1, 6, 4], [1, 4, 10]]  # 3×2 and 2×5 merged tokens


def _prompt() -> list[int]:
    return [5, 6, 7, START, *[IMG] * 6, END, 8, 9, START, *[IMG] * 10, END, 10, 11, 12]


def test_positions_follow_the_rule():
    pos, delta = mrope_positions(_prompt(), IMG, torch.tensor(GRIDS))
    assert pos[:, :4].tolist() == [[0, 1, 2, 3]] * 3
    # first image at s = 4: t = 4, h = 4 + (0..2), w = 4 + (0..1), raster order over (h, w)
    assert pos[:, 4:10].tolist() == [[4] * 6, [4, 4, 5, 5, 6, 6], [4, 5, 4, 5, 4, 5]]
    assert pos[:, 10].tolist() == [7, 7, 7]                 # <|vision_end|>: s + max(3, 2)
    assert pos[:, -1].tolist() == [pos.max().item()] * 3
    assert delta == pos.max().item() + 1 - len(_prompt())


def test_token_count_must_match_the_grid():
    with pytest.raises(ValueError, match="needs 6 image tokens, has 5"):
        mrope_positions([5, START, *[IMG] * 5, END], IMG, torch.tensor(GRIDS[:1]))
    with pytest.raises(ValueError, match="1 image token runs but 2 image grids"):
        mrope_positions([5, START, *[IMG] * 6, END], IMG, torch.tensor(GRIDS))


def test_one_row_positions_are_plain_rope():
    plain = Rope(64, 1e7, torch.float32, torch.device("cpu"))
    mrope = Rope(64, 1e7, torch.float32, torch.device("cpu"), (11, 11, 10))
    p = torch.arange(50)
    assert all(torch.equal(a, b) for a, b in zip(plain.cos_sin(p), mrope.cos_sin(p)))
    assert all(torch.equal(a, b) for a, b in zip(plain.cos_sin(p), mrope.cos_sin(p.expand(3, -1))))
    with pytest.raises(ValueError, match="mrope_section"):
        plain.cos_sin(p.expand(3, -1))


def test_config_reads_mrope_section():
    raw = qwen3_next_config(2048, [1], 0)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                              "mrope_section": [3, 3, 2], "mrope_interleaved": True}
    assert parse_config(raw).mrope_section == (3, 3, 2)
    raw["rope_parameters"]["mrope_section"] = [3, 3, 3]
    with pytest.raises(ModelLoadError, match="summing to rotary_dim/2 = 8"):
        parse_config(raw)


# ---- against transformers -------------------------------------------------------------------------

@pytest.mark.hf
def test_positions_match_transformers_get_rope_index():
    transformers = pytest.importorskip("transformers")
    raw = qwen3_5_vision_config(2048, [1], 0, VISION_IDS)
    model = transformers.Qwen3_5Model(transformers.Qwen3_5Config(**{k: v for k, v in raw.items()
                                                                      if k != "architectures"}))
    ids = torch.tensor([_prompt()])
    ref, ref_delta = model.get_rope_index(ids, mm_token_type_ids=(ids == IMG).int(),
                                          image_grid_thw=torch.tensor(GRIDS))
    ours, delta = mrope_positions(_prompt(), IMG, torch.tensor(GRIDS))
    assert torch.equal(ours, ref[:, 0])
    assert delta == int(ref_delta)


@pytest.mark.hf
@pytest.mark.parametrize("head_dim,section", [(64, [3, 3, 2]), (256, [11, 11, 10])], ids=["tiny", "qwen3.5"])
def test_angles_match_transformers(head_dim, section):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    text = transformers.Qwen3_5TextConfig(
        hidden_size=128, num_attention_heads=4, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": section, "mrope_interleaved": True})
    pos, _ = mrope_positions(_prompt(), IMG, torch.tensor(GRIDS))
    pos = pos * 37  # large positions so that every frequency's angle differs per row
    ref_cos, ref_sin = Qwen3_5TextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), pos[:, None, :])
    ours = Rope(head_dim // 4, 1e7, torch.float32, torch.device("cpu"), tuple(section))
    cos, sin = ours.cos_sin(pos)
    assert torch.allclose(cos, ref_cos[0], rtol=0, atol=1e-6)
    assert torch.allclose(sin, ref_sin[0], rtol=0, atol=1e-6)
