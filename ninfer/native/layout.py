"""Device and Host layout of one Program: byte sizes, pool sizes, and the Main-KV capacity solve.

Seed (Device 布局 / 配置): Main KV pages are 64 tokens; every KV type's bytes follow from its
layers × geometry × storage format; the Main-KV page count lies on the curve
[max(⌈max_context/64⌉, C), C·⌈max_context/64⌉] and, explicit or solved, must fit the memory
budget together with the StateImage slots, backend pools and workspace.
"""

from __future__ import annotations

import msgspec
import torch

from ninfer.config import EngineConfig, kv_page_bounds
from ninfer.errors import ConfigError
from ninfer.native.model.config import PAGE_SIZE, ModelConfig
from ninfer.native.model.forward import state_dtype

from ninfer.protocol import DFLASH, KV_KINDS, MAIN, MTP, STATE  # noqa: E402,F401  (pool kinds)
CPU_DEFAULT_BUDGET = 1 << 30


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """Resolved sizes (plain values; also sent to the controller for its cost model)."""

    max_concurrency: int
    max_context: int
    kv_pages: dict[str, int]          # per KV kind
    kv_page_bytes: dict[str, int]
    state_slots: int                  # C basic + extra
    state_image_bytes: int            # one Device StateImage (= its Host size)
    host_capacity_bytes: int
    workspace_bytes: int
    dtype: str
    prefill_chunk_tokens: int
    spec_tokens: int = 0              # MTP drafts per step (0: no MTP pool)

    @property
    def main_pages(self) -> int:
        return self.kv_pages[MAIN]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def workspace_bytes(cfg: ModelConfig, chunk_tokens: int, itemsize: int) -> int:
    """A generous bound on one call's activations: the prefill chunk through the widest layer
    plus its logits row, with headroom for temporaries."""
    widest = max(cfg.hidden_size * 4, 2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim,
                 cfg.num_attention_heads * cfg.head_dim * 3)
    return 8 * chunk_tokens * widest * itemsize + 4 * cfg.vocab_size * 8


def mtp_pages(main_pages: int, max_concurrency: int, spec_tokens: int) -> int:
    """The MTP pool: a page per Main page (the head's context mirrors Main's positions) plus,
    per lane, a tail copy and the draft entries' peak (k - 1 positions past the frontier)."""
    return main_pages + max_concurrency * (1 + -(-spec_tokens // 64)) if spec_tokens else 0


def resolve_layout(cfg: ModelConfig, ec: EngineConfig, device: torch.device,
                   budget_bytes: int | None = None) -> Layout:
    """Sizes for this model and config; ConfigError with the numbers if they cannot work.

    With MTP the head's pages ride on the same curve: each Main page brings one MTP page
    (``mtp_pages``), so the solve divides the budget by their sum."""
    dtype = getattr(torch, ec.dtype)
    item = _itemsize(dtype)
    max_ctx = ec.resolve_max_context(cfg.max_position_embeddings)
    k = ec.spec_tokens
    if k and not cfg.mtp_num_hidden_layers:
        raise ConfigError("speculative.method='mtp' needs a model with MTP weights (mtp.* tensors); this one has none")
    mtp_bytes = PAGE_SIZE * 2 * cfg.num_key_value_heads * cfg.head_dim * item * cfg.mtp_num_hidden_layers if k else 0
    main_bytes = cfg.kv_bytes_per_page(item)
    page_bytes = main_bytes + mtp_bytes
    image = cfg.state_image_bytes(_itemsize(state_dtype(dtype)), item, item)
    slots = ec.max_concurrency + ec.device_state_slots
    # verify rows keep every step's recurrent state until the accepted prefix is known
    work = workspace_bytes(cfg, ec.prefill_chunk_tokens, item) + ec.max_concurrency * (k + 1) * image * (k > 0)
    lo, hi = kv_page_bounds(max_ctx, ec.max_concurrency)
    fixed = slots * image + work + mtp_pages(0, ec.max_concurrency, k) * mtp_bytes
    if budget_bytes is None:
        budget_bytes = ec.memory_budget_bytes
    if budget_bytes is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget_bytes = int(free * ec.gpu_memory_utilization)
    explicit = ec.checked_kv_pages(max_ctx)
    if explicit is not None:
        pages = explicit
        if budget_bytes is not None and fixed + pages * page_bytes > budget_bytes:
            raise ConfigError(
                f"kv_capacity={ec.kv_capacity} does not fit the memory budget: {pages} pages × {page_bytes} B "
                f"+ {slots} state slots × {image} B + workspace {work} B > budget {budget_bytes} B")
    else:
        budget = budget_bytes if budget_bytes is not None else CPU_DEFAULT_BUDGET
        pages = min(hi, (budget - fixed) // page_bytes if page_bytes else hi)
        if pages < lo:
            raise ConfigError(
                f"the layout does not fit the memory budget: at least {lo} KV pages × {page_bytes} B "
                f"+ {slots} state slots × {image} B + workspace {work} B are needed, budget {budget} B")
    return Layout(
        max_concurrency=ec.max_concurrency, max_context=max_ctx,
        kv_pages={MAIN: int(pages), MTP: mtp_pages(int(pages), ec.max_concurrency, k), DFLASH: 0},
        kv_page_bytes={MAIN: main_bytes, MTP: mtp_bytes, DFLASH: 0},
        state_slots=slots, state_image_bytes=image,
        host_capacity_bytes=ec.host_capacity(image), workspace_bytes=work,
        dtype=ec.dtype, prefill_chunk_tokens=ec.prefill_chunk_tokens, spec_tokens=k,
    )
