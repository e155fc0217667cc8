"""Small builders shared by tests (no fixtures here; plain functions)."""

from __future__ import annotations

import os
import shutil

import torch
from filelock import FileLock

from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel


def random_prompt(n: int, seed: int, vocab: int = 2048) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def pages_for(n_tokens: int) -> list[int]:
    return list(range((n_tokens + PAGE_SIZE - 1) // PAGE_SIZE))


def logits_in_chunks(model: HybridModel, tokens: list[int], cuts: list[int], page_table=None,
                     slot: int = 0, cache=None) -> torch.Tensor:
    """Run ``tokens`` as consecutive calls split at ``cuts``; return logits of every position."""
    page_table = page_table or pages_for(len(tokens))
    cache = cache or model.new_cache(max(page_table) + 1, slot + 1)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(tokens))), len(tokens)]
    rows = []
    for lo, hi in zip(bounds, bounds[1:]):
        seq = SeqInput(token_ids=tokens[lo:hi], start=lo, page_table=page_table, state_slot=slot, logits="all")
        rows.append(model.forward(ForwardBatch.build([seq], model.device), cache).logits)
    return torch.cat(rows)


def shared_build(tmp_path_factory, name: str, build) -> str:
    """``build(directory)`` once per test session — under pytest-xdist once for all its workers
    (in their common base directory, under a lock): the qwen3_next tiny model fits its MTP head
    and the drafts fit themselves (~15 s each on one core), deterministically. Tests only read
    these directories (a test that edits one copies it first)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    target = base / f"shared-{name}"
    with FileLock(str(target) + ".lock"):
        if not (target / ".built").exists():
            shutil.rmtree(target, ignore_errors=True)
            build(target)
            (target / ".built").touch()
    return str(target)
