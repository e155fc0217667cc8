"""``ninfer plan``: the Device and Host layout the engine would solve for a model on a GPU of a
given size — without the weights and without a GPU.

It reads only config.json (a model directory's, or the file): the weights' bytes follow from the
tensors the loader expects (``weights.expected_tensors``, the vision tower's when the config has
one), in the engine's dtype, FP8 block-scaled where the checkpoint's ``quantization_config`` says
so (1 byte per weight plus one fp32 ``weight_scale_inv`` per 128 × 128 block). The Device budget
is then what the worker would find free after loading — the GPU's memory less a runtime reserve
(CUDA context, cuBLAS workspaces) and the weights — times ``gpu_memory_utilization``, and the
layout is ``layout.resolve_layout`` itself on that budget: Main KV, StateImage slots, the draft
pool, the workspace (the largest chunk's activations and the verify rows' kept states) and the
CUDA graphs' pool. Refusals are the engine's own (``ConfigError``), plus the two that come before
it: weights larger than the GPU, and a loader peak (every tensor is read into host memory before
it moves to the device) or a Host arena larger than the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ninfer.config import EngineConfig, kv_page_bounds
from ninfer.errors import ConfigError, ModelLoadError
from ninfer.native.layout import Layout, resolve_layout
from ninfer.native.model.config import ModelConfig, parse_config

GIB = 1 << 30
RESERVE_BYTES = GIB                # CUDA context, cuBLAS / cuDNN workspaces, allocator slack
FP8_BLOCK = 128


@dataclass(frozen=True)
class Fp8Scheme:
    """A ``quantization_config`` with ``quant_method: fp8`` and 128 x 128 weight blocks."""
    block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    not_converted: tuple[str, ...] = ()

    def quantized(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the checkpoint stores this tensor in FP8: a Linear layer's 2-D weight whose
        module is not in ``modules_to_not_convert`` (a dotted sub-path of the module's name)."""
        if not name.endswith(".weight") or len(shape) != 2 or "embed_tokens" in name:
            return False
        module = "." + name[: -len(".weight")] + "."
        return not any(f".{m.strip('.')}." in module for m in self.not_converted)

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])


def fp8_scheme(raw: dict) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json (top level, or a Qwen3.5 ``text_config``), or None."""
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ModelLoadError(f"config.json: quantization {q.get('quant_method')!r} is not supported (only fp8)")
    block = tuple(q.get("weight_block_size") or ())
    if block != (FP8_BLOCK, FP8_BLOCK):
        raise ModelLoadError(f"config.json: FP8 weight_block_size {list(block)} is not supported (only [128, 128])")
    return Fp8Scheme(not_converted=tuple(q.get("modules_to_not_convert") or ()))


@dataclass
class WeightBytes:
    total: int = 0
    fp8: int = 0                  # FP8 weights (1 byte each)
    scales: int = 0               # their fp32 weight_scale_inv blocks
    plain: int = 0                # everything else, in the engine's dtype
    experts: int = 0              # of the total: routed experts
    vision: int = 0               # of the total: the vision tower
    mtp: int = 0                  # of the total: the MTP head


def weight_bytes(cfg: ModelConfig, raw: dict, dtype: torch.dtype) -> WeightBytes:
    """The bytes the engine holds on the device for this model's weights: the checkpoint's
    tensors as "meta" tensors (FP8 with their scales where the scheme says so) formed into a
    ``HybridModel`` on the "meta" device — the loader's own forming (experts stacked, GDN rows
    permuted, an FP8 weight dequantised where its rows leave their 128-row blocks) — then
    every tensor it holds counted."""
    return _weight_bytes(json.dumps(raw, sort_keys=True), cfg.mtp_num_hidden_layers, str(dtype))


@functools.lru_cache(maxsize=16)
def _weight_bytes(raw_text: str, mtp: int, dtype_name: str) -> WeightBytes:
    from ninfer.native.model.fp8 import SCALE_SUFFIX, Fp8Weight, scale_shape
    from ninfer.native.model.model import HybridModel
    from ninfer.native.model.moe import MoeWeights
    from ninfer.native.model.weights import expected_tensors
    raw = json.loads(raw_text)
    cfg = _parse(raw, mtp)
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    scheme = fp8_scheme(raw)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensors(cfg).items():
        if scheme is not None and scheme.quantized(name, shape):
            tensors[name] = torch.empty(shape, dtype=torch.float8_e4m3fn, device="meta")
            tensors[name + SCALE_SUFFIX] = torch.empty(scale_shape(shape), dtype=torch.float32, device="meta")
        else:
            tensors[name] = torch.empty(shape, dtype=dtype, device="meta")
    model = HybridModel(cfg, tensors, dtype, device="meta", consume=True)
    w = WeightBytes()

    def count(x, parts: tuple[str, ...] = ()) -> None:
        if isinstance(x, Fp8Weight):
            w.fp8 += x.weight.numel()
            w.scales += x.scale_inv.numel() * 4
            n = x.weight.numel() + x.scale_inv.numel() * 4
        elif isinstance(x, torch.Tensor):
            n = x.numel() * x.element_size()
            w.plain += n
        elif isinstance(x, (list, tuple)):
            for y in x:
                count(y, parts)
            return
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                expert = isinstance(x, MoeWeights) and f.name in ("gate_up", "down")
                count(getattr(x, f.name), parts + ("experts",) if expert else parts)
            return
        else:
            return
        w.total += n
        w.experts += n if "experts" in parts else 0
        w.mtp += n if "mtp" in parts else 0
    count([model.layers, model.embed, model.final_norm])
    if not cfg.tie_word_embeddings:
        count(model.lm_head)
    for name, x in model.mtp_tensors.items():
        count(x, ("mtp", "experts") if ".experts." in name else ("mtp",))
    if isinstance(raw.get("vision_config"), dict):
        from ninfer.native.model.vision import expected_vision_tensors, parse_vision_config
        item = torch.empty((), dtype=dtype).element_size()
        w.vision = sum(math.prod(s) for s in expected_vision_tensors(parse_vision_config(raw)).values()) * item
        w.total += w.vision
        w.plain += w.vision
    return w


def _parse(raw: dict, mtp: int) -> ModelConfig:
    parsed = dict(raw)
    if parsed.get("model_type") == "qwen3_5_moe":
        parsed["model_type"] = "qwen3_5"
    return parse_config(parsed, mtp_layers=mtp)


def read_config(path: str | Path) -> tuple[dict, ModelConfig, str]:
    """(raw config.json, ModelConfig, a name) from a model directory or a config file. A Qwen3.5
    MoE config (``qwen3_5_moe``) is read as the Qwen3.5 text model it is (same tensors, experts
    one key each); a Qwen3-Next config without ``mtp_num_hidden_layers`` gets the one MTP layer
    its checkpoints ship (counted from the weight files when the directory has them)."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: cannot read a config.json ({exc})") from None
    mtp = 0
    if raw.get("model_type") == "qwen3_next":
        mtp = 1
        if p.is_dir() and any(p.glob("*.safetensors")):
            from ninfer.native.model.weights import count_mtp_layers, weight_files
            mtp = count_mtp_layers(weight_files(p))
    cfg = _parse(raw, mtp)
    name = raw.get("_name_or_path") or (p.name if p.is_dir() else p.stem)
    return raw, cfg, str(name)


@dataclass
class Plan:
    name: str
    cfg: ModelConfig
    ec: EngineConfig
    gpu_bytes: int
    host_bytes: int
    reserve_bytes: int
    weights: WeightBytes
    fp8: bool
    budget_bytes: int = 0
    layout: Layout | None = None
    refusal: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.layout is not None and not self.refusal

    def as_dict(self) -> dict:
        import msgspec
        out = {"model": self.name, "fits": self.fits, "refusal": self.refusal or None,
               "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes, "reserve_bytes": self.reserve_bytes,
               "budget_bytes": self.budget_bytes, "weights": vars(self.weights), "fp8": self.fp8,
               "notes": self.notes}
        if self.layout is not None:
            out["layout"] = msgspec.to_builtins(self.layout)
            out["device_bytes"] = device_bytes(self.layout)
        return out


def device_bytes(lay: Layout) -> dict[str, int]:
    """What each part of a layout takes on the device (bytes)."""
    kv = {kind: n * lay.kv_page_bytes[kind] for kind, n in lay.kv_pages.items() if n}
    return {**{f"kv_{k.lower()}": v for k, v in kv.items()}, "state_images": lay.state_slots * lay.state_image_bytes,
            "workspace": lay.workspace_bytes, "graphs": lay.graph_bytes}


def make_plan(path: str | Path, gpu_gib: float, host_gib: float, ec: EngineConfig | None = None,
              reserve_bytes: int = RESERVE_BYTES) -> Plan:
    """The layout the worker would solve on a GPU of ``gpu_gib`` with ``host_gib`` of host
    memory (``ec``: the engine's config; default bf16, 8 lanes at the model's context)."""
    raw, cfg, name = read_config(path)
    ec = ec or EngineConfig(dtype="bfloat16", max_concurrency=8)
    dtype = getattr(torch, ec.dtype)
    w = weight_bytes(cfg, raw, dtype)
    plan = Plan(name=name, cfg=cfg, ec=ec, gpu_bytes=int(gpu_gib * GIB), host_bytes=int(host_gib * GIB),
                reserve_bytes=reserve_bytes, weights=w, fp8=fp8_scheme(raw) is not None)
    free = plan.gpu_bytes - reserve_bytes - w.total
    if free <= 0:
        plan.refusal = (f"the weights alone ({w.total / 1e9:.1f} GB) and the runtime reserve "
                        f"({reserve_bytes / GIB:.1f} GiB) exceed the GPU's {gpu_gib:g} GiB"
                        + ("" if plan.fp8 else "; an FP8 checkpoint (-FP8) takes about half"))
        return plan
    plan.budget_bytes = int(free * ec.gpu_memory_utilization)
    try:
        plan.layout = resolve_layout(cfg, ec, torch.device("cuda"), budget_bytes=plan.budget_bytes)
    except ConfigError as exc:
        plan.refusal = str(exc)
        return plan
    lay = plan.layout
    if w.total > plan.host_bytes:
        plan.refusal = (f"loading reads every tensor into host memory before it moves to the GPU: "
                        f"{w.total / 1e9:.1f} GB of weights exceed the host's {host_gib:g} GiB")
    elif lay.host_capacity_bytes > plan.host_bytes:
        plan.refusal = (f"the Host arena (context_cache.host_capacity_bytes = {lay.host_capacity_bytes / GIB:.1f} GiB, "
                        f"pinned) exceeds the host's {host_gib:g} GiB")
    lo, hi = kv_page_bounds(lay.max_context, lay.max_concurrency)
    if lay.main_pages < hi:
        plan.notes.append(f"Main KV holds {lay.main_pages} of the {hi} pages that {lay.max_concurrency} lanes at "
                          f"{lay.max_context} tokens would fill: lanes share it (the policy pauses or reclaims "
                          "when they all grow long)")
    return plan


def _gb(n: int) -> str:
    return f"{n / GIB:8.2f} GiB"


def render(plan: Plan) -> str:
    """The plan as the table ``ninfer plan`` prints."""
    c, w = plan.cfg, plan.weights
    gdn, att = len(c.linear_layers), len(c.attention_layers)
    lines = [f"model      {plan.name}: {c.model_type}, {c.num_hidden_layers} layers ({gdn} GDN + {att} attention), "
             f"{c.num_experts} experts" + (" top-" + str(c.num_experts_per_tok) if c.num_experts else "")
             + (f", MTP {c.mtp_num_hidden_layers}" if c.mtp_num_hidden_layers else "")
             + f"; engine dtype {plan.ec.dtype}" + (", FP8 128x128 block weights" if plan.fp8 else ""),
             f"GPU        {_gb(plan.gpu_bytes)}   reserve {_gb(plan.reserve_bytes).strip()}   "
             f"host {_gb(plan.host_bytes).strip()}",
             f"weights    {_gb(w.total)}   " + (f"fp8 {w.fp8 / GIB:.2f} + scales {w.scales / GIB:.2f} + " if w.fp8 else "")
             + f"{plan.ec.dtype} {w.plain / GIB:.2f} GiB (experts {w.experts / GIB:.2f}, MTP {w.mtp / GIB:.2f}"
             + (f", vision {w.vision / GIB:.2f}" if w.vision else "") + ")"]
    if plan.layout is not None:
        lay = plan.layout
        lines.append(f"budget     {_gb(plan.budget_bytes)}   (free after weights x gpu_memory_utilization "
                     f"{plan.ec.gpu_memory_utilization})")
        for kind, n in lay.kv_pages.items():
            if n:
                tokens = n * 64
                lines.append(f"KV {kind:<7} {_gb(n * lay.kv_page_bytes[kind])}   {n} pages x {lay.kv_page_bytes[kind]} B "
                             f"= {tokens} tokens")
        lines.append(f"states     {_gb(lay.state_slots * lay.state_image_bytes)}   {lay.state_slots} StateImage slots "
                     f"x {lay.state_image_bytes / 1e6:.1f} MB ({lay.max_concurrency} lanes + extra)")
        lines.append(f"workspace  {_gb(lay.workspace_bytes)}   a {lay.prefill_chunk_tokens}-token chunk's activations"
                     + (f" + the verify rows' kept states (C x {lay.spec_tokens + 1} images)" if lay.spec_tokens else ""))
        lines.append(f"graphs     {_gb(lay.graph_bytes)}   CUDA graphs' pool, outputs, scratch page and slot"
                     + ("" if lay.graph_bytes or plan.ec.enforce_eager else " (none: not capturable)"))
        used = sum(device_bytes(lay).values())
        lines.append(f"used       {_gb(used + w.total + plan.reserve_bytes)}   of {_gb(plan.gpu_bytes).strip()}")
        lines.append(f"host arena {_gb(lay.host_capacity_bytes)}   pinned; load peak {w.total / GIB:.2f} GiB of "
                     f"weights read on the host first")
        lo, hi = kv_page_bounds(lay.max_context, lay.max_concurrency)
        lines.append(f"context    {lay.max_concurrency} lanes x {lay.max_context} tokens need {hi} Main pages: "
                     f"solved {lay.main_pages} ({100 * lay.main_pages / hi:.0f} %)")
    lines += [f"note       {n}" for n in plan.notes]
    lines.append("verdict    " + ("fits" if plan.fits else "does not fit: " + plan.refusal))
    return "\n".join(lines)
