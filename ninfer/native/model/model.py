"""The hybrid decoder (Qwen3-Next; Qwen3 as the degenerate case) over paged KV and state slots.

One ``forward`` serves every unit kind: a batch of decode rows plus prefill/replay chunks,
described by an explicit ``ForwardBatch`` (no globals read deep in the layers).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from ninfer.errors import ModelLoadError
from ninfer.native.model import cpu_layers, cpu_ops, fp8
from ninfer.native.model.config import LINEAR, ModelConfig, load_config
from ninfer.native.model.forward import ForwardBatch, ForwardOutput, ModelCache, SeqInput
from ninfer.native.model.moe import MoeWeights
from ninfer.native.model.fp8 import linear
from ninfer.native.model.ops import Rope, acc_dtype, silu_mlp
from ninfer.native.model.paths import BATCHED, CPU, ForwardPath, for_device
from ninfer.native.model.weights import count_mtp_layers, load_tensors, weight_files

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ModelLoadError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")


@dataclass
class AttentionWeights:
    q_proj: torch.Tensor            # [H*D*(2 if gated else 1), hidden]
    k_proj: torch.Tensor            # [Hkv*D, hidden]
    v_proj: torch.Tensor
    o_proj: torch.Tensor            # [hidden, H*D]
    q_norm: torch.Tensor            # [D]
    k_norm: torch.Tensor
    biases: tuple | None = None     # (q, k, v, o) when attention_bias


@dataclass
class GdnWeights:
    in_proj_qkvz: torch.Tensor      # rows permuted to [q_all | k_all | v_all | z_all]
    in_proj_ba: torch.Tensor        # rows permuted to [b_all | a_all]
    conv: torch.Tensor              # [C, K]
    dt_bias: torch.Tensor           # [Hv]
    a_log: torch.Tensor             # [Hv]
    norm: torch.Tensor              # [Dv]
    out_proj: torch.Tensor          # [hidden, Hv*Dv]


@dataclass
class LayerWeights:
    kind: str
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    mixer: AttentionWeights | GdnWeights
    mlp: MoeWeights | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    # the CPU path's fused products and constants (``cpu_layers.prepare``; its projections are
    # views of them); None elsewhere. Derived: never copied with the weights (``_as_dtype``)
    cpu: cpu_layers.CpuLayer | None = None


def _qkvz_permutation(c: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Row orders turning the checkpoint's per-key-head grouping into contiguous q|k|v|z, b|a.

    Checkpoint layout per key head g (r = Hv/Hk value heads per group):
        qkvz: [q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)]      ba: [b_g (r) | a_g (r)]
    """
    dk, dv, hk = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_key_heads
    r = c.linear_num_value_heads // hk
    width = 2 * dk + 2 * r * dv
    parts: list[list[int]] = [[], [], [], []]
    for gi in range(hk):
        base = gi * width
        parts[0].extend(range(base, base + dk))
        parts[1].extend(range(base + dk, base + 2 * dk))
        parts[2].extend(range(base + 2 * dk, base + 2 * dk + r * dv))
        parts[3].extend(range(base + 2 * dk + r * dv, base + width))
    qkvz = torch.tensor(parts[0] + parts[1] + parts[2] + parts[3])
    ba = torch.tensor([gi * 2 * r + j for gi in range(hk) for j in range(r)]
                      + [gi * 2 * r + r + j for gi in range(hk) for j in range(r)])
    return qkvz, ba


def _mlp_weights(t: dict[str, torch.Tensor], p: str, c: ModelConfig, moe: bool, dtype: torch.dtype):
    if not moe:
        return (t[f"{p}.gate_proj.weight"], t[f"{p}.up_proj.weight"], t[f"{p}.down_proj.weight"])
    e_range = range(c.num_experts)
    gate_up = fp8.stack([fp8.cat_rows([t[f"{p}.experts.{e}.gate_proj.weight"],
                                       t[f"{p}.experts.{e}.up_proj.weight"]], dtype) for e in e_range], dtype)
    down = fp8.stack([t[f"{p}.experts.{e}.down_proj.weight"] for e in e_range], dtype)
    w = MoeWeights(router=t[f"{p}.gate.weight"], gate_up=gate_up, down=down,
                   top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob)
    if c.shared_expert_intermediate_size > 0:
        w.shared_gate_proj = t[f"{p}.shared_expert.gate_proj.weight"]
        w.shared_up_proj = t[f"{p}.shared_expert.up_proj.weight"]
        w.shared_down_proj = t[f"{p}.shared_expert.down_proj.weight"]
        w.shared_gate = t[f"{p}.shared_expert_gate.weight"]
    return w


def _as_dtype(w, dtype: torch.dtype):
    """A layer's weights (dataclasses, tuples, tensors) copied in ``dtype``; the original untouched."""
    if isinstance(w, torch.Tensor):
        return w.to(dtype) if w.is_floating_point() else w
    if isinstance(w, tuple):
        return tuple(_as_dtype(x, dtype) for x in w)
    if dataclasses.is_dataclass(w):
        return dataclasses.replace(w, **{f.name: _as_dtype(getattr(w, f.name), dtype) for f in dataclasses.fields(w)
                                         if f.name != "cpu"})
    return w


def _leaves(w):
    """A layer's weights (dataclasses, tuples) as their tensors and FP8 weights."""
    if isinstance(w, (torch.Tensor, fp8.Fp8Weight)):
        yield w
    elif isinstance(w, tuple):
        for x in w:
            yield from _leaves(x)
    elif dataclasses.is_dataclass(w):
        for f in dataclasses.fields(w):
            if f.name != "cpu":                 # derived, its parts' views (``cpu_layers.prepare``)
                yield from _leaves(getattr(w, f.name))


# Weights up to which a CPU bf16 / fp16 model keeps an fp32 twin of them for its decode rows
# (``HybridModel.decode_twin``): the twin costs twice the half-precision weights again.
DECODE_TWIN_MAX_BYTES = 2 << 30


def _to_device(w, device: torch.device):
    """A layer's weights (dataclasses, tuples, tensors) moved to ``device`` in place."""
    if isinstance(w, torch.Tensor):
        return w.to(device)
    if isinstance(w, tuple):
        return tuple(_to_device(x, device) for x in w)
    if dataclasses.is_dataclass(w):
        for f in dataclasses.fields(w):
            setattr(w, f.name, _to_device(getattr(w, f.name), device))
    return w


def layer_weights(t: dict[str, torch.Tensor], p: str, c: ModelConfig, kind: str, moe: bool,
                   dtype: torch.dtype = torch.float32) -> LayerWeights:
    """One decoder layer's weights from the checkpoint's; ``dtype``: the model's, where a
    formed FP8 weight cannot stay FP8 (rows moved out of their 128-row blocks: ``fp8.py``)."""
    if kind == LINEAR:
        a = f"{p}.linear_attn"
        if c.split_gdn_projections:  # Qwen3.5: already [q_all | k_all | v_all], z, b, a
            qkvz = fp8.cat_rows([t[f"{a}.in_proj_qkv.weight"], t[f"{a}.in_proj_z.weight"]], dtype)
            ba = fp8.cat_rows([t[f"{a}.in_proj_b.weight"], t[f"{a}.in_proj_a.weight"]], dtype)
        else:
            perm_qkvz, perm_ba = _qkvz_permutation(c)
            qkvz = fp8.permute_rows(t[f"{a}.in_proj_qkvz.weight"], perm_qkvz, dtype)
            ba = fp8.permute_rows(t[f"{a}.in_proj_ba.weight"], perm_ba, dtype)
        mixer: AttentionWeights | GdnWeights = GdnWeights(
            in_proj_qkvz=qkvz,
            in_proj_ba=ba,
            conv=t[f"{a}.conv1d.weight"][:, 0, :].contiguous(),
            dt_bias=t[f"{a}.dt_bias"], a_log=t[f"{a}.A_log"], norm=t[f"{a}.norm.weight"],
            out_proj=t[f"{a}.out_proj.weight"],
        )
    else:
        a = f"{p}.self_attn"
        biases = None
        if c.attention_bias:
            biases = tuple(t[f"{a}.{n}_proj.bias"] for n in "qkvo")
        mixer = AttentionWeights(
            q_proj=t[f"{a}.q_proj.weight"], k_proj=t[f"{a}.k_proj.weight"],
            v_proj=t[f"{a}.v_proj.weight"], o_proj=t[f"{a}.o_proj.weight"],
            q_norm=t[f"{a}.q_norm.weight"], k_norm=t[f"{a}.k_norm.weight"], biases=biases,
        )
    return LayerWeights(kind=kind, input_norm=t[f"{p}.input_layernorm.weight"],
                        post_norm=t[f"{p}.post_attention_layernorm.weight"], mixer=mixer,
                        mlp=_mlp_weights(t, f"{p}.mlp", c, moe, dtype))


def _prepare_cpu_layers(model: "HybridModel") -> None:
    """The CPU path's fused layers (``cpu_layers``), built once when the model is on it; other
    paths run none."""
    if model.path is CPU:
        for layer in model.layers:
            layer.cpu = cpu_layers.prepare(layer, model.cfg, model.acc)


class HybridModel:
    """Weights + math of one resident model. Stateless: all state lives in a ModelCache.

    ``path`` says how the mixers run over the sequences of a call: chosen by device and dtype
    (``paths.for_device``: the kernels on CUDA, ``paths.CPU`` on the CPU, ``paths.BATCHED`` for
    float64); tests and the decode benchmark set the per-sequence reference
    ``paths.PER_SEQUENCE`` or, under the Triton interpreter, ``paths.KERNELS`` on the CPU."""

    path: ForwardPath = BATCHED
    source: Path | None = None              # the model directory it was loaded from (its tokenizer)
    decode_twin: "HybridModel | None" = None  # a CPU bf16 / fp16 model's fp32 twin (``_make_decode_twin``)

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", consume: bool = False):
        """``tensors`` stay where they are while each layer's weights are formed (experts stacked,
        GDN rows permuted): on the host for a loaded checkpoint, so the device never holds an
        expert twice (the per-expert tensors and their stack: non-expert + 2 x experts at the
        peak); each layer moves to ``device`` once formed. ``consume``: ``tensors`` is the
        caller's to give up — each layer's entries are dropped once moved (the loader's host
        copy shrinks as the device fills)."""
        self.cfg = cfg
        self.dtype = dtype
        self.acc = acc_dtype(dtype)
        self.device = torch.device(device)
        self.path = for_device(self.device, dtype)
        t = fp8.fold(tensors if consume else dict(tensors), dtype)
        p = cfg.text_prefix
        by_layer: dict[str, list[str]] = {}              # "…layers.i" -> its tensors' names
        for name in t:
            if name.startswith(p + "layers."):
                by_layer.setdefault(name[:name.index(".", len(p) + 7)], []).append(name)
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            prefix = f"{p}layers.{i}"
            layer = layer_weights(t, prefix, cfg, kind, cfg.is_moe_layer(i), dtype)
            for name in by_layer.get(prefix, ()):
                del t[name]
            self.layers.append(_to_device(layer, self.device))
        t = {k: _to_device(v, self.device) for k, v in t.items()}
        self.embed = t[f"{p}embed_tokens.weight"]
        self.final_norm = t[f"{p}norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else t["lm_head.weight"]
        # The MTP head's weights (native/model/mtp.py builds it); never used by the main forward.
        self.mtp_tensors = {k: v for k, v in t.items() if k.startswith("mtp.")}
        self.rope = Rope(cfg.rotary_dim, cfg.rope_theta, dtype, self.device, cfg.mrope_section)
        # layer index -> index into the per-kind cache tensors
        self.cache_index = {}
        for kind_layers in (cfg.attention_layers, cfg.linear_layers):
            self.cache_index.update({layer: j for j, layer in enumerate(kind_layers)})
        _prepare_cpu_layers(self)
        self.decode_twin = self._make_decode_twin()

    def _make_decode_twin(self) -> "HybridModel | None":
        """A CPU bf16 / fp16 model's decode rows run in fp32 on a twin of its weights (the same
        values: a half-precision weight is exact in fp32), over the same cache. On the CPU the
        half-precision ops of a few rows cost more than fp32's (oneDNN's per-call floor, the
        conversions: bf16 decode at 8 rows 6.7 ms a step against fp32's 4.3), while a chunk's
        matmuls and attention run 2-7x faster in bf16 (AMX). A decode row computed in fp32 is the
        half-precision row with finer rounding inside; its hidden is rounded to the model's dtype
        before the LM head, so its logits are what the hidden it stores gives
        (``_through_twin``). None elsewhere, for FP8 weights, and past ``DECODE_TWIN_MAX_BYTES``."""
        if self.device.type != "cpu" or self.dtype not in (torch.bfloat16, torch.float16):
            return None
        leaves = list(_leaves((*self.layers, self.embed, self.final_norm, self.lm_head)))
        if any(isinstance(t, fp8.Fp8Weight) for t in leaves) or 4 * sum(t.numel() for t in leaves) > DECODE_TWIN_MAX_BYTES:
            return None
        twin = copy.copy(self)
        twin.dtype, twin.acc = torch.float32, acc_dtype(torch.float32)
        twin.path = for_device(self.device, torch.float32)
        twin.layers = [_as_dtype(layer, torch.float32) for layer in self.layers]
        _prepare_cpu_layers(twin)
        twin.embed, twin.final_norm = self.embed.float(), self.final_norm.float()
        twin.lm_head = twin.embed if self.cfg.tie_word_embeddings else self.lm_head.float()
        twin.rope = Rope(self.cfg.rotary_dim, self.cfg.rope_theta, torch.float32, self.device, self.cfg.mrope_section)
        twin.mtp_tensors, twin.decode_twin = {}, None
        return twin

    # ---- loading ------------------------------------------------------------------------
    @staticmethod
    def load(model_dir: str | Path, dtype: str | torch.dtype = "float32",
             device: torch.device | str = "cpu") -> "HybridModel":
        path = Path(model_dir)
        tdtype = parse_dtype(dtype)
        cfg = load_config(path)
        files = weight_files(path)
        if not cfg.mtp_num_hidden_layers:
            # Qwen3-Next checkpoints ship mtp.* weights without a config key.
            cfg = msgspec.structs.replace(cfg, mtp_num_hidden_layers=count_mtp_layers(files))
        model = HybridModel(cfg, load_tensors(path, cfg, tdtype, files), tdtype, device, consume=True)
        model.source = path
        return model

    def new_cache(self, num_pages: int, num_slots: int) -> ModelCache:
        return ModelCache.allocate(self.cfg, num_pages, num_slots, self.dtype, self.device)

    # ---- forward ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: ModelCache, embeds: torch.Tensor | None = None,
                taps: tuple[int, ...] = (), static: bool = False, logits: bool = True) -> ForwardOutput:
        """``embeds`` [T, H] replaces the token embeddings when given (a prompt with images:
        ``multimodal.prompt_embeddings``). With ``mrope_section``, ``batch.rope_positions`` [3, T]
        (when set) are the rotary positions; the cache is always indexed by ``batch.positions``.
        ``taps``: layer ids whose outputs (every row) come back concatenated in ``out.taps``
        [T, len(taps) * H] — a DFlash draft's context features (``dflash.tap_features``).
        ``static``: only ops without data-dependent shapes (MoE in its dense form), for a CUDA
        graph's capture (native/graphs.py). ``logits=False``: ``out.logits`` is None (a graph
        leaves the LM head to its caller, for the real rows only)."""
        if batch.all_decode and embeds is None and not taps and not static and self._twin_decodes():
            return self._through_twin(batch, cache, logits)
        c = self.cfg
        x = F.embedding(batch.input_ids, self.embed) if embeds is None else embeds.to(self.dtype)
        rope_pos = batch.rope_positions if (c.mrope_section and batch.rope_positions is not None) else batch.positions
        cos, sin = self.rope.cos_sin(rope_pos)
        if self.path is CPU and not static:
            return self._forward_cpu(x, cos, sin, batch, cache, taps, logits)
        tapped = {}
        for i, layer in enumerate(self.layers):
            h = self.path.rms_norm(x, layer.input_norm, c.rms_norm_eps, c.zero_centered_norm)
            j = self.cache_index[i]
            if layer.kind == LINEAR:
                h = self._gdn(layer.mixer, h, batch, cache, j)
            else:
                h = self.attention(layer.mixer, h, cos, sin, batch, cache, j)
            x = x + h
            h = self.path.rms_norm(x, layer.post_norm, c.rms_norm_eps, c.zero_centered_norm)
            x = x + (self.path.moe(h, layer.mlp, static) if isinstance(layer.mlp, MoeWeights) else silu_mlp(h, *layer.mlp))
            if i in taps:
                tapped[i] = x
        return self._output(x, batch, tapped, taps, logits)

    def _forward_cpu(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                     cache: ModelCache, taps: tuple[int, ...], logits: bool) -> ForwardOutput:
        """``forward``'s layers on the CPU path: a layer with a ``CpuLayer`` runs ``cpu_layers``
        (fewer torch calls, the same results to rounding), one without (FP8 weights) the generic
        layer."""
        c = self.cfg
        eps, zc = c.rms_norm_eps, c.zero_centered_norm
        cos1, sin1 = cos[:, None], sin[:, None]
        tapped = {}
        for i, layer in enumerate(self.layers):
            j, f = self.cache_index[i], layer.cpu
            if f is None:
                h = self.path.rms_norm(x, layer.input_norm, eps, zc)
                h = (self._gdn(layer.mixer, h, batch, cache, j) if layer.kind == LINEAR
                     else self.attention(layer.mixer, h, cos, sin, batch, cache, j))
            else:
                h = cpu_ops.scaled_norm(x, f.input_norm, eps, zc)
                h = (cpu_layers.gdn(self, layer.mixer, f.mixer, h, batch, cache, j) if layer.kind == LINEAR
                     else cpu_layers.attention(self, layer.mixer, f.mixer, h, cos1, sin1, batch, cache, j))
            x = x + h
            h = self.path.rms_norm(x, layer.post_norm, eps, zc) if f is None else cpu_ops.scaled_norm(
                x, f.post_norm, eps, zc)
            if not isinstance(layer.mlp, MoeWeights):
                x = x + silu_mlp(h, *layer.mlp)
            elif f is not None and f.moe is not None and cpu_ops.takes_dense_moe(h, layer.mlp):
                x = x + cpu_layers.dense_moe(h, layer.mlp, f.moe)
            else:
                x = x + self.path.moe(h, layer.mlp, False)
            if i in taps:
                tapped[i] = x
        return self._output(x, batch, tapped, taps, logits)

    def _output(self, x: torch.Tensor, batch: ForwardBatch, tapped: dict, taps: tuple[int, ...],
                logits: bool) -> ForwardOutput:
        """A forward's output from its last layer's rows ``x``."""
        hidden = x[batch.logits_rows]
        return ForwardOutput(hidden=hidden, logits=self.logits(hidden) if logits else None, all_hidden=x,
                             taps=torch.cat([tapped[i] for i in taps], dim=-1) if taps else None)

    def _twin_decodes(self) -> bool:
        """Decode rows go to ``decode_twin`` (the CPU path's choice: a test that sets another
        path on the model gets that path for every row)."""
        return self.decode_twin is not None and self.path.name == "cpu"

    def _through_twin(self, batch: ForwardBatch, cache: ModelCache, logits: bool) -> ForwardOutput:
        """Decode rows by the fp32 twin, their hidden rounded to the model's dtype and the LM head
        applied to that: the logits a stored hidden (``Memory.hidden``) gives again."""
        out = self.decode_twin.forward(batch, cache, logits=False)
        hidden = out.hidden.to(self.dtype)
        return ForwardOutput(hidden=hidden, logits=self.logits(hidden) if logits else None,
                             all_hidden=out.all_hidden.to(self.dtype))

    @torch.no_grad()
    def forward_seqs(self, seqs: list[SeqInput], batch: ForwardBatch, cache: ModelCache) -> ForwardOutput:
        """The forward of ``batch`` = ``ForwardBatch.build(seqs)``, where a call's decode rows beside a chunk
        or verify rows run as a call of their own when they go to the twin (``_make_decode_twin``):
        a decode row's arithmetic does not depend on what shares its call. The output and the
        batch's ``cut_states`` and ``spec_states`` are those of the one call (rows and sequence
        indices as in it)."""
        single = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        if not single or len(single) == len(seqs) or not self._twin_decodes():
            return self.forward(batch, cache)
        rest = [i for i in range(len(seqs)) if i not in single]
        all_hidden = torch.empty(batch.input_ids.shape[0], self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        per_seq: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for part in (single, rest):
            sub = ForwardBatch.build([seqs[i] for i in part], self.device)
            out = self.forward(sub, cache)
            at = 0
            for j, i in enumerate(part):
                all_hidden[batch.cu[i]:batch.cu[i + 1]] = out.all_hidden[sub.cu[j]:sub.cu[j + 1]]
                n = {"all": sub.cu[j + 1] - sub.cu[j], "last": 1}.get(seqs[i].logits, 0)
                per_seq[i] = (out.hidden[at:at + n], out.logits[at:at + n])
                at += n
            batch.cut_states.extend({part[j]: kept for j, kept in layer.items()} for layer in sub.cut_states)
            batch.spec_states.extend({part[j]: kept for j, kept in layer.items()} for layer in sub.spec_states)
        order = range(len(seqs))
        return ForwardOutput(hidden=torch.cat([per_seq[i][0] for i in order]),
                             logits=torch.cat([per_seq[i][1] for i in order]), all_hidden=all_hidden)

    def roll_back(self, cache: ModelCache, batch: ForwardBatch, s: int, slot: int, keep: int) -> None:
        """Verify row ``s`` of ``batch`` kept only its first ``keep`` inputs (the accepted prefix):
        put the GDN and conv states after that input into ``slot``. KV written past it lies
        beyond the frontier and is never read."""
        k1 = self.cfg.linear_conv_kernel_dim - 1
        for j, per_layer in enumerate(batch.spec_states):
            conv0, inputs, steps = per_layer[s]
            xs = torch.cat([conv0.to(inputs.dtype), inputs[:keep].t()], dim=1)
            cache.conv[j, slot] = xs[:, xs.shape[1] - k1:].to(cache.conv.dtype)
            cache.ssm[j, slot] = steps[keep - 1].to(cache.ssm.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [M, H] -> logits [M, V] (accumulation dtype)."""
        normed = self.path.rms_norm(hidden, self.final_norm, self.cfg.rms_norm_eps, self.cfg.zero_centered_norm)
        return linear(normed, self.lm_head).to(self.acc)

    def attention(self, w: AttentionWeights, x: torch.Tensor, cos, sin, batch: ForwardBatch,
                   cache: ModelCache, j: int, attend=None) -> torch.Tensor:
        """One gated attention layer; ``attend`` replaces the path's attention (the MTP head's)."""
        c = self.cfg
        T, D = x.shape[0], c.head_dim
        bq, bk, bv, bo = w.biases or (None, None, None, None)
        q = linear(x, w.q_proj, bq)
        gate = None
        if c.attn_output_gate:
            q, gate = q.view(T, -1, 2 * D).chunk(2, dim=-1)
            gate = gate.reshape(T, -1)
        q = self.path.rms_norm(q.reshape(T, -1, D), w.q_norm, c.rms_norm_eps, c.zero_centered_norm)
        k = self.path.rms_norm(linear(x, w.k_proj, bk).view(T, -1, D), w.k_norm, c.rms_norm_eps, c.zero_centered_norm)
        v = linear(x, w.v_proj, bv).view(T, -1, D)
        q, k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
        self.path.write_kv(cache.k[j], cache.v[j], batch.slot_mapping, k, v)
        out = (attend or self.path.attention)(q, cache.k[j], cache.v[j], batch, D ** -0.5).reshape(T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, w.o_proj, bo)

    def _gdn(self, w: GdnWeights, x: torch.Tensor, batch: ForwardBatch, cache: ModelCache, j: int) -> torch.Tensor:
        c = self.cfg
        qkvz = linear(x, w.in_proj_qkvz)
        mixed, z = qkvz[:, :c.conv_dim], qkvz[:, c.conv_dim:]
        b, a = linear(x, w.in_proj_ba).chunk(2, dim=-1)
        beta = torch.sigmoid(b)
        g = -w.a_log.to(self.acc).exp() * F.softplus(a.to(self.acc) + w.dt_bias.to(self.acc))
        return self.gdn_mix(w, mixed, z, g, beta, batch, cache, j)

    def gdn_mix(self, w: GdnWeights, mixed: torch.Tensor, z: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                batch: ForwardBatch, cache: ModelCache, j: int) -> torch.Tensor:
        """A GDN layer from its projections on (``_gdn``'s and ``cpu_layers.gdn``'s): the path's
        conv and delta rule over the pre-conv q|k|v ``mixed`` [T, C], the gated norm by ``z``, the
        output projection."""
        c = self.cfg
        T = mixed.shape[0]
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim

        def split(m: torch.Tensor):
            q, k, v = m.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
            return q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))

        core = self.path.gdn(mixed, g, beta, w.conv, cache.conv[j], cache.ssm[j], batch, split)
        out = self.path.gated_rms_norm(core, z.view(T, hv, dv), w.norm, c.rms_norm_eps)
        return linear(out.reshape(T, hv * dv), w.out_proj)
