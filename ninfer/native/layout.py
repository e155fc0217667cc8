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
from ninfer.errors import ConfigError, ModelLoadError
from ninfer.native.model.config import PAGE_SIZE, ModelConfig
from ninfer.native.model.dflash_config import load_draft_config
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
    spec_tokens: int = 0              # drafts per step (0: no speculative backend, no draft pool)
    spec_method: str = ""             # "mtp" | "dflash" | "dflash2" (its pool: MTP or DFLASH)
    draft_dir: str = ""               # the DFlash draft model
    graph_bytes: int = 0              # CUDA graphs' memory pool + their scratch page and slot

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


def graph_bytes(cfg: ModelConfig, ec: EngineConfig, device: torch.device, itemsize: int, page_bytes: int,
                image_bytes: int, spec_tokens: int = 0) -> int:
    """What CUDA graphs take beside the eager workspace (on CUDA unless ``enforce_eager``): their
    memory pool — the activations of the largest graph (``graphs.plan``: a full decode bucket
    beside a budget-long chunk, or the verify rows), shared by all graphs (captured largest
    first), plus every graph's own outputs (the hidden of its logits rows and of every row live
    on; the LM head runs outside the graphs) — and the padding rows' scratch KV page and state
    slot. Nothing for a model whose forward cannot be captured (``graphs.not_capturable``)."""
    from ninfer.native.graphs import CHUNK, chunk_cap, not_capturable, plan, tokens
    from ninfer.native.model.paths import KERNEL_DTYPES
    fused = getattr(torch, ec.dtype) in KERNEL_DTYPES            # CUDA in these dtypes: the kernel path
    if device.type != "cuda" or ec.enforce_eager or not_capturable(cfg, fused):
        return 0
    keys = plan(ec.max_concurrency, spec_tokens + 1 if spec_tokens else 0, ec.chunk_budget,
                chunk_cap(cfg, fused))
    largest = max(tokens(key) for key in keys)
    rows = sum((key[1] * key[2] + 1 if key[0] == CHUNK else tokens(key)) + tokens(key) for key in keys)
    return workspace_bytes(cfg, largest, itemsize) + rows * cfg.hidden_size * itemsize + page_bytes + image_bytes


def draft_pages(main_pages: int, max_concurrency: int, spec_tokens: int, method: str) -> int:
    """The draft backend's pool: a page per Main page (its context mirrors Main's positions)
    plus, per lane, a tail copy — and for MTP the draft entries' peak (k - 1 positions past the
    frontier; DFlash's block KV never persists)."""
    if not spec_tokens:
        return 0
    past = -(-spec_tokens // 64) if method == "mtp" else 0
    return main_pages + max_concurrency * (1 + past)


def resolve_layout(cfg: ModelConfig, ec: EngineConfig, device: torch.device,
                   budget_bytes: int | None = None) -> Layout:
    """Sizes for this model and config; ConfigError with the numbers if they cannot work.

    With a draft backend its pages ride on the same curve: each Main page brings one draft page
    (``draft_pages``), so the solve divides the budget by their sum — unless
    ``speculative.draft_pages`` fixes the draft pool's size."""
    dtype = getattr(torch, ec.dtype)
    item = _itemsize(dtype)
    max_ctx = ec.resolve_max_context(cfg.max_position_embeddings)
    spec = ec.speculative
    k, method = ec.spec_tokens, spec.method if spec is not None else ""
    if spec is not None and spec.dflash:
        try:
            dcfg = load_draft_config(spec.draft)
        except ModelLoadError as exc:
            raise ConfigError(f"speculative.draft={spec.draft!r}: {exc}") from None
        if dcfg.kind != spec.method:
            raise ConfigError(f"speculative.method={spec.method!r} but the draft in {spec.draft} is a "
                              f"{dcfg.kind} draft")
        if k is None:
            k = dcfg.block_size - 1
        if k > dcfg.block_size - 1:
            raise ConfigError(f"speculative.num_tokens={k} exceeds the draft's block ({dcfg.block_size} = "
                              f"{dcfg.block_size - 1} drafts + the anchor)")
        draft_bytes = PAGE_SIZE * 2 * dcfg.num_kv_heads * dcfg.head_dim * item * dcfg.num_layers
    else:
        if k and not cfg.mtp_num_hidden_layers:
            raise ConfigError("speculative.method='mtp' needs a model with MTP weights (mtp.* tensors); "
                              "this one has none")
        draft_bytes = PAGE_SIZE * 2 * cfg.num_key_value_heads * cfg.head_dim * item * cfg.mtp_num_hidden_layers \
            if k else 0
    fixed_pages = spec is not None and spec.draft_pages is not None
    main_bytes = cfg.kv_bytes_per_page(item)
    page_bytes = main_bytes + (0 if fixed_pages else draft_bytes)
    image = cfg.state_image_bytes(_itemsize(state_dtype(dtype)), item, item)
    slots = ec.max_concurrency + ec.device_state_slots
    # verify rows keep every step's recurrent state until the accepted prefix is known
    work = workspace_bytes(cfg, ec.chunk_budget, item) + ec.max_concurrency * (k + 1) * image * (k > 0)
    lo, hi = kv_page_bounds(max_ctx, ec.max_concurrency)
    graph = graph_bytes(cfg, ec, device, item, main_bytes, image, k)
    margin = spec.draft_pages if fixed_pages else draft_pages(0, ec.max_concurrency, k, method)
    fixed = slots * image + work + margin * draft_bytes + graph
    if budget_bytes is None:
        budget_bytes = ec.memory_budget_bytes
    if budget_bytes is None and device.type == "cuda":
        # what the caching allocator holds but no tensor uses (the model's load temporaries)
        # is free for the pools: mem_get_info counts it as used until it is given back
        torch.cuda.empty_cache()
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
    n_draft = spec.draft_pages if fixed_pages else draft_pages(int(pages), ec.max_concurrency, k, method)
    pool = DFLASH if spec is not None and spec.dflash else MTP
    return Layout(
        max_concurrency=ec.max_concurrency, max_context=max_ctx,
        kv_pages={MAIN: int(pages), MTP: 0, DFLASH: 0, pool: n_draft},
        kv_page_bytes={MAIN: main_bytes, MTP: 0, DFLASH: 0, pool: draft_bytes},
        state_slots=slots, state_image_bytes=image,
        host_capacity_bytes=ec.host_capacity(image), workspace_bytes=work, graph_bytes=graph,
        dtype=ec.dtype, prefill_chunk_tokens=ec.chunk_budget, spec_tokens=k,
        spec_method=method if k else "", draft_dir=(spec.draft or "") if spec is not None else "",
    )
