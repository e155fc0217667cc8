"""``ninfer serve``'s command line as a vLLM user types it: the model as a positional argument,
vLLM's common engine flags mapped onto ``EngineConfig`` (over the ``--config`` file's values),
one line for a vLLM flag NInfer does not take, and the listening socket bound before the model
loads (a port in use is found in a second, not after minutes of loading).

    vLLM flag                       EngineConfig field
    --max-model-len N               max_context
    --max-num-seqs N                max_concurrency (C lanes, 1..8: the error says why)
    --dtype auto|bfloat16|float32   dtype (auto: the config's; float16 is refused)
    --gpu-memory-utilization F      gpu_memory_utilization
    --kv-cache-memory[-bytes] SIZE  memory_budget_bytes (KV pages + state slots + workspace)
    --max-num-batched-tokens N|auto prefill_chunk_tokens (auto when neither it nor --config is given)
    --enforce-eager                 enforce_eager
    --enable-prefix-caching         accepted: NInfer's context reuse is exact and always on
"""

from __future__ import annotations

import argparse
import logging
import re
import socket

import msgspec

from ninfer.config import EngineConfig
from ninfer.errors import ConfigError, NInferError
from ninfer.frontend.http_guard import Limits

log = logging.getLogger("ninfer.serve")

LANES = ("NInfer's max_concurrency is its C execution lanes, 1..8 (each lane binds one request's recurrent "
         "state and KV; requests beyond C wait in the queue and are admitted as lanes free, so any number "
         "of clients may connect)")
DTYPES = {"auto": None, "bfloat16": "bfloat16", "float32": "float32", "float": "float32", "float64": "float64"}
ONE_GPU = "NInfer serves one model on one GPU"
REPLICAS = "use --replicas N: N whole engines, one GPU each, behind one endpoint and a router"
NOT_TAKEN = {   # vLLM flags a user brings: why NInfer has no such flag
    "--tensor-parallel-size": ONE_GPU, "-tp": ONE_GPU, "--pipeline-parallel-size": ONE_GPU, "-pp": ONE_GPU,
    "--data-parallel-size": REPLICAS, "-dp": REPLICAS, "--distributed-executor-backend": ONE_GPU,
    "--quantization": "the checkpoint's weights are loaded as they are (--dtype chooses bfloat16 or float32)",
    "-q": "the checkpoint's weights are loaded as they are (--dtype chooses bfloat16 or float32)",
    "--kv-cache-dtype": "the KV cache has the model's dtype (--dtype)",
    "--block-size": "KV pages are 64 tokens",
    "--swap-space": "the Host tier is context_cache.host_capacity_bytes in the --config file",
    "--cpu-offload-gb": "the Host tier is context_cache.host_capacity_bytes in the --config file",
    "--enable-lora": "there are no LoRA adapters", "--lora-modules": "there are no LoRA adapters",
    "--max-loras": "there are no LoRA adapters",
    "--tokenizer": "the model directory's tokenizer is used",
    "--chat-template": "the model directory's chat template is used",
    "--trust-remote-code": "NInfer never runs a model directory's code (remove the flag)",
    "--revision": "the model is a local directory (no hub)", "--download-dir": "the model is a local directory (no hub)",
    "--load-format": "the model is loaded from its safetensors",
    "--seed": "seeds are per request (the request's seed field)",
    "--enable-auto-tool-choice": "tool calls are always parsed (Qwen/Hermes <tool_call> blocks)",
    "--tool-call-parser": "tool calls are always parsed (Qwen/Hermes <tool_call> blocks)",
    "--disable-log-requests": "per-request lines are off unless --log-format asks for them",
    "--disable-log-stats": "the periodic summary is off unless --log-format asks for it",
    "--uvicorn-log-level": "the server logs warnings only (--log-format for the engine's lines)",
    "--max-seq-len-to-capture": "CUDA graphs cover every decode size (--enforce-eager turns them off)",
    "--preemption-mode": "pauses choose Snapshot or Replay by themselves (outputs never change)",
    "--scheduling-policy": "scheduling is first come, first served with exact pause and resume",
}


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's common engine flags on the ``serve`` parser (see the module docstring)."""
    g = p.add_argument_group("vLLM's flags", "mapped onto the engine config; they override the --config file")
    g.add_argument("--max-model-len", type=_human_int, default=None, metavar="N",
                   help="max_context: the longest request in tokens (e.g. 32768 or 32k)")
    g.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="max_concurrency: C execution lanes, 1..8 (requests beyond C queue)")
    g.add_argument("--dtype", default=None, metavar="DTYPE",
                   help="auto (the config's, float32 by default) | bfloat16 | float32 | float64")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="fraction of the free GPU memory the caches may take (default 0.9)")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", type=_human_int,
                   default=None, metavar="SIZE",
                   help="memory_budget_bytes: bytes for KV pages, state slots and workspace (e.g. 8G), "
                        "instead of --gpu-memory-utilization")
    g.add_argument("--max-num-batched-tokens", type=_chunk_arg, default=None, metavar="N|auto",
                   help="prefill_chunk_tokens: the prompt tokens one step computes (default without --config: "
                        "auto, sized at startup from the measured forward)")
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="accepted: context reuse is exact and always on (--no-enable-prefix-caching is ignored "
                        "with a warning)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``--config`` file's EngineConfig with the vLLM flags (and ``--speculative-config``)
    over it; a value out of range is one ConfigError naming the flag."""
    cfg = EngineConfig.coerce(args.config)
    over: dict = {}
    if args.max_num_seqs is not None:
        if not 1 <= args.max_num_seqs <= 8:
            raise ConfigError(f"--max-num-seqs={args.max_num_seqs} is out of range: allowed 1..8. {LANES}")
        over["max_concurrency"] = args.max_num_seqs
    if args.max_model_len is not None:
        if args.max_model_len < 1:
            raise ConfigError(f"--max-model-len={args.max_model_len} is out of range: allowed >= 1")
        over["max_context"] = args.max_model_len
    if args.dtype is not None:
        if args.dtype in ("half", "float16"):
            raise ConfigError(f"--dtype={args.dtype} is not supported: use bfloat16 (or float32)")
        if args.dtype not in DTYPES:
            raise ConfigError(f"--dtype={args.dtype!r} is out of range: allowed {' | '.join(DTYPES)}")
        if DTYPES[args.dtype] is not None:
            over["dtype"] = DTYPES[args.dtype]
    if args.gpu_memory_utilization is not None:
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization={args.gpu_memory_utilization} is out of range: "
                              "allowed (0, 1]")
        over["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.kv_cache_memory is not None:
        if args.kv_cache_memory < 1:
            raise ConfigError(f"--kv-cache-memory={args.kv_cache_memory} is out of range: allowed >= 1 byte")
        over["memory_budget_bytes"] = args.kv_cache_memory
    if args.max_num_batched_tokens is None and args.config is None:
        over["prefill_chunk_tokens"] = "auto"      # the server sized to the machine (a config file keeps its own)
    elif args.max_num_batched_tokens == "auto":
        over["prefill_chunk_tokens"] = "auto"
    elif args.max_num_batched_tokens is not None:
        if args.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens={args.max_num_batched_tokens} is out of range: "
                              "allowed >= 1")
        over["prefill_chunk_tokens"] = args.max_num_batched_tokens
    if args.enforce_eager:
        over["enforce_eager"] = True
    if args.enable_prefix_caching is False:
        log.warning("--no-enable-prefix-caching is ignored: NInfer's context reuse never changes an output "
                    "token and is always on")
    if args.speculative_config is not None:          # JSON over the config file's [speculative]
        over["speculative"] = _json_arg(args.speculative_config, "--speculative-config")
    if over:
        cfg = EngineConfig.from_dict({**msgspec.to_builtins(cfg), **over})
    if args.gpu_memory_utilization is not None and cfg.memory_budget_bytes is not None:
        log.warning("--gpu-memory-utilization=%s is not used: the KV budget is --kv-cache-memory (%d bytes), as in "
                    "vLLM", args.gpu_memory_utilization, cfg.memory_budget_bytes)
    return cfg


# the flags that shape the engine a server starts (their attribute, their spelling)
ENGINE_FLAGS = (("config", "--config"), ("max_model_len", "--max-model-len"), ("max_num_seqs", "--max-num-seqs"),
                ("dtype", "--dtype"), ("gpu_memory_utilization", "--gpu-memory-utilization"),
                ("kv_cache_memory", "--kv-cache-memory"), ("max_num_batched_tokens", "--max-num-batched-tokens"),
                ("enforce_eager", "--enforce-eager"), ("speculative_config", "--speculative-config"),
                ("routing", "--routing"), ("router_queue_tokens", "--router-queue-tokens"))


def refuse_engine_flags(args: argparse.Namespace) -> None:
    """``--connect`` attaches to a deployment that runs with its own engine config: a flag
    that would shape the engine cannot apply there, and is refused rather than ignored."""
    given = [flag for attr, flag in ENGINE_FLAGS if getattr(args, attr, None) is not None]
    if getattr(args, "replicas", 1) != 1:
        given.append("--replicas")
    if given:
        raise ConfigError(f"serve --connect attaches to a running deployment, which keeps the engine config it was "
                          f"started with: {', '.join(given)} cannot apply (drop {'it' if len(given) == 1 else 'them'}, "
                          "or start a new deployment without --connect)")


def cpu_budget_note(args: argparse.Namespace, cfg: EngineConfig, transport: str) -> None:
    """``--gpu-memory-utilization`` sizes the caches from a GPU's free memory; an engine in this
    process that runs on the CPU takes ``--kv-cache-memory`` (1 GiB unless given) instead —
    said once rather than ignored. (Over Ray the worker's node decides; it is not known here.)"""
    if args.gpu_memory_utilization is None or cfg.memory_budget_bytes is not None or transport != "inproc":
        return
    if cfg.device == "cuda":
        return
    if cfg.device == "auto":
        import torch
        if torch.cuda.is_available():
            return
    log.warning("--gpu-memory-utilization=%s applies to a GPU's memory: this engine runs on the CPU, where the KV "
                "budget is --kv-cache-memory (1 GiB unless given)", args.gpu_memory_utilization)


def describe(engine) -> str:
    """One line for the log at start: what the worker really runs (its ``WorkerInfo``), so the
    flags' effect is visible where they were typed."""
    i = engine.info
    line = (f"engine: dtype {i.dtype}, max_model_len {i.max_context}, max_num_seqs {i.max_concurrency}, "
            f"max_num_batched_tokens {i.prefill_chunk_tokens}, KV cache {i.kv_pages} pages of 64 tokens "
            f"({i.kv_pages * 64} tokens, {i.kv_pages * i.page_bytes} bytes)")
    c = getattr(engine, "config", None)
    if c is not None:
        line += (f", memory budget {c.memory_budget_bytes} bytes" if c.memory_budget_bytes is not None
                 else f", gpu_memory_utilization {c.gpu_memory_utilization}")
    return line


def http_limits(args: argparse.Namespace) -> Limits:
    """The connection guards' values from ``--read-timeout-s`` and
    ``--max-connections-per-client``."""
    if not args.read_timeout_s > 0:
        raise ConfigError(f"--read-timeout-s={args.read_timeout_s} is out of range: allowed > 0 seconds")
    if args.max_connections_per_client < 1:
        raise ConfigError(f"--max-connections-per-client={args.max_connections_per_client} is out of range: "
                          "allowed >= 1")
    return Limits(read_timeout_s=args.read_timeout_s, max_connections_per_client=args.max_connections_per_client)


def unknown_flags(extra: list[str]) -> NInferError:
    """One line for what ``serve`` did not recognise: why, for a vLLM flag NInfer does not
    take; else where the flags are listed."""
    flags = [a.split("=", 1)[0] for a in extra if a.startswith("-")]
    for flag in flags:
        if flag in NOT_TAKEN:
            return NInferError(f"serve: {flag} is a vLLM flag NInfer does not take: {NOT_TAKEN[flag]}")
    what = flags[0] if flags else extra[0]
    return NInferError(f"serve: unrecognized argument {what!r} (`ninfer serve --help` lists the flags, "
                       "vLLM's common ones included)")


def port(text: str) -> int:
    """A TCP port 1..65535 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is out of range: allowed 1..65535")
    return value


def bind(host: str, port_: int) -> socket.socket:
    """The server's socket, bound now (not yet listening: until the model is loaded a client is
    refused, not queued). The server listens on exactly this socket, so the port it prints is
    the port it serves."""
    try:
        infos = socket.getaddrinfo(host, port_, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise NInferError(f"--host {host!r}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as uvicorn does: TIME_WAIT is no conflict
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        why = "the port is in use (another server? choose --port)" if exc.errno in (98, 48) else exc.strerror
        raise NInferError(f"cannot listen on {host}:{port_}: {why}") from None
    sock.set_inheritable(True)
    return sock


def _chunk_arg(text: str) -> int | str:
    """``--max-num-batched-tokens``: a number as ``_human_int`` reads it, or ``auto``."""
    return "auto" if text.strip() == "auto" else _human_int(text)


def _human_int(text: str) -> int:
    """``32768``, or vLLM's human-readable form: a lowercase suffix is decimal (``32k`` = 32,000,
    ``1.5m``), an uppercase one binary (``32K`` = 32,768, ``8G`` = 8 GiB)."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kKmMgGtT]?)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 32768, 32k, 8G)")
    number, unit = m.groups()
    if not unit:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        return int(number)
    base = 1000 if unit.islower() else 1024
    return int(float(number) * base ** ("kmgt".index(unit.lower()) + 1))


def _json_arg(text: str, flag: str):
    import json
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise NInferError(f"{flag}: not JSON ({exc})") from None
