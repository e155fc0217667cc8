"""Qwen3.5 MRoPE position ids of a prompt with images: 3 rows (t, h, w) per token.

A prompt reads ``text <|vision_start|> <|image_pad|>×N <|vision_end|> text ...``; the image
tokens are the merged patches (N = t · h/m · w/m of its grid, m = spatial_merge_size):

    text token at running position p   -> (p, p, p);  p += 1
    image of grid (t, h, w) starting at s -> (s + ti, s + hi, s + wi) for its N tokens in raster
                                           order over (ti, hi, wi) of (t, h/m, w/m)
                                           then p = s + max(h, w)/m   (= its largest row + 1)

<|vision_start|> and <|vision_end|> are text. Rows are then applied by ``ops.Rope`` with the
model's ``mrope_section``. The per-request constant ``delta = max position + 1 - len(tokens)``
continues decoding: the token at index i > prompt end is at (i + delta) on all three rows.
"""

from __future__ import annotations

from itertools import pairwise

import torch


def mrope_positions(token_ids: list[int] | torch.Tensor, image_token_id: int, image_grids: torch.Tensor,
                    spatial_merge_size: int = 2) -> tuple[torch.Tensor, int]:
    """token_ids: [T]; image_grids: [I, 3] (t, h, w in patches), one per run of image tokens, in order.

    Returns (positions [3, T] long, delta). A run of image tokens whose length is not its
    grid's merged-token count, or a count of runs other than I, is a ValueError.
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    grids = torch.as_tensor(image_grids, dtype=torch.long).reshape(-1, 3)
    is_img = ids == image_token_id
    # run boundaries: where the token kind changes (one pass, no per-token Python loop)
    change = torch.nonzero(is_img[1:] != is_img[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), len(ids)]
    n_runs = sum(bool(is_img[a]) for a in bounds[:-1])
    if n_runs != len(grids):
        raise ValueError(f"{n_runs} image token runs but {len(grids)} image grids")
    pieces, pos, g = [], 0, 0
    m = spatial_merge_size
    for a, b in pairwise(bounds):
        if not is_img[a]:
            pieces.append(torch.arange(pos, pos + b - a).expand(3, -1))
            pos += b - a
            continue
        t, h, w = grids[g].tolist()
        g += 1
        ti, hi, wi = torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij")
        run = torch.stack([ti, hi, wi]).reshape(3, -1) + pos
        if run.shape[1] != b - a:
            raise ValueError(f"image {g - 1} of grid {[t, h, w]} needs {run.shape[1]} image tokens, has {b - a}")
        pieces.append(run)
        pos += max(h, w) // m
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta
