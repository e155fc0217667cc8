"""The oracle: an isolated, uncached, one-request run of the model math.

Every later test compares the engine against this. It shares only the model math and the
sampler with the engine — no Program, no stores, no cache — and needs only config and weights
(no tokenizer files). The whole prompt is computed in one prefill, then one token per step.
"""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec

from ninfer.errors import RequestError
from ninfer.native.model.config import PAGE_SIZE, load_eos_ids
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel, parse_dtype
from ninfer.native.sampler import PROMPT_ROWS, prompt_logprobs, sample_token, stop_reason, token_logprobs
from ninfer.protocol import PromptLogprob, TokenLogprob
from ninfer.sampling_params import SamplingParams

_LOCK = threading.Lock()
_MODELS: dict[tuple, tuple[HybridModel, tuple[int, ...]]] = {}
_MAX_CACHED = 4


def load_cached(model_dir: str | Path, dtype: str) -> tuple[HybridModel, tuple[int, ...]]:
    """Load a model once per (directory, dtype, file mtimes); returns (model, eos ids)."""
    path = Path(model_dir).resolve()
    stamp = tuple(sorted((f.name, f.stat().st_mtime_ns) for f in path.glob("*.json"))) if path.is_dir() else ()
    key = (str(path), str(parse_dtype(dtype)), stamp)
    with _LOCK:
        if key not in _MODELS:
            model = HybridModel.load(path, dtype)
            if len(_MODELS) >= _MAX_CACHED:
                _MODELS.pop(next(iter(_MODELS)))
            _MODELS[key] = (model, load_eos_ids(path, model.cfg))
        return _MODELS[key]


def _check_prompt(prompt: list[int], vocab: int) -> None:
    if not prompt:
        raise RequestError("prompt_token_ids must not be empty")
    bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad!r} is out of range: allowed 0..{vocab - 1}")


def generate_with_model(model: HybridModel, eos_ids: tuple[int, ...], prompt: list[int],
                        params: SamplingParams, logprobs_out: list[TokenLogprob] | None = None) -> list[int]:
    """Prefill ``prompt`` in one call, then decode until a stop rule fires. When
    ``params.logprobs`` is set, one entry per output token is appended to ``logprobs_out``."""
    vocab = model.cfg.vocab_size
    _check_prompt(prompt, vocab)
    params.validate(vocab)
    total = len(prompt) + params.max_tokens
    pages = list(range((total + PAGE_SIZE - 1) // PAGE_SIZE))
    cache = model.new_cache(len(pages), 1)
    out: list[int] = []
    grammar = None
    if params.structured is not None:          # the same grammar state the worker keeps
        from ninfer.structured import GrammarState, book_for
        grammar = GrammarState(params.structured, book_for(_model_dir(model), vocab, eos_ids), list(prompt))
    step = SeqInput(token_ids=list(prompt), start=0, page_table=pages)
    while True:
        logits = model.forward(ForwardBatch.build([step], model.device), cache).logits[-1]
        position = len(prompt) + len(out)
        allowed = grammar.allowed().to(logits.device) if grammar is not None else None
        tok = sample_token(logits, params, position, prompt, out, eos_ids, allowed)
        out.append(tok)
        if params.logprobs is not None and logprobs_out is not None:
            logprobs_out.append(token_logprobs(logits, tok, params.logprobs))
        if stop_reason(tok, len(out), params, eos_ids):
            return out
        if grammar is not None:
            grammar.accept(tok)
            if grammar.complete:
                return out
        step = SeqInput(token_ids=[tok], start=position, page_table=pages)


def _model_dir(model: HybridModel):
    if model.source is None:
        raise RequestError("structured outputs need the model's directory (its tokenizer.json)")
    return model.source


def reference_generate(model_dir: str | Path, prompt_token_ids: list[int], max_tokens: int = 16,
                       temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                       dtype: str = "float32", stop_token_ids: list[int] | None = None,
                       ignore_eos: bool = False, presence_penalty: float = 0.0,
                       frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                       logprobs: int | None = None, return_logprobs: bool = False,
                       min_p: float = 0.0, min_tokens: int = 0, logit_bias: dict[int, float] | None = None,
                       allowed_token_ids: list[int] | None = None,
                       bad_words: list[list[int]] | None = None, structured=None,
                       params: SamplingParams | None = None,
                       ) -> list[int] | tuple[list[int], list[TokenLogprob]]:
    """Isolated, uncached generation of one request: the output-invariance oracle.

    ``return_logprobs=True`` returns ``(token_ids, logprobs)``: one ``TokenLogprob`` per output
    token with the ``logprobs`` (default 0) top alternatives, exactly as the engine reports
    them (raw log_softmax of the logits in float64). ``params``: a whole ``SamplingParams``
    instead of the keywords (every option the engine takes, a constraint included)."""
    if params is None:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, logprobs=logprobs, min_p=min_p, min_tokens=min_tokens,
            logit_bias=tuple(sorted((logit_bias or {}).items())),
            allowed_token_ids=tuple(allowed_token_ids or ()),
            bad_words=tuple(tuple(w) for w in bad_words or ()), structured=structured,
        )
    if return_logprobs and params.logprobs is None:
        params = msgspec.structs.replace(params, logprobs=0)
    model, eos = load_cached(model_dir, dtype)
    lps: list[TokenLogprob] = []
    ids = generate_with_model(model, eos, list(prompt_token_ids), params, lps if return_logprobs else None)
    return (ids, lps) if return_logprobs else ids


def reference_prompt_logprobs(model_dir: str | Path, prompt_token_ids: list[int], k: int = 0,
                              dtype: str = "float32") -> list[PromptLogprob | None]:
    """The oracle of vLLM's ``prompt_logprobs``: the whole prompt in one isolated, uncached
    forward; the logits of position i give prompt token i + 1's entry (its raw log-probability,
    rank and the ``k`` most likely tokens there). Returns ``[None, entry of token 1, ...]``, one
    per prompt token, as the engine reports them."""
    import torch

    model, _ = load_cached(model_dir, dtype)
    prompt = list(prompt_token_ids)
    vocab = model.cfg.vocab_size
    _check_prompt(prompt, vocab)
    pages = list(range((len(prompt) + PAGE_SIZE - 1) // PAGE_SIZE))
    cache = model.new_cache(len(pages), 1)
    step = SeqInput(token_ids=prompt, start=0, page_table=pages, logits="none")
    with torch.no_grad():
        hidden = model.forward(ForwardBatch.build([step], model.device), cache).all_hidden
        out: list[PromptLogprob | None] = [None]
        for a in range(0, len(prompt) - 1, PROMPT_ROWS):
            b = min(len(prompt) - 1, a + PROMPT_ROWS)
            out += prompt_logprobs(model.logits(hidden[a:b]), prompt[a + 1:b + 1], k)
    return out


def reference_generate_multimodal(model_dir: str | Path, prompt_token_ids: list[int], media: list,
                                  max_tokens: int = 16, dtype: str = "float32", ignore_eos: bool = True,
                                  seed: int = 0) -> list[int]:
    """The isolated oracle for a prompt with images (greedy): the model-level
    ``multimodal.VisionLanguageModel`` — the whole prompt in one ``prefill_with_images`` (each
    image span's identity ids become ``<|image_pad|>``, its pixel_values the tower's input),
    then one token per step at index + delta (``decode_rope_positions``). No Program, no cache.
    ``media``: ``protocol.MediaItem`` list, in prompt order."""
    import numpy as np
    import torch

    from ninfer.native.model.multimodal import (
        VisionLanguageModel,
        decode_rope_positions,
    )

    vlm = VisionLanguageModel.load(model_dir, dtype)
    eos = load_eos_ids(Path(model_dir), vlm.text.cfg)
    ids = list(prompt_token_ids)
    for it in media:
        ids[it.offset:it.offset + it.num_tokens] = [vlm.image_token_id] * it.num_tokens
    pixels = torch.cat([torch.from_numpy(np.frombuffer(it.pixel_values, dtype="<f4").reshape(it.shape).copy())
                        for it in media])
    grid = torch.tensor([list(it.grid_thw) for it in media])
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, seed=seed)
    pages = list(range((len(ids) + max_tokens + PAGE_SIZE - 1) // PAGE_SIZE))
    cache = vlm.text.new_cache(len(pages), 1)
    with torch.no_grad():
        out_f, delta = vlm.prefill_with_images(ids, pixels, grid, cache, pages, logits="last")
        logits, out = out_f.logits[-1], []
        while True:
            pos = len(ids) + len(out)
            tok = sample_token(logits, params, pos, [t for t in ids], out, eos)
            out.append(tok)
            if stop_reason(tok, len(out), params, eos):
                return out
            step = SeqInput(token_ids=[tok], start=pos, page_table=pages,
                            rope_positions=decode_rope_positions(pos, 1, delta))
            logits = vlm.text.forward(ForwardBatch.build([step], vlm.text.device), cache).logits[-1]
