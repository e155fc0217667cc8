"""Fit a tiny DFlash / DFlash2 draft to its target, so that block drafts are sometimes accepted.

A random draft's drafts almost never match the random tiny target. ``fit_dflash`` fits every
draft tensor (the target, whose embedding and lm_head the draft borrows, is frozen) to the
target's own greedy trajectories, the way the draft is used:

* prompts are windows of the tiny corpus and random token strings (``mtp_fit.make_prompts``);
  the target continues each greedily (``mtp_fit.continue_batch``); one target forward gives the
  taps and the final-normed hidden (``feature``) of every position;
* ``warm_start`` makes the draft a closed-form linear predictor of x_{a+1} from the anchor x_a
  (least squares, as ``mtp_fit.warm_start`` does for the MTP head);
* then Adam: a training block anchors at a position a of the continuation (the token the target
  just produced): context = the taps of 0 .. a-1 (``append``, recomputed from the current
  weights every step), block = [x_a, mask × (B-1)]; row i is scored against the target's
  distribution of x_{a+i} (distillation), weighted exp(-(i-1)/γ) as the paper does — an early
  draft decides whether any later one counts. DFlash2's selector is trained beside it,
  teacher-forced (predecessor = the target's token x_{a+i-1}): cross-entropy of its top-k
  scores to the target's token where that is a candidate.

What it reaches (seed 0, ~10 s on one busy core; chance is 1/2048 ≈ 0.05%): ~4-6% of held-out
greedy first drafts accepted (random draft: ~0-0.1%), DFlash and DFlash2 alike; a second draft
almost never matches, so the mean accepted length is about the first-draft rate. All of it is
the warm start: Adam lowers the training loss a little but moves held-out acceptance only
within its noise (about ±1% over the ~1000 measured blocks). The ceiling is the target
(mtp_fit.py's docstring: its next token is close to a random function of the whole context),
and the mask rows see only the anchor and the context, never the drafts before them.

``dflash_acceptance`` measures a draft directory on held-out prompts as the engine drafts:
one block per committed length, drafts compared with the target's greedy tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.dflash import DFlashCache, DFlashDraft, DraftBlock
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel
from ninfer.native.model.ops import rms_norm
from ninfer.tiny.dflash import write_weights
from ninfer.tiny.mtp_fit import (
    HELD_OUT,
    RANDOM_SHARE,
    one_thread,
    adam,
    continue_batch,
    corpus_stream,
    held_out_prompts,
    make_prompts,
)


@dataclass
class Trajectory:
    """A target trajectory with what training and measuring need of it."""

    tokens: list[int]
    taps: torch.Tensor      # [n, len(taps)*H] the target's raw taps of every position
    feature: torch.Tensor   # [n, H] its final-normed hidden: lm_head(feature[p]) predicts x_{p+1}


def page_tables(lengths: list[int]) -> list[list[int]]:
    """Consecutive pages of their own for sequences of ``lengths`` tokens."""
    tables, page = [], 0
    for n in lengths:
        count = (n + PAGE_SIZE - 1) // PAGE_SIZE
        tables.append(list(range(page, page + count)))
        page += count
    return tables


@torch.no_grad()
def trajectories(target: HybridModel, seqs: list[list[int]], taps: tuple[int, ...]) -> list[Trajectory]:
    """One target forward over all ``seqs`` (a fresh cache; every row's hidden and taps)."""
    tables = page_tables([len(s) for s in seqs])
    batch = ForwardBatch.build([SeqInput(s, 0, t, state_slot=i, logits="none") for i, (s, t) in
                                enumerate(zip(seqs, tables))], target.device)
    out = target.forward(batch, target.new_cache(sum(map(len, tables)), len(seqs)), taps=taps)
    c = target.cfg
    feature = rms_norm(out.all_hidden, target.final_norm, c.rms_norm_eps, c.zero_centered_norm)
    return [Trajectory(s, out.taps[lo:hi], feature[lo:hi]) for s, lo, hi in zip(seqs, batch.cu, batch.cu[1:])]


def context_cache(draft: DFlashDraft, trajs: list[Trajectory]) -> tuple[DFlashCache, list[list[int]]]:
    """A fresh draft cache holding the context K/V of every position of every trajectory, each
    on pages of its own; returns it and the page tables."""
    tables = page_tables([len(tr.tokens) for tr in trajs])
    cache = draft.new_cache(sum(map(len, tables)))
    for tr, table in zip(trajs, tables):
        pos = torch.arange(len(tr.tokens), device=draft.target.device)
        slots = torch.tensor(table, device=pos.device)[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        draft.append(cache, tr.taps, pos, slots)
    return cache, tables


def batch_loss(draft: DFlashDraft, trajs: list[Trajectory], anchors: list[list[int]], gamma: float) -> torch.Tensor:
    """Weighted distillation loss of full blocks anchored at ``anchors`` (per trajectory), plus
    the selector's teacher-forced loss for DFlash2 (module docstring)."""
    n = draft.cfg.block_size - 1
    cache, tables = context_cache(draft, trajs)
    blocks = [DraftBlock(tr.tokens[a], a, n, table) for tr, table, ats in zip(trajs, tables, anchors) for a in ats]
    feature = torch.stack([tr.feature[a:a + n] for tr, ats in zip(trajs, anchors) for a in ats])    # [nb, n, H]
    probs = torch.softmax(F.linear(feature, draft.target.lm_head), -1)
    hidden = draft.forward(blocks, cache)
    logits = draft.logits(hidden)
    weight = torch.exp(-torch.arange(n, dtype=logits.dtype, device=logits.device) / gamma)
    loss = ((-(probs * torch.log_softmax(logits, -1)).sum(-1)) * weight).sum(-1).mean() / weight.sum()
    if draft.selector is None:
        return loss
    tokens = torch.tensor([tr.tokens[a:a + n + 1] for tr, ats in zip(trajs, anchors) for a in ats],
                          device=logits.device)                                                    # x_a .. x_{a+n}
    scores, cand = draft.selector.scores(hidden.detach(), logits.detach(), tokens[:, :-1])
    hit = cand == tokens[:, 1:, None]
    found = hit.any(-1)
    if found.any():
        loss = loss + F.cross_entropy(scores[found], hit[found].float().argmax(-1))
    return loss


def sample_anchors(trajs: list[Trajectory], first: int, block_size: int, count: int,
                   gen: torch.Generator) -> list[list[int]]:
    """``count`` distinct anchors per trajectory in first .. n - block_size (full blocks)."""
    out = []
    for tr in trajs:
        span = len(tr.tokens) - block_size - first + 1
        out.append((first + torch.randperm(span, generator=gen)[:count]).tolist())
    return out


@torch.no_grad()
def warm_start(draft: DFlashDraft, trajs: list[Trajectory], first: int, gamma: float, ridge: float = 1e-3) -> None:
    """Start the draft as a linear predictor of the target's next token from the anchor alone.

    Every query is zeroed, so attention averages its visible keys; the context is switched off
    (``hidden_norm`` = 0: zero keys and values) and so are the mask rows' values (``v_proj``
    projects out the normed mask embedding u_m). Layer 0's attention then hands every row the
    anchor's value over the ~C + B keys it averages; ``v_proj`` / ``o_proj`` are the ridge
    least-squares map from the normed anchor embedding u_a to the target's feature at the anchor
    (whose lm_head logits predict x_{a+1}), times that spread. Every other residual branch is
    zero, the convs are the identity, the selector's bigram term is zero, and the final norm's
    weight is the temperature of a small grid that fits the targets best: from the random
    weights (cross-entropy ~14) Adam would spend its few steps unlearning a confidently wrong
    draft; from here (~7.5) its steps refine instead."""
    c, t, tgt = draft.cfg, draft.tensors, draft.target
    for name, w in t.items():
        if name.endswith("norm.weight"):
            w.fill_(1.0)
    t["hidden_norm.weight"].zero_()
    for j in range(c.num_layers):
        p = f"layers.{j}"
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
            t[f"{p}.{name}.weight"].zero_()
        for conv in ("attention_conv", "mlp_conv") if c.kind == "dflash2" else ():
            t[f"{p}.{conv}.base_kernel"].zero_()[:, 0] = 1.0
            t[f"{p}.{conv}.kernel_projection.weight"].zero_()
    if c.kind == "dflash2":
        t["candidate_selector.hidden_projection.weight"].zero_()

    def normed(ids: list[int]) -> torch.Tensor:
        e = tgt.embed[torch.tensor(ids, device=tgt.device)] * c.input_embedding_scale
        return rms_norm(e, t["layers.0.input_layernorm.weight"], c.rms_norm_eps, False).double()

    m = normed([c.mask_token_id])[0]
    off_mask = torch.eye(c.hidden_size, dtype=m.dtype, device=m.device) - torch.outer(m, m) / m.dot(m)
    x = torch.cat([normed(tr.tokens[first:]) for tr in trajs]) @ off_mask
    y = torch.cat([tr.feature[first:] for tr in trajs]).double()
    gram = x.T @ x + ridge * len(x) * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    u, sv, vt = torch.linalg.svd(torch.linalg.solve(gram, x.T @ y).T @ off_mask)
    # v_proj takes the leading r = Hkv*D directions (all of them when Hkv*D >= H); the first q
    # head of each KV group writes its head's share through o_proj
    d, rep, r = c.head_dim, c.num_heads // c.num_kv_heads, min(c.hidden_size, c.num_kv_heads * c.head_dim)
    t["layers.0.self_attn.v_proj.weight"].zero_()[:r] = vt[:r]
    # keys a training row averages: its context (anchors lie uniformly in first .. n - B) and the block
    spread = sum(len(tr.tokens) - c.block_size + first for tr in trajs) / (2 * len(trajs)) + c.block_size
    o = t["layers.0.self_attn.o_proj.weight"]
    for g in range((r + d - 1) // d):
        cols = slice(g * d, min((g + 1) * d, r))          # KV head g's share of the r directions
        o[:, g * rep * d:g * rep * d + cols.stop - cols.start] = u[:, cols] * sv[cols] * spread
    fixed = (trajs[:8], sample_anchors(trajs[:8], first, c.block_size, 8, torch.Generator().manual_seed(0)))
    losses = {}
    for temp in (0.05, 0.1, 0.2, 0.3, 0.5, 1.0):
        t["norm.weight"].fill_(temp)
        losses[temp] = float(batch_loss(draft, *fixed, gamma))
    t["norm.weight"].fill_(min(losses, key=losses.get))


def train(draft: DFlashDraft, trajs: list[Trajectory], steps: int, batch: int, anchors: int, first: int,
          lr: float, gamma: float, gen: torch.Generator) -> None:
    """``mtp_fit.adam`` on every draft tensor over random batches of trajectories and anchors."""
    def loss() -> torch.Tensor:
        picked = [trajs[i] for i in torch.randint(0, len(trajs), (batch,), generator=gen).tolist()]
        return batch_loss(draft, picked, sample_anchors(picked, first, draft.cfg.block_size, anchors, gen), gamma)
    adam(list(draft.tensors.values()), steps, lr, loss)


# ---- acceptance ---------------------------------------------------------------------------------

@torch.no_grad()
def block_acceptance(draft: DFlashDraft, seqs: list[list[int]], prompt_len: int, chunk: int = 256) -> dict:
    """Drafts along the target's greedy trajectories ``seqs`` (each a prompt of ``prompt_len``
    tokens and its continuation), made as the engine makes them: for every committed length
    L + 1 past the prompt (x_L the newest token, with block_size - 1 target tokens after it), a
    full block anchored at x_L over the context 0 .. L-1. Returns ``first``: the share of first
    drafts equal to x_{L+1}; ``mean_accepted``: the mean number of leading drafts equal to the
    target's tokens (of ``block_size - 1``)."""
    trajs = trajectories(draft.target, seqs, draft.taps)
    cache, tables = context_cache(draft, trajs)
    n = draft.cfg.block_size - 1
    cases = [(tr.tokens, table, L) for tr, table in zip(trajs, tables)
             for L in range(prompt_len, len(tr.tokens) - n)]
    first = accepted = 0
    for i in range(0, len(cases), chunk):
        part = cases[i:i + chunk]
        drafts = draft.draft([DraftBlock(toks[L], L, n, table) for toks, table, L in part], cache)
        for (toks, _, L), d in zip(part, drafts):
            run = 0
            while run < n and d[run] == toks[L + 1 + run]:
                run += 1
            first += run > 0
            accepted += run
    return {"first": first / len(cases), "mean_accepted": accepted / len(cases), "drafts": n,
            "positions": len(cases)}


def draft_acceptance(draft: DFlashDraft, target_dir: Path, prompts: int = 32, prompt_len: int = 16,
                     new_tokens: int = 40, seed: int = 0) -> dict:
    """``block_acceptance`` over the target's greedy continuations of ``mtp_fit.held_out_prompts``."""
    target = draft.target
    seqs = continue_batch(target, held_out_prompts(target_dir, prompts, prompt_len, target.cfg.vocab_size, seed),
                          new_tokens, [0.0] * prompts, torch.Generator().manual_seed(seed))
    return block_acceptance(draft, seqs, prompt_len)


def dflash_acceptance(target_dir: str | Path, draft_dir: str | Path, **kwargs) -> dict:
    """The acceptance of the draft in ``draft_dir`` beside the target in ``target_dir`` (both
    float32; ``draft_acceptance``'s options)."""
    target = HybridModel.load(target_dir, "float32")
    return draft_acceptance(DFlashDraft.load(draft_dir, target), Path(target_dir), **kwargs)


# ---- fit and write back -------------------------------------------------------------------------

def training_set(target: HybridModel, target_dir: Path, taps: tuple[int, ...], sequences: int, prompt_len: int,
                 new_tokens: int, gen: torch.Generator) -> list[Trajectory]:
    """``trajectories`` of the target's greedy continuations of training prompts (corpus windows
    outside the held-out tail, and random strings)."""
    stream = corpus_stream(target_dir)
    prompts = make_prompts(stream[:int(len(stream) * (1 - HELD_OUT))], sequences, prompt_len, RANDOM_SHARE,
                           target.cfg.vocab_size, gen)
    return trajectories(target, continue_batch(target, prompts, new_tokens, [0.0] * sequences, gen), taps)


@one_thread
def fit_dflash(target_dir: str | Path, draft_dir: str | Path, *, steps: int = 40, seed: int = 0,
               sequences: int = 64, prompt_len: int = 16, new_tokens: int = 48, batch: int = 8,
               anchors: int = 8, lr: float = 3e-4, gamma: float = 4.0, measure: bool = True,
               write: bool = True) -> dict:
    """Fit the draft in ``draft_dir`` to the target in ``target_dir`` (module docstring) and, with
    ``write``, store it in the draft's model.safetensors. Seeded: the same arguments give the
    same tensors. With ``measure``, ``draft_acceptance`` before and after (held-out prompts).

    Returns steps, seconds (the fit: data + training, not the measurements), loss_before /
    loss_after (one fixed batch), acceptance_before / acceptance_after (with ``measure``) and
    ``tensors``: the fitted checkpoint tensors (float32)."""
    tdir, ddir = Path(target_dir), Path(draft_dir)
    target = HybridModel.load(tdir, "float32")
    draft = DFlashDraft.load(ddir, target)
    if new_tokens < draft.cfg.block_size:
        raise ValueError(f"new_tokens ({new_tokens}) must be at least the block size ({draft.cfg.block_size})")
    stats: dict = {"steps": steps, "seed": seed}
    if measure:
        stats["acceptance_before"] = draft_acceptance(draft, tdir, seed=seed)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    trajs = training_set(target, tdir, draft.taps, sequences, prompt_len, new_tokens, gen)
    fixed = (trajs[:batch], sample_anchors(trajs[:batch], prompt_len, draft.cfg.block_size, anchors,
                                           torch.Generator().manual_seed(seed)))
    with torch.no_grad():
        stats["loss_before"] = float(batch_loss(draft, *fixed, gamma))
    warm_start(draft, trajs, prompt_len, gamma)
    with torch.no_grad():
        stats["loss_warm"] = float(batch_loss(draft, *fixed, gamma))
    train(draft, trajs, steps, batch, anchors, prompt_len, lr, gamma, gen)
    with torch.no_grad():
        stats["loss_after"] = float(batch_loss(draft, *fixed, gamma))
    stats["seconds"] = time.perf_counter() - t0
    stats["tensors"] = {k: v.detach().clone() for k, v in draft.tensors.items()}
    if measure:
        stats["acceptance_after"] = draft_acceptance(draft, tdir, seed=seed)
    if write:
        write_weights(ddir, stats["tensors"])
    return stats
