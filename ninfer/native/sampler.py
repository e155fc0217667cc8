"""Sampling: penalties, greedy / temperature / top-k / top-p, keyed randomness, stop rules.

Exactness contract: the token drawn at a logical position depends only on the logits, the
committed history and (seed, position, purpose) — never on batch composition, on how often the
position was recomputed, or on any global RNG. Replay after a pause therefore re-derives the
same token, and the oracle (an isolated run) draws the same numbers as the engine.

Log-probabilities (``token_logprobs``, and ``prompt_logprobs`` for the prompt's positions) are
read from the same logits only when a request asks; they are the raw distribution (vLLM's
default "raw_logprobs"), so they never feed back into the draw.
"""

from __future__ import annotations

from collections import Counter
from enum import IntEnum

import torch

from ninfer.protocol import PromptLogprob, TokenLogprob
from ninfer.sampling_params import SamplingParams

MASK64 = (1 << 64) - 1


class Purpose(IntEnum):
    """Why a random number is drawn; distinct purposes never share a stream."""

    SAMPLE = 1
    DRAFT = 2       # later wave: speculative drafts
    ACCEPT = 3      # later wave: speculative acceptance


def _mix64(z: int) -> int:
    """splitmix64 finaliser: a bijective avalanche over 64-bit integers."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def keyed_uniform(seed: int, position: int, purpose: int = Purpose.SAMPLE) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, position, purpose)."""
    h = _mix64(_mix64(_mix64(seed & MASK64) ^ (position & MASK64)) ^ (int(purpose) & MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """logits: [V] (float64). Returns penalised logits (a new tensor when any penalty is on)."""
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        # a prompt's image identity ids (>= vocab: media_token_ids) are no vocabulary entries
        seen = torch.tensor(sorted(t for t in set(prompt_ids) | set(output_ids) if t < logits.shape[-1]),
                            dtype=torch.long, device=logits.device)
        vals = logits[seen]
        rp = params.repetition_penalty
        logits = logits.clone()
        logits[seen] = torch.where(vals > 0, vals / rp, vals * rp)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = Counter(output_ids)
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        cnt = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits = logits.clone()
        logits[ids] -= params.frequency_penalty * cnt + params.presence_penalty
    return logits


def _barred(params: SamplingParams, output_ids: list[int]) -> list[int]:
    """Last tokens of ``bad_words`` sequences whose other tokens end the output so far."""
    n = len(output_ids)
    return [w[-1] for w in params.bad_words
            if len(w) - 1 <= n and (len(w) == 1 or output_ids[n - len(w) + 1:] == list(w[:-1]))]


def constrain(x: torch.Tensor, params: SamplingParams, output_ids: list[int],
              eos_ids: tuple[int, ...] = (), allowed: torch.Tensor | None = None) -> torch.Tensor:
    """x: [V] float64 logits. Returns them with what may not be drawn at -inf and the logit bias
    added, in vLLM's order: the allowed set (``allowed_token_ids``, and ``allowed`` [V] bool: a
    grammar's mask), bad words, min_tokens (stop ids barred only while something else is left),
    logit bias. The input is never modified; with nothing to do it is returned as is."""
    mask = None
    if params.allowed_token_ids:
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[list(params.allowed_token_ids)] = True
    if allowed is not None:
        mask = allowed if mask is None else mask & allowed
    barred = _barred(params, output_ids) if params.bad_words else []
    stops = []
    if len(output_ids) < params.min_tokens:
        stops = [t for t in (*params.stop_token_ids, *(() if params.ignore_eos else eos_ids)) if t < x.shape[-1]]
    if mask is None and not barred and not stops and not params.logit_bias:
        return x
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    else:
        mask = mask.clone()
    if barred:
        mask[barred] = False
    if stops:
        kept = mask.clone()
        kept[stops] = False
        if bool(kept.any()):            # min_tokens never leaves nothing to draw
            mask = kept
    x = x.masked_fill(~mask, float("-inf"))
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=x.device)
        x[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=x.dtype, device=x.device)
    return x


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int,
                 prompt_ids: list[int], output_ids: list[int], eos_ids: tuple[int, ...] = (),
                 allowed: torch.Tensor | None = None) -> int:
    """Choose the token at logical ``position`` from one row of logits [V].

    ``constrain`` first (allowed ids, a grammar's ``allowed`` mask, bad words, min_tokens
    against ``eos_ids``, logit bias), then the penalties. Greedy picks the lowest id among the
    maxima. Otherwise candidates are ordered by (probability desc, id asc) — a total order, so
    ties cannot make two runs differ — then filtered by min_p (and renormalised), top-k and
    top-p, and the keyed uniform selects by inverse CDF.
    """
    x = constrain(logits.to(torch.float64), params, output_ids, eos_ids, allowed)
    x = apply_penalties(x, params, prompt_ids, output_ids)
    if params.temperature == 0.0:
        return int(torch.argmax(x))
    probs = torch.softmax(x / params.temperature, dim=-1)
    order = torch.sort(probs, descending=True, stable=True)
    p, ids = order.values, order.indices
    if params.min_p > 0.0:
        keep = int((p >= params.min_p * p[0]).sum())        # p is sorted: a prefix survives
        p, ids = p[:keep], ids[:keep]
        p = p / p.sum()
    if params.top_k and params.top_k < p.numel():
        p, ids = p[: params.top_k], ids[: params.top_k]
    if params.top_p < 1.0:
        cum = torch.cumsum(p, 0)
        keep = int(torch.searchsorted(cum, torch.tensor([params.top_p], dtype=cum.dtype, device=cum.device))) + 1
        p, ids = p[:keep], ids[:keep]
    cdf = torch.cumsum(p, 0)
    u = keyed_uniform(params.seed, position) * float(cdf[-1])
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True))
    return int(ids[min(idx, ids.numel() - 1)])


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The raw log-probability of ``token`` and the ``k`` most likely tokens from one row of
    logits [V]: log_softmax in float64 of the model's logits, before penalties, temperature and
    top-k/top-p (vLLM's default ``logprobs_mode="raw_logprobs"``).

    ``top`` is ordered by (logprob desc, id asc), the sampler's total order, so ties cannot make
    two runs differ. Cost: one log_softmax, and for k > 0 a top-k plus a sort of the candidates
    tied with the k-th value (not a sort of the vocabulary).
    """
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return TokenLogprob(token, float(lp[token]), _top(lp, k))


def _top(lp: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely (id, logprob) of one row [V] of logprobs, (logprob desc, id asc)."""
    k = min(k, lp.numel())
    if k <= 0:
        return ()
    kth = torch.topk(lp, k).values[-1]
    cand = torch.nonzero(lp >= kth).flatten()          # ascending ids, ties with the k-th included
    vals = lp[cand]
    order = torch.sort(vals, descending=True, stable=True).indices[:k]
    return tuple(zip(cand[order].tolist(), vals[order].tolist()))


PROMPT_ROWS = 128      # rows of logits made at once for prompt logprobs (bounds [rows, V] in memory)


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[PromptLogprob]:
    """vLLM's prompt_logprobs entries from logits [m, V] whose row i predicts ``tokens[i]``:
    each token's raw log-probability (log_softmax in float64, as ``token_logprobs``), its rank
    as vLLM counts it (vocabulary entries with a logprob >= its own; 1 = the most likely) and
    the ``k`` most likely tokens in the sampler's total order."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(1, ids)
    ranks = (lp >= chosen).sum(dim=1).tolist()
    return [PromptLogprob(t, v, r, _top(lp[i], k))
            for i, (t, v, r) in enumerate(zip(tokens, chosen[:, 0].tolist(), ranks))]


def stop_reason(token: int, n_generated: int, params: SamplingParams, eos_ids: tuple[int, ...]) -> str | None:
    """'stop' if ``token`` ends the request, 'length' if the budget is spent, else None.

    ``n_generated`` counts ``token`` itself. The stop token stays in the output ids. Before
    ``min_tokens`` outputs no stop id ends the request (as in vLLM).
    """
    if n_generated >= params.min_tokens and (
            token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids)):
        return "stop"
    if n_generated >= params.max_tokens:
        return "length"
    return None
