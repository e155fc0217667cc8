"""DFlash / DFlash2 block draft models over paged context KV (arXiv 2602.06036; z-lab/dflash).

A DFlash draft is a few Qwen3-style decoder layers with no embedding and no lm_head of its own
(it borrows the target's). It drafts a whole *block* in one forward: the committed anchor
token and n mask tokens, every row attending to every other (non-causal) and to the target's
*context features* of the positions before the block::

    ctx_p   = hidden_norm(fc(cat[target layer outputs at target_layer_ids]_p))      [H]
    layer:  K/V = [ k_norm(k_proj(ctx_lo..start-1)), v_proj(ctx) ]  (rope at the context positions)
                ++ [ k_norm(k_proj(h_block)),        v_proj(h_block) ] (rope at start .. start+n)
            Q   =    q_norm(q_proj(h_block))
    block   = embed([anchor, mask, .., mask]) at positions start .. start + n
    drafts  = argmax lm_head(norm(h_block rows 1 .. n))

A context position's K/V depends only on the target's taps there (``ctx`` never meets the
block's hidden stream), so ``append`` computes it once per draft layer and stores it in paged
KV (64 positions a page, the DFlash pool's pages and page tables). ``draft`` computes the
block's own K/V on the fly; it never persists. The caller owns the page tables and guarantees
that the context it asks for was appended.

DFlash2 (``DFlash2DraftModel``) adds three things: sliding-window layers (a query at q sees a
key at k when q - k < W, and k - q < W too when non-causal: the context then starts at
``max(base, start - W + 1)``, pages wholly below it are never read); a grouped dynamic causal
conv around each sublayer (``DynamicConv``, within the block rows only); and a candidate
selector that walks the top-k of each row's logits with a low-rank bigram score instead of
taking the argmax (``Selector``).

Tap convention (HF ``hidden_states[l + 1]``): ``target_layer_ids[j] = l`` is the output of the
target's decoder layer l; for its last layer that is after the final norm (``tap_features``).

The config (``DFlashConfig``, ``load_draft_config``) and the checkpoint's tensor set live in
dflash_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ninfer.errors import ModelLoadError
from ninfer.native.model.attention import write_kv
from ninfer.native.model.config import PAGE_SIZE
from ninfer.native.model.dflash_config import (
    BARE_CODEBOOKS,
    DFlashConfig,
    expected_tensors,
    load_draft_config,
)
from ninfer.native.model.model import AttentionWeights, HybridModel
from ninfer.native.model.ops import Rope, acc_dtype, rms_norm, silu_mlp
from ninfer.native.model.weights import load_checked, weight_files

# ---- weights ------------------------------------------------------------------------------------

@dataclass
class DynamicConv:
    """DFlash2's grouped dynamic causal conv around one sublayer, over the block rows only.

    base: [2, K, H] (one kernel before the sublayer, one after); projection: [2*K*G, H] with
    G = H / group_size groups. ``prepare(x)`` convolves the sublayer's input with base[0] plus a
    kernel predicted from x itself and returns the second predicted kernel, which ``finish``
    applies with base[1] to the sublayer's output::

        y[t, c] = sum_{o<K} (base[o, c] + dyn[t, o, c // group_size]) * x[t - o, c]   (x[<0] = 0)
    """

    base: torch.Tensor
    projection: torch.Tensor
    group_size: int

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, R, H] -> (conv(x) [B, R, H], the second dynamic kernel [B, R, K, G])."""
        k = self.base.shape[1]
        dyn = F.linear(x, self.projection).unflatten(-1, (2, k, -1))
        return self._convolve(x, dyn[:, :, 0], self.base[0]), dyn[:, :, 1]

    def finish(self, x: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        """x: [B, R, H] the sublayer's output; dyn: ``prepare``'s second kernel -> [B, R, H]."""
        return self._convolve(x, dyn, self.base[1])

    def _convolve(self, x: torch.Tensor, dyn: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        b, r, h = x.shape
        g = h // self.group_size
        xs = x.view(b, r, g, self.group_size)
        out = torch.zeros_like(xs)
        for o in range(base.shape[0]):
            shifted = F.pad(xs, (0, 0, 0, 0, o, 0))[:, :r]           # row t holds x[t - o]
            out = out + (base[o].view(g, self.group_size) + dyn[:, :, o, :, None]) * shifted
        return out.view(b, r, h)


def around(conv: DynamicConv | None, sublayer, h: torch.Tensor) -> torch.Tensor:
    """``sublayer(h)``, wrapped in ``conv``'s prepare / finish when the layer has one (DFlash2)."""
    if conv is None:
        return sublayer(h)
    h, dyn = conv.prepare(h)
    return conv.finish(sublayer(h), dyn)


@dataclass
class DraftLayer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttentionWeights
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]      # gate, up, down
    attention_conv: DynamicConv | None = None
    mlp_conv: DynamicConv | None = None


@dataclass
class Selector:
    """DFlash2's candidate selector: a greedy path through each row's top-k logits.

    predecessor, successor: [V, r]; hidden_projection: [r, H]. Row i's candidate c scores
    ``logit_i(c) + <predecessor[prev] * (hidden_projection @ h_i), successor[c]>``, prev being
    the token chosen at row i - 1 (the anchor for row 1)."""

    predecessor: torch.Tensor
    successor: torch.Tensor
    hidden_projection: torch.Tensor
    top_k: int

    def scores(self, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [..., H]; logits: [..., V]; prev: [...] each row's predecessor -> (the scores
        [..., k] of its top-k candidates, those candidates [..., k]), in the logits' dtype."""
        unary, cand = torch.topk(logits, self.top_k, dim=-1)
        left = self.predecessor[prev] * F.linear(hidden, self.hidden_projection)       # [..., r]
        return unary + (self.successor[cand] @ left[..., None])[..., 0].to(logits.dtype), cand

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """hidden: [B, N, H]; logits: [B, N, V]; anchors: [B] -> the greedy path [B, N] (long)."""
        prev, path = anchors, []
        for i in range(hidden.shape[1]):
            scores, cand = self.scores(hidden[:, i], logits[:, i], prev)
            prev = cand.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1)


@dataclass
class DFlashCache:
    """k, v: [num_layers, num_pages, 64, num_kv_heads, head_dim] — the context K/V of every draft layer."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class DraftBlock:
    """One sequence's block of a ``draft`` call: the anchor at ``start``, drafts at start+1 ..
    start+n. Its context is positions lo .. start-1, lo = base (max(base, start - W + 1) with a
    window W); ``page_table`` covers them (entries of pages wholly below lo may be -1)."""

    anchor: int
    start: int
    n: int
    page_table: list[int]
    base: int = 0


def tap_features(target: HybridModel, layer_ids: tuple[int, ...], taps: torch.Tensor) -> torch.Tensor:
    """``HybridModel.forward(taps=layer_ids).taps`` [T, n*H] -> the HF ``hidden_states[l + 1]``
    rows the draft was trained on: layer l's output, after the final norm for the last layer."""
    c = target.cfg
    parts = list(taps.split(c.hidden_size, dim=-1))
    for j, layer in enumerate(layer_ids):
        if layer == c.num_hidden_layers - 1:
            parts[j] = rms_norm(parts[j], target.final_norm, c.rms_norm_eps, c.zero_centered_norm)
    return torch.cat(parts, dim=-1)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q: [B, R, H, D]; k, v: [B, L, Hkv, D]; visible: [B, R, L] bool -> [B, R, H*D].

    Every query row must see at least one key (a fully masked row would be NaN). Softmax in the
    accumulation dtype, matmuls in the model dtype (``attention.paged_attention``'s policy)."""
    b, r, h, d = q.shape
    hkv = k.shape[2]
    qg = q.view(b, r, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)                 # [B, Hkv, rep, R, D]
    kg, vg = k.permute(0, 2, 1, 3)[:, :, None], v.permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, L, D]
    scores = (qg @ kg.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores.to(acc_dtype(q.dtype)), dim=-1).to(q.dtype)
    return (probs @ vg).permute(0, 3, 1, 2, 4).reshape(b, r, h * d)


# ---- the draft ----------------------------------------------------------------------------------

class DFlashDraft:
    """Weights + math of one draft beside its target (``target.embed`` / ``target.lm_head``).

    ``tensors`` maps the checkpoint's names to the very tensors the layers compute with (a fit
    trains them in place and writes them back under the same names)."""

    def __init__(self, cfg: DFlashConfig, tensors: dict[str, torch.Tensor], target: HybridModel):
        tc = target.cfg
        if cfg.hidden_size != tc.hidden_size:
            raise ModelLoadError(f"draft hidden_size {cfg.hidden_size} differs from the target's {tc.hidden_size}")
        bad = [i for i in cfg.target_layer_ids if i >= tc.num_hidden_layers]
        if bad:
            raise ModelLoadError(f"draft target_layer_ids {list(cfg.target_layer_ids)}: layer {bad[0]} is out of "
                                 f"range (the target has {tc.num_hidden_layers} layers)")
        if cfg.mask_token_id >= tc.vocab_size:
            raise ModelLoadError(f"draft mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
                                 f"({tc.vocab_size})")
        if cfg.kind == "dflash2" and cfg.vocab_size != tc.vocab_size:
            raise ModelLoadError(f"draft vocab_size {cfg.vocab_size} (its selector's codebooks) differs from the "
                                 f"target's {tc.vocab_size}")
        self.cfg = cfg
        self.target = target
        self.taps = cfg.target_layer_ids
        t = self.tensors = {k: v.to(device=target.device, dtype=target.dtype) for k, v in tensors.items()}
        self.fc, self.hidden_norm, self.norm = t["fc.weight"], t["hidden_norm.weight"], t["norm.weight"]
        self.layers = [self._layer(t, f"layers.{j}") for j in range(cfg.num_layers)]
        self.selector = None
        if cfg.kind == "dflash2":
            p = "candidate_selector"
            self.selector = Selector(t[f"{p}.predecessor_codebook.weight"], t[f"{p}.successor_codebook.weight"],
                                     t[f"{p}.hidden_projection.weight"], cfg.selector_top_k)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, target.dtype, target.device)

    def _layer(self, t: dict[str, torch.Tensor], p: str) -> DraftLayer:
        a = f"{p}.self_attn"
        attn = AttentionWeights(q_proj=t[f"{a}.q_proj.weight"], k_proj=t[f"{a}.k_proj.weight"],
                                v_proj=t[f"{a}.v_proj.weight"], o_proj=t[f"{a}.o_proj.weight"],
                                q_norm=t[f"{a}.q_norm.weight"], k_norm=t[f"{a}.k_norm.weight"])
        convs = [DynamicConv(t[f"{p}.{n}.base_kernel"], t[f"{p}.{n}.kernel_projection.weight"], self.cfg.conv_group_size)
                 if self.cfg.kind == "dflash2" else None for n in ("attention_conv", "mlp_conv")]
        mlp = tuple(t[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        return DraftLayer(t[f"{p}.input_layernorm.weight"], t[f"{p}.post_attention_layernorm.weight"], attn, mlp, *convs)

    @staticmethod
    def load(draft_dir: str | Path, target: HybridModel) -> DFlashDraft:
        """The draft in ``draft_dir`` (config.json + safetensors), strictly: every expected tensor,
        nothing else, each of its shape; in the target's dtype on its device."""
        path = Path(draft_dir)
        cfg = load_draft_config(path)
        files = weight_files(path)
        expected = expected_tensors(cfg)
        for bare in BARE_CODEBOOKS:
            if bare in files and cfg.kind == "dflash2":
                expected[bare] = expected.pop(f"{bare}.weight")
        t = load_checked(path, files, expected, target.dtype, what=f"{cfg.kind} draft")
        for bare in BARE_CODEBOOKS:
            if bare in t:
                t[f"{bare}.weight"] = t.pop(bare)
        return DFlashDraft(cfg, t, target)

    # ---- context KV -----------------------------------------------------------------------------
    def page_bytes(self) -> int:
        """Bytes of one 64-position page of context K and V over all draft layers."""
        c = self.cfg
        return 2 * c.num_layers * PAGE_SIZE * c.num_kv_heads * c.head_dim * self.target.dtype.itemsize

    def new_cache(self, num_pages: int) -> DFlashCache:
        c, t = self.cfg, self.target
        shape = (c.num_layers, num_pages, PAGE_SIZE, c.num_kv_heads, c.head_dim)
        return DFlashCache(torch.zeros(shape, dtype=t.dtype, device=t.device),
                           torch.zeros(shape, dtype=t.dtype, device=t.device))

    def append(self, cache: DFlashCache, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the context K/V of n positions into every draft layer's pages.

        taps: [n, len(taps)*H] the target's raw ``out.taps`` rows of those positions (the
        last-layer final norm is applied here, ``tap_features``); positions, slots: [n] long (slot
        = page * 64 + offset). Differentiable in the draft's tensors (the fit trains through it)."""
        c = self.cfg
        n, d = taps.shape[0], c.head_dim
        ctx = rms_norm(F.linear(tap_features(self.target, self.taps, taps.to(self.target.dtype)), self.fc),
                       self.hidden_norm, c.rms_norm_eps, False)
        cos, sin = self.rope.cos_sin(positions)
        for j, layer in enumerate(self.layers):
            k = rms_norm(F.linear(ctx, layer.attn.k_proj).view(n, -1, d), layer.attn.k_norm, c.rms_norm_eps, False)
            v = F.linear(ctx, layer.attn.v_proj).view(n, -1, d)
            write_kv(cache.k[j], cache.v[j], slots, Rope.apply(k, cos, sin), v)

    # ---- blocks ---------------------------------------------------------------------------------
    def context_start(self, block: DraftBlock) -> int:
        """lo: the first context position ``block`` attends (its first row's window, or base)."""
        w = self.cfg.window
        return block.base if w is None else max(block.base, block.start - w + 1)

    def _anchors(self, blocks: list[DraftBlock]) -> torch.Tensor:
        """[B] long. An image's identity ids (>= vocab, native/media.py) anchor as id 0: a rough
        anchor costs acceptance only, never a token (the engine verifies every draft)."""
        vocab = self.target.cfg.vocab_size
        return torch.tensor([b.anchor if b.anchor < vocab else 0 for b in blocks], device=self.target.device)

    def _check(self, block: DraftBlock) -> None:
        if not 1 <= block.n < self.cfg.block_size:
            raise ValueError(f"a block drafts 1..{self.cfg.block_size - 1} tokens, not {block.n}")
        if not 0 <= block.base <= block.start:
            raise ValueError(f"block base {block.base} must lie in 0..start ({block.start})")
        if len(block.page_table) * PAGE_SIZE < block.start:
            raise ValueError(f"page table of {len(block.page_table)} pages cannot hold context position {block.start - 1}")
        lo = self.context_start(block)
        if lo < block.start and min(block.page_table[lo // PAGE_SIZE:(block.start - 1) // PAGE_SIZE + 1]) < 0:
            raise ValueError(f"page table names no page for a context position in {lo}..{block.start - 1}")

    def _context_slots(self, blocks: list[DraftBlock]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flat slot [B, C] of every block's context positions lo + j (C = the widest context),
        whether it is one [B, C], and the position [B, C]. Slots past a block's context read slot 0,
        which may hold anything: never attended (``_attention`` zeroes their values)."""
        dev = self.target.device
        los = torch.tensor([self.context_start(b) for b in blocks], dtype=torch.long, device=dev)
        lens = torch.tensor([b.start for b in blocks], dtype=torch.long, device=dev) - los
        width = max(len(b.page_table) for b in blocks)
        table = torch.tensor([b.page_table + [0] * (width - len(b.page_table)) for b in blocks],
                             dtype=torch.long, device=dev)
        j = torch.arange(int(lens.max()), device=dev)[None, :]
        pos = los[:, None] + j
        valid = j < lens[:, None]
        pages = table.gather(1, (pos // PAGE_SIZE).clamp(max=width - 1))
        slots = torch.where(valid, pages * PAGE_SIZE + pos % PAGE_SIZE, 0)
        return slots, valid, pos

    def _visible(self, blocks: list[DraftBlock], ctx_valid: torch.Tensor, ctx_pos: torch.Tensor,
                 row_pos: torch.Tensor) -> torch.Tensor:
        """[B, R, C + R] bool: which keys (context, then block rows) each block row sees.

        The window and causality compare positions (the reference's rule); a block's padding rows
        past its n are keys to no real row, but each sees itself so that no row is empty."""
        dev = row_pos.device
        r = row_pos.shape[1]
        ns = torch.tensor([b.n for b in blocks], dtype=torch.long, device=dev)
        rows = torch.arange(r, device=dev)
        own = (rows[None, None, :] <= ns[:, None, None]) | (rows[:, None] == rows[None, :])[None]   # [B, R, R]
        visible = torch.cat([ctx_valid[:, None, :].expand(-1, r, -1), own], dim=2)
        q = row_pos[:, :, None]
        k = torch.cat([ctx_pos, row_pos], dim=1)[:, None, :]
        if self.cfg.is_causal:
            visible = visible & (k <= q)
        w = self.cfg.window
        if w is not None:
            visible = visible & (q - k < w)
            if not self.cfg.is_causal:
                visible = visible & (k - q < w)
        return visible

    def forward(self, blocks: list[DraftBlock], cache: DFlashCache) -> torch.Tensor:
        """The normed hidden of every block's draft rows: [B, N, H], N = max n (row i - 1 is
        position start + i; rows past a block's n are padding). Differentiable (no no_grad here).

        The blocks are padded to the widest block and context: one batched op per layer."""
        for b in blocks:
            self._check(b)
        c, t = self.cfg, self.target
        dev, r = t.device, max(b.n for b in blocks) + 1
        ids = torch.full((len(blocks), r), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = self._anchors(blocks)
        x = F.embedding(ids, t.embed) * c.input_embedding_scale
        row_pos = torch.tensor([b.start for b in blocks], device=dev)[:, None] + torch.arange(r, device=dev)
        slots, ctx_valid, ctx_pos = self._context_slots(blocks)
        visible = self._visible(blocks, ctx_valid, ctx_pos, row_pos)
        cos, sin = self.rope.cos_sin(row_pos.reshape(-1))
        for j, layer in enumerate(self.layers):
            attend = partial(self._attention, layer.attn, cache.k[j], cache.v[j], slots, ctx_valid,
                             visible, cos, sin)
            x = x + around(layer.attention_conv, attend, rms_norm(x, layer.input_norm, c.rms_norm_eps, False))
            x = x + around(layer.mlp_conv, partial(silu_mlp, gate_w=layer.mlp[0], up_w=layer.mlp[1],
                                                   down_w=layer.mlp[2]),
                           rms_norm(x, layer.post_norm, c.rms_norm_eps, False))
        return rms_norm(x[:, 1:], self.norm, c.rms_norm_eps, False)

    def _attention(self, w: AttentionWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   ctx_valid: torch.Tensor, visible: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   h: torch.Tensor) -> torch.Tensor:
        """One layer's attention of the block rows h [B, R, H] over the context K/V at ``slots``
        (k_cache, v_cache: [P, 64, Hkv, D]) and their own K/V -> [B, R, H]."""
        c = self.cfg
        b, r, d = h.shape[0], h.shape[1], c.head_dim

        def roped(proj: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
            y = rms_norm(F.linear(h, proj).view(b * r, -1, d), norm, c.rms_norm_eps, False)
            return Rope.apply(y, cos, sin).view(b, r, -1, d)

        # the context K/V, then the block's own. A masked key's score becomes -inf whatever it
        # holds, but a masked value is zeroed: a stale NaN there times its zero weight is NaN
        k_ctx = k_cache.flatten(0, 1)[slots].to(h.dtype)
        v_ctx = torch.where(ctx_valid[:, :, None, None], v_cache.flatten(0, 1)[slots], 0).to(h.dtype)
        k = torch.cat([k_ctx, roped(w.k_proj, w.k_norm)], 1)
        v = torch.cat([v_ctx, F.linear(h, w.v_proj).view(b, r, -1, d)], 1)
        return F.linear(block_attention(roped(w.q_proj, w.q_norm), k, v, visible, d ** -0.5), w.o_proj)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (accumulation dtype): the target's lm_head, times
        output_multiplier, then soft-capped when final_logit_softcapping > 0."""
        c = self.cfg
        logits = F.linear(hidden, self.target.lm_head).to(self.target.acc) * c.output_multiplier
        if c.final_logit_softcapping > 0:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    @torch.no_grad()
    def draft(self, blocks: list[DraftBlock], cache: DFlashCache) -> list[list[int]]:
        """n drafts per block: the argmax of each row (DFlash), or the selector's path (DFlash2)."""
        if not blocks:
            return []
        hidden = self.forward(blocks, cache)
        logits = self.logits(hidden)
        if self.selector is None:
            tokens = logits.argmax(-1)
        else:
            tokens = self.selector.select(hidden, logits, self._anchors(blocks))
        return [row[:b.n] for row, b in zip(tokens.tolist(), blocks)]
