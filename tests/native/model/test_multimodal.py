"""The Qwen3.5 text model, and a prompt with images, against transformers'
Qwen3_5ForConditionalGeneration on the tiny qwen3_5_vision directory (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from ninfer.native.model.multimodal import VisionLanguageModel, decode_rope_positions
from ninfer.reference import reference_generate
from ninfer.tiny.build import make_tiny_model
from tests.factories import logits_in_chunks, pages_for, random_prompt

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

ATOL = 1e-4  # as test_vs_transformers
GRIDS = [[1, 4, 6], [2, 6, 4]]  # 2×3 and 2·3×2 merged tokens: 6 and 12 image tokens


@pytest.fixture(scope="module")
def tiny_vision(tmp_path_factory):
    torch.set_num_threads(1)
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_vision_lm"), arch="qwen3_5_vision"))


@pytest.fixture(scope="module")
def hf_model(tiny_vision):
    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tiny_vision, dtype=torch.float32).eval()


def _raw(model_dir: str) -> dict:
    with open(f"{model_dir}/config.json") as f:
        return json.load(f)


def test_text_logits_match(tiny_vision, hf_model):
    raw = _raw(tiny_vision)
    tokens = random_prompt(150, seed=5, vocab=raw["text_config"]["vocab_size"])
    model = HybridModel.load(tiny_vision, "float32")
    assert model.cfg.model_type == "qwen3_5" and model.cfg.mrope_section == (3, 3, 2)
    ours = logits_in_chunks(model, tokens, [70])
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0]
    assert ref.std() > 0.5, "reference logits are degenerate; the comparison would prove nothing"
    assert (ours - ref).abs().max().item() <= ATOL


def test_text_greedy_matches(tiny_vision, hf_model):
    prompt = random_prompt(20, seed=9, vocab=_raw(tiny_vision)["text_config"]["vocab_size"])
    ours = reference_generate(tiny_vision, prompt, max_tokens=24, dtype="float32", ignore_eos=True)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert ours == seq[len(prompt):]


def _image_prompt(raw: dict) -> list[int]:
    img, start, end = raw["image_token_id"], raw["vision_start_token_id"], raw["vision_end_token_id"]
    text = random_prompt(12, seed=2, vocab=1000)
    return [*text[:5], start, *[img] * 6, end, *text[5:8], start, *[img] * 12, end, *text[8:]]


def test_image_prompt_logits_and_one_decode_step_match(tiny_vision, hf_model):
    raw = _raw(tiny_vision)
    vlm = VisionLanguageModel.load(tiny_vision, "float32")
    ids = _image_prompt(raw)
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), vlm.vision_cfg.patch_dim,
                         generator=torch.Generator().manual_seed(3))
    pages = pages_for(len(ids) + 1)
    cache = vlm.text.new_cache(len(pages), 1)
    out, delta = vlm.prefill_with_images(ids, pixels, grid, cache, pages)
    assert delta < 0  # the images' positions advance less than their token counts

    ids_t = torch.tensor([ids])
    mm = (ids_t == raw["image_token_id"]).int()
    with torch.no_grad():
        ref = hf_model(input_ids=ids_t, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm).logits[0]
    assert ref.std() > 0.5
    assert (out.logits - ref).abs().max().item() <= ATOL

    # one decode step: the token at index len(ids) runs at len(ids) + delta on all three rows
    nxt = int(ref[-1].argmax())
    seq = SeqInput(token_ids=[nxt], start=len(ids), page_table=pages,
                   rope_positions=decode_rope_positions(len(ids), 1, delta))
    step = vlm.text.forward(ForwardBatch.build([seq]), cache).logits[0]
    with torch.no_grad():
        full = hf_model(input_ids=torch.tensor([ids + [nxt]]), pixel_values=pixels, image_grid_thw=grid,
                        mm_token_type_ids=torch.tensor([ids + [nxt]]).eq(raw["image_token_id"]).int()).logits[0, -1]
    assert (step - full).abs().max().item() <= ATOL


def test_image_token_count_must_match(tiny_vision):
    vlm = VisionLanguageModel.load(tiny_vision, "float32")
    raw = _raw(tiny_vision)
    ids = _image_prompt(raw)
    grid = torch.tensor(GRIDS[:1] * 2)  # 6 + 6 tokens' worth, the prompt has 6 + 12
    with pytest.raises(ValueError, match="needs 6 image tokens, has 12"):
        vlm.prompt_embeddings(ids, torch.zeros(int(grid.prod(-1).sum()), vlm.vision_cfg.patch_dim), grid)


def test_text_rows_equal_one_row_positions_bit_for_bit(tiny_vision):
    """(p, p, p) rows are plain RoPE: a text-only batch gives the same bits with or without them."""
    model = HybridModel.load(tiny_vision, "float32")
    tokens = random_prompt(40, seed=4, vocab=2048)
    outs = []
    for rows in (None, torch.arange(len(tokens)).expand(3, -1)):
        cache = model.new_cache(1, 1)
        seq = SeqInput(token_ids=tokens, start=0, page_table=[0], logits="all", rope_positions=rows)
        batch = ForwardBatch.build([seq])
        assert (batch.rope_positions is None) == (rows is None)
        outs.append(model.forward(batch, cache).logits)
    assert torch.equal(outs[0], outs[1])


def test_image_prompt_in_two_chunks_equals_one(tiny_vision):
    """A cut inside an image run: each chunk carries its slice of the embeddings and of the rows.
    float64, so that only the cut could make a difference (fp32 differs by chunking rounding, 3e-5)."""
    vlm = VisionLanguageModel.load(tiny_vision, "float64")
    ids = _image_prompt(_raw(tiny_vision))
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), vlm.vision_cfg.patch_dim,
                         generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    pages = pages_for(len(ids))
    whole, _ = vlm.prefill_with_images(ids, pixels, grid, vlm.text.new_cache(len(pages), 1), pages)
    embeds, rows, _ = vlm.prompt_embeddings(ids, pixels, grid)
    cache = vlm.text.new_cache(len(pages), 1)
    parts = []
    for lo, hi in ((0, 9), (9, len(ids))):
        seq = SeqInput(token_ids=ids[lo:hi], start=lo, page_table=pages, logits="all", rope_positions=rows[:, lo:hi])
        parts.append(vlm.text.forward(ForwardBatch.build([seq]), cache, embeds[lo:hi]).logits)
    assert (torch.cat(parts) - whole.logits).abs().max().item() <= 1e-12
