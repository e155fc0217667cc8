"""Our model math against an outside reference: Hugging Face transformers' implementation of
the same architectures, on the same safetensors (DESIGN.md §5.2)."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.native.model.model import HybridModel
from ninfer.reference import reference_generate
from tests.factories import logits_in_chunks, random_prompt

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

ATOL = 1e-4


def _hf_logits(model_dir: str, tokens: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _hf_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    """Greedy by full recomputation (no HF cache path involved)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _compare(model_dir: str, n_tokens: int = 150) -> None:
    tokens = random_prompt(n_tokens, seed=5, vocab=json.load(open(f"{model_dir}/config.json"))["vocab_size"])
    ours = logits_in_chunks(HybridModel.load(model_dir, "float32"), tokens, [])
    ref = _hf_logits(model_dir, tokens)
    assert ref.std() > 0.5, "reference logits are degenerate; the comparison would prove nothing"
    assert (ours - ref).abs().max().item() <= ATOL


def _greedy_matches(model_dir: str) -> None:
    prompt = random_prompt(20, seed=9, vocab=json.load(open(f"{model_dir}/config.json"))["vocab_size"])
    ours = reference_generate(model_dir, prompt, max_tokens=32, dtype="float32", ignore_eos=True)
    assert ours == _hf_greedy(model_dir, prompt, 32)


def test_qwen3_next_logits_match(tiny_model):
    _compare(tiny_model)


def test_qwen3_next_greedy_matches(tiny_model):
    _greedy_matches(tiny_model)


def test_qwen3_logits_and_greedy_match(tiny_qwen3):
    _compare(tiny_qwen3)
    _greedy_matches(tiny_qwen3)


@pytest.fixture(scope="module")
def hf_made_next(tmp_path_factory) -> str:
    """A directory written by transformers itself (its own random init + save_pretrained),
    with a dense-MLP layer, a bias-free GQA and grouped GDN heads — not by our generator."""
    cfg = transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, mlp_only_layers=[1], max_position_embeddings=512,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(cfg)
    out = tmp_path_factory.mktemp("hf_next")
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def hf_made_qwen3(tmp_path_factory) -> str:
    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = transformers.Qwen3ForCausalLM(cfg)
    out = tmp_path_factory.mktemp("hf_qwen3")
    model.save_pretrained(out)
    return str(out)


def test_directory_saved_by_transformers_qwen3_next(hf_made_next):
    _compare(hf_made_next, n_tokens=100)
    _greedy_matches(hf_made_next)


def test_directory_saved_by_transformers_qwen3(hf_made_qwen3):
    _compare(hf_made_qwen3, n_tokens=100)
    _greedy_matches(hf_made_qwen3)
