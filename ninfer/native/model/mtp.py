"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5: the draft model of the MTP backend.

Weights (``mtp.*``, loaded strictly with the target; shares its embedding and lm_head)::

    e   = pre_fc_norm_embedding(embed(x_{p+1}))          h' = pre_fc_norm_hidden(h_p)
    u   = fc(cat[e, h'])                                  [H, 2H], embedding first
    u   = decoder layer (gated full attention over the head's own KV + the model's MLP kind)
    out = norm(u)                                         logits = lm_head(out)

One *entry* of the head is a position p: its KV (written at p, rope position p) comes from
(h_p, x_{p+1}) and its logits predict x_{p+2}. ``h_p`` is the target's hidden after its final
norm (``feature``); a draft entry beyond the committed ledger uses the head's own ``out`` of the
previous entry and the previous draft token (one layer reused for every draft step, as vLLM
does). With L committed tokens the target has h_0 .. h_{L-2}, so entries 0 .. L-2 exist and the
entry L-2 = (h_{L-2}, x_{L-1}) gives the first draft: the frontier-1 bridge.

KV: ``MtpCache`` pages of 64 positions, the MTP pool's, with page tables of their own. An entry
attends to the head's keys base .. p: ``base`` > 0 when the head's context restarted at a bridge
(its older entries were never computed — a restore point without MTP coverage). Drafts never
change an output token (the engine verifies them against the target), so a shorter context
costs acceptance only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.errors import ModelLoadError
from ninfer.native.model.attention import decode_attention, decode_kv_slots
from ninfer.native.model.config import FULL, PAGE_SIZE
from ninfer.native.model.fp8 import linear
from ninfer.native.model.forward import ForwardBatch, SeqInput
from ninfer.native.model.model import HybridModel, LayerWeights, layer_weights
from ninfer.native.model.moe import MoeWeights, sparse_moe
from ninfer.native.model.ops import rms_norm, silu_mlp


@dataclass
class MtpCache:
    """k, v: [1, P, 64, Hkv, D] — the MTP pool's pages (one attention layer per MTP layer: [n, ...])."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class MtpEntries:
    """One sequence's consecutive entries start .. start + n - 1 of a head call."""

    tokens: list[int]               # x_{p+1} of each entry
    prev: torch.Tensor              # [n, H] the hidden fed to each entry (``feature`` of h_p, or out)
    start: int
    page_table: list[int]           # MTP pages covering start + n positions
    base: int = 0                   # first key position attended


def _share_experts(t: dict, prefix: str, mlp) -> None:
    """The checkpoint-named expert entries become views of the head's stack, so the device holds
    each MTP expert once (the stack beside the per-expert originals: ~1.5 GiB twice for
    Qwen3-Next's 512 experts)."""
    from ninfer.native.model.fp8 import BLOCK, Fp8Weight
    if not isinstance(mlp, MoeWeights):
        return
    inter = mlp.down.shape[-1]
    for e in range(mlp.gate_up.shape[0]):
        names = [f"{prefix}.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
        if isinstance(mlp.gate_up, Fp8Weight):
            gu, d, b = mlp.gate_up, mlp.down, inter // BLOCK
            views = [Fp8Weight(gu.weight[e, :inter], gu.scale_inv[e, :b]),
                     Fp8Weight(gu.weight[e, inter:], gu.scale_inv[e, b:]), d[e]]
        else:
            views = [mlp.gate_up[e, :inter], mlp.gate_up[e, inter:], mlp.down[e]]
        for name, view in zip(names, views):
            if name in t:
                t[name] = view


class MtpHead:
    def __init__(self, model: HybridModel):
        cfg = model.cfg
        n = cfg.mtp_num_hidden_layers
        t = model.mtp_tensors
        if not n or not t:
            raise ModelLoadError("the model has no MTP weights (mtp.* tensors): speculative method 'mtp' needs them")
        self.model = model
        self.cfg = cfg
        try:
            self.fc = t["mtp.fc.weight"]
            self.norm_emb = t["mtp.pre_fc_norm_embedding.weight"]
            self.norm_hidden = t["mtp.pre_fc_norm_hidden.weight"]
            self.norm = t["mtp.norm.weight"]
            self.layers: list[LayerWeights] = [
                layer_weights(t, f"mtp.layers.{j}", cfg, FULL, cfg.num_experts > 0, model.dtype) for j in range(n)]
        except KeyError as exc:
            raise ModelLoadError(f"MTP weights incomplete: missing {exc.args[0]}") from None
        for j, layer in enumerate(self.layers):
            _share_experts(t, f"mtp.layers.{j}.mlp", layer.mlp)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, num_pages: int) -> MtpCache:
        c, m = self.cfg, self.model
        shape = (self.num_layers, num_pages, PAGE_SIZE, c.num_key_value_heads, c.head_dim)
        return MtpCache(torch.zeros(shape, dtype=m.dtype, device=m.device),
                        torch.zeros(shape, dtype=m.dtype, device=m.device))

    def feature(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's continuation hidden (pre-final-norm) -> the head's h_p input."""
        m = self.model
        return rms_norm(hidden, m.final_norm, self.cfg.rms_norm_eps, self.cfg.zero_centered_norm)

    def forward(self, entries: list[MtpEntries], cache: MtpCache, step: int = 0, rows: str = "last") -> torch.Tensor:
        """Compute and write the KV of every entry; return ``out`` [N, H] of each sequence's last
        entry (the hidden of the next draft step). ``rows="all"``: ``out`` of every entry, packed
        as the entries are (training the head scores each one). Differentiable (no no_grad here)."""
        if rows not in ("last", "all"):
            raise ValueError(f"rows must be 'last' or 'all', not {rows!r}")
        c, m = self.cfg, self.model
        seqs = [SeqInput(token_ids=e.tokens, start=e.start, page_table=e.page_table, logits=rows) for e in entries]
        batch = ForwardBatch.build(seqs, m.device)
        prev = torch.cat([e.prev for e in entries]).to(m.dtype)
        # an image's identity ids (>= vocab, native/media.py) embed as id 0: the head only drafts,
        # so a rough input there costs acceptance, never a token
        ids = torch.where(batch.input_ids < c.vocab_size, batch.input_ids, torch.zeros_like(batch.input_ids))
        emb = rms_norm(F.embedding(ids, m.embed), self.norm_emb, c.rms_norm_eps, c.zero_centered_norm)
        hid = rms_norm(prev, self.norm_hidden, c.rms_norm_eps, c.zero_centered_norm)
        x = linear(torch.cat([emb, hid], dim=-1), self.fc)
        j = step % self.num_layers
        layer = self.layers[j]
        # Every entry's K/V is written before attention reads, so each entry row attends like a
        # decode row at its own position over its sequence's pages: one batched op for the call.
        width = max(len(e.page_table) for e in entries)
        per_row = [(e.page_table + e.page_table[:1] * (width - len(e.page_table)), e.base) for e in entries
                   for _ in e.tokens]
        table = torch.tensor([t for t, _ in per_row], dtype=torch.long, device=m.device)
        row_bases = torch.tensor([b for _, b in per_row], dtype=torch.long, device=m.device)
        lens = batch.positions + 1
        slots = decode_kv_slots(table, lens, int(lens.max()))
        # masked keys (below the base, past the row's length) read the base's slot: always written,
        # so no stale or NaN byte meets a zero weight
        at_base = table.gather(1, (row_bases // PAGE_SIZE)[:, None])[:, 0] * PAGE_SIZE + row_bases % PAGE_SIZE
        pos = torch.arange(slots.shape[1], device=m.device)[None, :]
        slots = torch.where((pos < row_bases[:, None]) | (pos >= lens[:, None]), at_base[:, None], slots)

        def attend(q, k_cache, v_cache, b, scale):
            return decode_attention(q, k_cache, v_cache, table, lens, scale, slots, row_bases)

        cos, sin = m.rope.cos_sin(batch.positions)
        h = rms_norm(x, layer.input_norm, c.rms_norm_eps, c.zero_centered_norm)
        x = x + m.attention(layer.mixer, h, cos, sin, batch, cache, j, attend)
        h = rms_norm(x, layer.post_norm, c.rms_norm_eps, c.zero_centered_norm)
        x = x + (sparse_moe(h, layer.mlp) if isinstance(layer.mlp, MoeWeights) else silu_mlp(h, *layer.mlp))
        return rms_norm(x[batch.logits_rows], self.norm, c.rms_norm_eps, c.zero_centered_norm)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` [N, H] -> logits [N, V] (the target's lm_head; no further norm)."""
        return linear(out, self.model.lm_head).to(self.model.acc)
