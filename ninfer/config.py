"""Engine configuration (seed: 配置): plain values that build anywhere, without a model or a GPU.

    max_concurrency          C, execution lanes, 1..8
    max_context              logical context limit of one request (None = the model's limit)
    kv_capacity              Main-KV pool in tokens, rounded up to 64-token pages
                             (None = solve the largest page count that fits the memory budget)
    context_cache.device_state_slots    extra Device StateImage slots beyond C (default C)
    context_cache.encoder_cache_bytes   vision-tower outputs kept by image digest (default 256 MiB;
                             0: every chunk that needs an image re-encodes it)
    context_cache.host_capacity_bytes   shared pinned Host backing for StateImages, KV, pause
                             snapshots and transfer destinations (default 8 GiB + 8 × the
                             model's Host StateImage size)
    copy_engine              "auto" (a CUDA stream on a GPU, inline on the CPU) | "thread" (a
                             copy thread: asynchronous completions on the CPU) | "inline" (copies
                             at submission, completions at the next progress point; deterministic)
    completion_timeout_s     a transaction whose copies finished but whose completion never
                             arrived is settled after this long (a dropped completion)
    step_timeout_s           over Ray, a step unanswered this long (default 600 s; None: no limit)
                             makes the controller replace the worker as lost (a hung process)
    cost_calibration         measure the Host→Device copy rate and the prefill rate at startup
                             for the source cost model (false: the built-in CPU defaults)
    faults                   public fault injection (``ninfer.faults``); empty = none
    log_format               "text" | "json": install the ``ninfer`` log handler in every engine
                             process (None: ``NINFER_LOG_FORMAT`` if set, else leave logging to
                             the application; see ``ninfer.logs``)
    media_budget_bytes       the frontend's prepared-image cache (vision models; default 512 MiB):
                             an image whose pixel_values alone exceed it is refused (400)
    log_stats_interval_s     the periodic engine summary's interval while busy (0 = never)

Checks that need the model (the Main-KV curve, the memory budget) happen when the Native layer
resolves the layout; they raise the same ConfigError with the numbers.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import msgspec

from ninfer.errors import ConfigError
from ninfer.faults import Fault
from ninfer.logs import FORMATS as LOG_FORMATS

PAGE_SIZE = 64
GIB = 1 << 30
DTYPES = ("float64", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
COPY_ENGINES = ("auto", "thread", "inline")


def _range_error(field: str, value, allowed: str) -> ConfigError:
    return ConfigError(f"{field}={value!r} is out of range: allowed {allowed}")


class ContextCacheConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    device_state_slots: int | None = None
    host_capacity_bytes: int | None = None
    encoder_cache_bytes: int = 256 * 2 ** 20    # vision-tower outputs kept by media digest (0: none)
    # a prompt's divergence position (the longest prefix it shares with any known history) is
    # offered as a save when it lies at least this many tokens beyond the restore point below it
    # (docs/api.md "Where restore points are"); None: no divergence positions
    divergence_min_tokens: int | None = 16
    # offer saves at anticipated positions too: a prompt's end less a doubling ladder of tails
    # (divergence_min_tokens x 1, 2, 4, 8, 16) and less the longer tails real divergences showed
    # most often — each an optional save (admission table); false: only where a
    # second request really parted (divergence positions) and at input boundaries
    anticipate: bool = True
    # take the saves a prefill chunk crosses inside it: the forward keeps the state at each save
    # point as it passes (one forward, several StateImages) where the worker can (no draft
    # backend); false: every save point ends its unit (one forward per save point)
    inner_saves: bool = True

    def __post_init__(self) -> None:
        if self.divergence_min_tokens is not None and self.divergence_min_tokens < 1:
            raise _range_error("context_cache.divergence_min_tokens", self.divergence_min_tokens,
                               ">= 1, or null for none")
        if self.device_state_slots is not None and self.device_state_slots < 0:
            raise _range_error("context_cache.device_state_slots", self.device_state_slots, ">= 0 (default C)")
        if self.host_capacity_bytes is not None and self.host_capacity_bytes < 0:
            raise _range_error("context_cache.host_capacity_bytes", self.host_capacity_bytes, ">= 0")
        if self.encoder_cache_bytes < 0:
            raise _range_error("context_cache.encoder_cache_bytes", self.encoder_cache_bytes, ">= 0")


SPEC_METHODS = ("mtp", "dflash", "dflash2")


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``speculative={"method": "mtp", "num_tokens": k}``: draft k tokens per step with the
    model's own MTP head and verify them in the next step. ``{"method": "dflash" | "dflash2",
    "draft": DIR}``: a DFlash block-diffusion draft model (DIR: its config.json and safetensors)
    drafts a block of ``num_tokens`` (default: its block size − 1; ``block`` = num_tokens + 1 is
    the paper's spelling) from the target's tap-layer features. Never changes an output token: a
    draft is kept only where it equals the token the target samples there (seeded per position,
    as without speculation).

    ``draft_pages``: pages of the draft backend's KV pool (None: one per Main page plus a tail
    copy per lane, so it is short only when Main pages have moved to the Host). Short, the
    backend first drops checkpoints' draft coverage; a DFlash checkpoint without it is no restore
    point (its context is rebuilt by prefill)."""

    method: str = "mtp"
    num_tokens: int | None = None
    draft: str | None = None            # the draft model directory (DFlash; not for MTP)
    block: int | None = None            # DFlash: num_tokens + 1
    draft_pages: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise _range_error("speculative.method", self.method, " | ".join(SPEC_METHODS))
        if self.method == "mtp":
            if self.draft is not None:
                raise ConfigError("speculative.draft is for a separate draft model; method 'mtp' uses the model's own "
                                  "MTP head (remove 'draft')")
            if self.block is not None:
                raise ConfigError("speculative.block is DFlash's block size; method 'mtp' takes num_tokens")
            if self.num_tokens is None:
                self.num_tokens = 3
            if not 1 <= self.num_tokens <= 8:
                raise _range_error("speculative.num_tokens", self.num_tokens, "1..8")
        else:
            if self.draft is None:
                raise ConfigError(f"speculative.method={self.method!r} needs draft= the DFlash draft model's directory")
            if self.block is not None:
                if not 2 <= self.block <= 64:
                    raise _range_error("speculative.block", self.block, "2..64")
                if self.num_tokens is not None and self.num_tokens != self.block - 1:
                    raise ConfigError(f"speculative: block={self.block} and num_tokens={self.num_tokens} disagree "
                                      "(block = num_tokens + 1; give one of them)")
                self.num_tokens = self.block - 1
            if self.num_tokens is not None and not 1 <= self.num_tokens <= 63:
                raise _range_error("speculative.num_tokens", self.num_tokens, "1..63")
        if self.draft_pages is not None and self.draft_pages < 0:
            raise _range_error("speculative.draft_pages", self.draft_pages, ">= 0 (None = mirror Main)")

    @property
    def dflash(self) -> bool:
        return self.method in ("dflash", "dflash2")


AUTO_CHUNKS = (256, 512, 1024, 2048)      # prefill_chunk_tokens="auto" chooses among these
AUTO_CHUNK_STEP_S = 0.2                    # ... the largest whose forward takes at most this long


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    max_concurrency: int = 4
    max_context: int | None = None
    kv_capacity: int | None = None
    context_cache: ContextCacheConfig = msgspec.field(default_factory=ContextCacheConfig)
    dtype: str = "float32"
    device: str = "auto"
    # Memory budget for kv_capacity=None: explicit bytes, else this fraction of free GPU memory
    # (on the CPU: 1 GiB unless given).
    memory_budget_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Scheduling knobs (vLLM/SGLang users expect them).
    # "auto": sized at startup from the measured forward (native/calibration.py ``auto_chunk``):
    # the largest of AUTO_CHUNKS whose chunk the forward computes within AUTO_CHUNK_STEP_S
    prefill_chunk_tokens: int | str = 256
    request_timeout_s: float | None = None
    copy_engine: str = "auto"
    completion_timeout_s: float = 2.0
    # Over Ray: a step the GPU worker has not answered within this many seconds makes the
    # controller treat the worker as lost (a hung process: killed and replaced, as a dead one
    # is). None waits for ever. vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S plays this part there.
    step_timeout_s: float | None = 600.0
    cost_calibration: bool = True       # measure copy and prefill rates at startup
    enforce_eager: bool = False         # no CUDA graphs (vLLM's name): every call runs eagerly
    # torch intra-op threads of the process that runs the forward, on the CPU. 1 is the safe
    # default on a shared machine (DESIGN §8: two threads collapse when the other core is busy);
    # a machine given to the engine may use its cores (vLLM-cpu's OMP threads do)
    cpu_threads: int = 1
    media_budget_bytes: int = 512 * 2 ** 20   # the frontend's prepared images (MediaCache); one
    #                                           image's pixel_values above it is a 400
    faults: list[Fault] = []
    log_format: str | None = None
    log_stats_interval_s: float = 10.0
    speculative: SpeculativeConfig | None = None

    @property
    def chunk_budget(self) -> int:
        """The longest chunk the layout is sized for: the configured one, or the largest "auto"
        may choose."""
        return AUTO_CHUNKS[-1] if self.prefill_chunk_tokens == "auto" else self.prefill_chunk_tokens

    def __post_init__(self) -> None:
        if isinstance(self.context_cache, dict):     # EngineConfig(context_cache={...})
            self.context_cache = msgspec.convert(self.context_cache, ContextCacheConfig)
        if isinstance(self.speculative, dict):       # EngineConfig(speculative={...})
            try:
                self.speculative = msgspec.convert(self.speculative, SpeculativeConfig)
            except msgspec.ValidationError as exc:
                raise ConfigError(f"speculative: {exc}") from None
        if not 1 <= self.max_concurrency <= 8:
            raise _range_error("max_concurrency", self.max_concurrency, "1..8")
        if self.max_context is not None and self.max_context < 1:
            raise _range_error("max_context", self.max_context, ">= 1 (None = the model's limit)")
        if self.kv_capacity is not None and self.kv_capacity < 1:
            raise _range_error("kv_capacity", self.kv_capacity, ">= 1 token (None = solve from the memory budget)")
        if self.dtype not in DTYPES:
            raise _range_error("dtype", self.dtype, " | ".join(DTYPES))
        if self.device not in DEVICES:
            raise _range_error("device", self.device, " | ".join(DEVICES))
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise _range_error("memory_budget_bytes", self.memory_budget_bytes, ">= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise _range_error("gpu_memory_utilization", self.gpu_memory_utilization, "(0, 1]")
        if self.media_budget_bytes < 1:
            raise _range_error("media_budget_bytes", self.media_budget_bytes, ">= 1")
        if self.cpu_threads < 1:
            raise _range_error("cpu_threads", self.cpu_threads, ">= 1")
        if self.prefill_chunk_tokens != "auto" and not (
                isinstance(self.prefill_chunk_tokens, int) and self.prefill_chunk_tokens >= 1):
            raise _range_error("prefill_chunk_tokens", self.prefill_chunk_tokens, '>= 1, or "auto"')
        if not self.completion_timeout_s > 0:
            raise _range_error("completion_timeout_s", self.completion_timeout_s, "> 0 seconds")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise _range_error("step_timeout_s", self.step_timeout_s, "> 0 seconds or null")
        if self.copy_engine not in COPY_ENGINES:
            raise _range_error("copy_engine", self.copy_engine, " | ".join(COPY_ENGINES))
        try:
            self.faults = [msgspec.convert(f, Fault) if isinstance(f, dict) else f for f in self.faults]
        except msgspec.ValidationError as exc:
            raise ConfigError(str(exc)) from None
        if self.log_format is not None and self.log_format not in LOG_FORMATS:
            raise _range_error("log_format", self.log_format, " | ".join(LOG_FORMATS))
        if not self.log_stats_interval_s >= 0:
            raise _range_error("log_stats_interval_s", self.log_stats_interval_s, ">= 0 seconds (0 = never)")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise _range_error("request_timeout_s", self.request_timeout_s, "> 0 seconds (None = no timeout)")

    # ---- derived values ----------------------------------------------------------------
    @property
    def spec_tokens(self) -> int:
        """Drafts per step (0 = no speculative decoding; None = DFlash's default, from its draft)."""
        return self.speculative.num_tokens if self.speculative is not None else 0

    @property
    def device_state_slots(self) -> int:
        """Extra Device StateImage slots beyond the C basic ones (default C)."""
        extra = self.context_cache.device_state_slots
        return self.max_concurrency if extra is None else extra

    def kv_pages(self) -> int | None:
        """Explicit kv_capacity rounded up to 64-token pages (None when it is to be solved)."""
        return None if self.kv_capacity is None else math.ceil(self.kv_capacity / PAGE_SIZE)

    def host_capacity(self, host_state_image_bytes: int) -> int:
        """Host backing bytes: explicit, else 8 GiB + 8 × the model's Host StateImage size."""
        explicit = self.context_cache.host_capacity_bytes
        return explicit if explicit is not None else 8 * GIB + 8 * host_state_image_bytes

    def resolve_max_context(self, model_max_positions: int) -> int:
        if self.max_context is None:
            return model_max_positions
        if self.max_context > model_max_positions:
            raise _range_error("max_context", self.max_context,
                               f"1..{model_max_positions} (the model's max_position_embeddings)")
        return self.max_context

    def checked_kv_pages(self, max_context: int) -> int | None:
        """Explicit kv_capacity in pages, checked against the Main-KV curve for this
        max_context (None when it is to be solved from the memory budget)."""
        pages = self.kv_pages()
        if pages is None:
            return None
        lo, hi = kv_page_bounds(max_context, self.max_concurrency)
        if not lo <= pages <= hi:
            raise ConfigError(
                f"kv_capacity={self.kv_capacity} ({pages} pages of {PAGE_SIZE} tokens) is out of range: "
                f"allowed {lo}..{hi} pages = [max(ceil(max_context {max_context} / 64), C {self.max_concurrency}), "
                f"C × ceil(max_context / 64)]")
        return pages

    def fit_to_model(self, model_max_positions: int) -> tuple["EngineConfig", list[str]]:
        """This config made servable on a model with ``model_max_positions`` positions, and one
        warning per value lowered on the way.

        A config file is generic (deploy/engine.toml asks for 32k of context) while models are
        not, so, as a vLLM user expects, values *above* what the model can use are lowered:
        max_context to max_position_embeddings, an explicit kv_capacity to C full contexts
        (capacity is not split per lane, so more can never be used). A value no model could
        serve (kv_capacity below one full context) stays an error naming the field and the
        range. Engine.start calls this before any actor starts.
        """
        notes: list[str] = []
        cfg = self
        if cfg.max_context is not None and cfg.max_context > model_max_positions:
            notes.append(f"max_context={cfg.max_context} is above the model's max_position_embeddings "
                         f"({model_max_positions}): using {model_max_positions}")
            cfg = msgspec.structs.replace(cfg, max_context=model_max_positions)
        max_context = cfg.resolve_max_context(model_max_positions)
        pages = cfg.kv_pages()
        _, hi = kv_page_bounds(max_context, cfg.max_concurrency)
        if pages is not None and pages > hi:
            notes.append(f"kv_capacity={cfg.kv_capacity} is above C × ceil(max_context / 64) = {hi} pages, "
                         f"the most {cfg.max_concurrency} full contexts of {max_context} tokens can hold: "
                         f"using {hi * PAGE_SIZE}")
            cfg = msgspec.structs.replace(cfg, kv_capacity=hi * PAGE_SIZE)
        cfg.checked_kv_pages(max_context)
        return cfg, notes

    # ---- construction ------------------------------------------------------------------
    @staticmethod
    def from_dict(raw: dict) -> "EngineConfig":
        try:
            return msgspec.convert(raw, EngineConfig)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid engine config: {exc}") from None

    @staticmethod
    def from_toml(path: str | Path) -> "EngineConfig":
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML ({exc})") from None
        try:
            return EngineConfig.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None

    @staticmethod
    def coerce(config: "EngineConfig | str | Path | dict | None") -> "EngineConfig":
        """Accept the forms the public API takes: an EngineConfig, a TOML path, a dict or None."""
        if config is None:
            return EngineConfig()
        if isinstance(config, EngineConfig):
            return config
        if isinstance(config, dict):
            return EngineConfig.from_dict(config)
        if isinstance(config, (str, Path)):
            return EngineConfig.from_toml(config)
        raise ConfigError(f"config must be an EngineConfig, a TOML path, a dict or None, not {type(config).__name__}")


def decode_config(data: bytes) -> EngineConfig:
    """An EngineConfig from its msgpack bytes (what travels to the Ray actors)."""
    return msgspec.msgpack.decode(data, type=EngineConfig)


def kv_page_bounds(max_context: int, max_concurrency: int) -> tuple[int, int]:
    """The Main-KV capacity curve in pages: [max(⌈max_context/64⌉, C), C·⌈max_context/64⌉].

    The lower bound lets one request own the whole context alone and gives C lanes a page
    each; the upper bound is C full contexts (capacity is not split per lane).
    """
    per_request = math.ceil(max_context / PAGE_SIZE)
    return max(per_request, max_concurrency), max_concurrency * per_request
