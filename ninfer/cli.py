"""The ``ninfer`` command line.

    ninfer make-tiny-model DIR [--seed N] [--arch qwen3_next|qwen3|qwen3_5_vision] [--no-fit-mtp]
    ninfer make-tiny-dflash TARGET DIR [--kind dflash|dflash2] [--seed N] [--window W] [--no-fit]
    ninfer demo [--model DIR]
    ninfer serve MODEL [--config FILE] [--host 127.0.0.1] [--port 8000] [--address auto] [--replicas N
                 [--routing exact|session|round-robin]] [vLLM's flags]
    ninfer bench controller|agent|actors|cache-scale|serve|trace [options] [--out FILE.json] [--plot FILE.png]
    ninfer bench NAME --help             (each bench's options: ninfer/benchmarks/options.py)
    ninfer report FILE [--stall-s S]    the seed's evaluation order over a JSON log or bench JSON
    ninfer plan MODEL_DIR_OR_CONFIG --gpu-memory GIB --host-memory GIB [--speculative mtp:K] ...
    ninfer --log-format text|json ...   the engine's log lines (also NINFER_LOG_FORMAT)

Errors a user can cause (bad directory, bad config, a deployment that cannot start) print one
line and exit with status 2; NInfer's warnings and notices print as ``ninfer: warning: ...``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ninfer.benchmarks.options import add_parsers
from ninfer.errors import NInferError
from ninfer.frontend.serve_flags import add_vllm_flags, port, unknown_flags


def _make_tiny_model(args: argparse.Namespace) -> int:
    from ninfer.tiny.build import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed, arch=args.arch, fit_mtp=args.fit_mtp)
    print(f"wrote tiny {args.arch} model (seed {args.seed}) to {out}")
    return 0


def _make_tiny_dflash(args: argparse.Namespace) -> int:
    from ninfer.tiny.dflash import make_tiny_dflash

    out = make_tiny_dflash(args.target, args.dir, kind=args.kind, seed=args.seed, window=args.window, fit=args.fit)
    print(f"wrote tiny {args.kind} draft for {args.target} (seed {args.seed}) to {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ninfer.demo import run_demo

    return run_demo(args.model, dtype=args.dtype, transport=args.transport)


def _serve(args: argparse.Namespace) -> int:
    from ninfer.api import Engine, connect
    from ninfer.frontend.serve_flags import (bind, cpu_budget_note, describe, engine_config, http_limits,
                                             refuse_engine_flags)
    from ninfer.frontend.server import serve

    if args.model and args.model_path and args.model != args.model_path:
        raise NInferError(f"serve: two models given ({args.model_path} and --model {args.model}): give one")
    model = args.model or args.model_path
    if model is None and not args.connect:
        raise NInferError("serve: give the model directory: ninfer serve MODEL (or --model MODEL)")
    if args.connect:
        refuse_engine_flags(args)                              # the deployment keeps its own config
    config = None if args.connect else engine_config(args)    # flag errors before anything loads
    if config is not None:
        cpu_budget_note(args, config, args.transport)
    limits = http_limits(args)
    sock = bind(args.host, args.port)                          # a port in use before the model loads
    try:
        if args.connect:
            engine = connect(address=args.address or "auto", deployment=args.deployment, model_dir=model)
        else:                                  # with --address: attaches to the same deployment if it runs
            engine = Engine.start(model, config=config, transport=args.transport, address=args.address,
                                  deployment=args.deployment, detached=bool(args.address),
                                  replicas=args.replicas, router=_router(args))
        try:
            names = args.served_model_name or [Path(model or engine.model_dir).name]
            print(describe(engine), flush=True)
            print(f"serving {names[0]} on http://{args.host}:{args.port}/v1 (transport={engine.transport})",
                  flush=True)
            serve(engine, names[0], sock=sock, aliases=names[1:], limits=limits,
                  api_key=args.api_key or os.environ.get("NINFER_API_KEY"),
                  max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
                  generation_config=args.generation_config, reasoning_parser=args.reasoning_parser)
        finally:
            # A deployment started without --address goes with the server; from a detached or an
            # attached one only this client leaves.
            engine.shutdown()
    finally:
        sock.close()
    return 0


def _router(args: argparse.Namespace) -> dict | None:
    """``--routing`` / ``--router-queue-tokens`` as the router config (None: the defaults)."""
    if args.routing is None and args.router_queue_tokens is None:
        return None
    out = {"routing": args.routing or "exact"}
    if args.router_queue_tokens is not None:
        out["queue_tokens"] = args.router_queue_tokens
    return out


def _report(args: argparse.Namespace) -> int:
    from ninfer.report import render

    if not Path(args.file).is_file():
        raise NInferError(f"no such file: {args.file}")
    print(render(args.file, stall_s=args.stall_s))
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from ninfer.config import EngineConfig
    from ninfer.native.plan import GIB, make_plan, render

    fields = {"max_concurrency": args.lanes, "dtype": args.dtype, "prefill_chunk_tokens": args.chunk,
              "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager}
    if args.max_context is not None:
        fields["max_context"] = args.max_context
    if args.host_arena is not None:
        fields["context_cache"] = {"host_capacity_bytes": int(args.host_arena * GIB)}
    if args.speculative:
        method, _, rest = args.speculative.partition(":")
        if method == "mtp":
            fields["speculative"] = {"method": "mtp", "num_tokens": int(rest or 3)}
        else:
            draft, _, k = rest.partition(":")
            fields["speculative"] = {"method": method, "draft": draft, **({"num_tokens": int(k)} if k else {})}
    plan = make_plan(args.model, args.gpu_memory, args.host_memory, EngineConfig(**fields),
                     reserve_bytes=int(args.reserve * GIB))
    print(json.dumps(plan.as_dict(), indent=2, default=str) if args.json else render(plan))
    return 0 if plan.fits else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description=__doc__.split("\n")[0])
    parser.add_argument("--log-format", choices=["text", "json"], default=None,
                        help="install the engine's log handler: readable lines or one JSON object each "
                             "(default: NINFER_LOG_FORMAT; unset: warnings only)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="generate a tiny HF-layout model directory (no hub needed)")
    p.add_argument("dir", help="output directory (created or overwritten)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--arch", choices=["qwen3_next", "qwen3", "qwen3_5_vision"], default="qwen3_next",
                   help="hybrid Qwen3-Next (default), pure-attention Qwen3, or Qwen3.5 with a vision tower")
    p.add_argument("--no-fit-mtp", dest="fit_mtp", action="store_false",
                   help="keep qwen3_next's MTP head random (default: fit it to the target, ~5 s)")
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("make-tiny-dflash", help="generate a DFlash / DFlash2 draft directory for a tiny target")
    p.add_argument("target", help="the tiny target model's directory (make-tiny-model)")
    p.add_argument("dir", help="output directory (created or overwritten)")
    p.add_argument("--kind", choices=["dflash", "dflash2"], default="dflash")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--window", type=int, default=2048, help="DFlash2's sliding window (default 2048)")
    p.add_argument("--no-fit", dest="fit", action="store_false",
                   help="keep the draft random (default: fit it to the target's own continuations)")
    p.set_defaults(func=_make_tiny_dflash)

    p = sub.add_parser("demo", help="the main job: a short multi-turn agent conversation on the tiny model")
    p.add_argument("--model", default="models/tiny", help="model directory; built if missing (default models/tiny)")
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16"], default="float32")
    p.add_argument("--transport", choices=["ray", "inproc"], default="ray",
                   help="ray: the three actors on a local Ray (default); inproc: one process")
    p.set_defaults(func=_demo)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat completions, responses, metrics)",
                       description="Serve MODEL over OpenAI's HTTP API. vLLM's common flags are taken as vLLM "
                                   "spells them; a vLLM flag NInfer has no use for is refused in one line "
                                   "saying why.")
    p.add_argument("model_path", nargs="?", metavar="MODEL", help="model directory (Hugging Face layout)")
    p.add_argument("--model", default=None, help="the model directory, as a flag (vLLM accepts both)")
    p.add_argument("--config", default=None, help="engine config TOML (see deploy/engine.toml)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000,
                   help="1..65535 (default 8000); bound before the model loads, so a port in use is one line")
    p.add_argument("--address", default=None,
                   help="Ray cluster address (e.g. auto after `ray start --head`): the deployment stays up after "
                        "the server exits, and a later serve with the same model and config attaches to it; "
                        "without it a deployment is started (on the cluster this machine runs, else on a "
                        "private Ray) and stopped on exit. An address where no cluster answers is one line")
    p.add_argument("--transport", choices=["ray", "inproc"], default="ray")
    p.add_argument("--deployment", default="ninfer", help="deployment name on the Ray cluster")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="N whole engines (controller + GPU worker each, one GPU each on a GPU cluster) behind one "
                        "endpoint (default 1; needs --transport ray)")
    p.add_argument("--routing", choices=["exact", "session", "round-robin"], default=None,
                   help="how requests reach the replicas: exact = the deepest exact restore position, net of load "
                        "(default); session = a session stays on its replica; round-robin")
    p.add_argument("--router-queue-tokens", type=int, default=None, metavar="N",
                   help="prompt tokens one place in a replica's queue is worth to exact routing (default 1024)")
    p.add_argument("--connect", action="store_true", help="attach to a deployment that is already running")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 and /tokenize (or set NINFER_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20,
                   help="request body limit, checked while the body streams in (default 16 MiB)")
    p.add_argument("--max-messages", type=int, default=4096,
                   help="messages per chat request, checked before any rendering (default 4096)")
    p.add_argument("--read-timeout-s", type=float, default=30.0, metavar="S",
                   help="a request's headers, then its body, must arrive within S seconds each (else 408, "
                        "connection closed); a connection silent that long is closed (default 30)")
    p.add_argument("--max-connections-per-client", type=int, default=256, metavar="N",
                   help="open connections one client address may hold; more are answered 429 (default 256)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in requests and /v1/models (default: the directory's name); "
                        "more names are accepted as aliases")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "mtp", "num_tokens": 3}\' (over the config file\'s)')
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for what a request leaves unset (vLLM's flag): auto = the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens), vllm = vLLM's own, DIR = that directory's file (default auto)")
    p.add_argument("--reasoning-parser", default="auto", metavar="auto|none|qwen3",
                   help="split the model's thinking into reasoning_content (vLLM's flag): qwen3 = <think> ... "
                        "</think>; auto = qwen3 when the chat template knows <think> (default auto)")
    add_vllm_flags(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="benchmarks: a table, JSON and a PNG plot (see bench/README.md)",
                       description="Benchmarks: a table and JSON on stdout (or --out), a PNG plot, progress on "
                                   "stderr; `ninfer bench NAME --help` lists each one's options.")
    add_parsers(p.add_subparsers(dest="name", required=True, metavar="NAME"))

    p = sub.add_parser("plan", help="the Device / Host layout the engine would solve for a model on a GPU of a "
                                    "given size (from config.json alone: no weights, no GPU); exit 1 if it does "
                                    "not fit", description="Reads config.json (a model directory's or the file), "
                                    "counts the weights the loader would hold (FP8 128x128 blocks where the "
                                    "checkpoint's quantization_config says so), and solves the engine's own layout "
                                    "on what the GPU would have free after them: Main and draft KV, StateImages, "
                                    "workspace, CUDA graphs, the Host arena.")
    p.add_argument("model", metavar="MODEL_DIR_OR_CONFIG", help="a model directory or its config.json")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="the GPU's memory (e.g. 139)")
    p.add_argument("--host-memory", type=float, required=True, metavar="GIB", help="the host's memory (e.g. 128)")
    p.add_argument("--lanes", type=int, default=8, help="max_concurrency C (default 8)")
    p.add_argument("--max-context", type=int, default=None, help="max_context (default: the model's)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill_chunk_tokens (default 2048)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the engine's dtype")
    p.add_argument("--speculative", default=None, metavar="mtp:K|dflash:DIR[:K]|dflash2:DIR[:K]",
                   help="a draft backend (its KV pool, the verify rows' kept states and graphs count)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserve", type=float, default=1.0, metavar="GIB",
                   help="GPU memory the runtime takes before the engine (CUDA context, cuBLAS; default 1)")
    p.add_argument("--host-arena", type=float, default=None, metavar="GIB",
                   help="context_cache.host_capacity_bytes (default 8 GiB + 8 StateImages)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.set_defaults(func=_plan)

    p = sub.add_parser("report", help="verdicts in the seed's evaluation order, then a table, from a JSON log "
                                      "(NINFER_LOG_FORMAT=json) or a bench JSON")
    p.add_argument("file", help="a JSON-lines log or a bench JSON (--out of ninfer bench)")
    p.add_argument("--stall-s", type=float, default=1.0, help="an output gap this long is a stall (default 1 s)")
    p.set_defaults(func=_report)
    return parser


class _OneLineFormatter(logging.Formatter):
    """``ninfer: warning: message`` (``ninfer: message`` for notices): the CLI's error style."""

    def format(self, record: logging.LogRecord) -> str:
        kind = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        text = f"ninfer: {kind}{record.getMessage()}"
        return f"{text}\n{self.formatException(record.exc_info)}" if record.exc_info else text


QUIET_UNLESS_ASKED = ("ninfer.requests", "ninfer.stats")   # a line per request / per period


def _log_to_stderr() -> None:
    """NInfer's own log lines (config values lowered, a deployment attached or replaced) go to
    stderr in the CLI's style; Ray's loggers are left alone. The per-request and periodic
    engine lines only when asked for (--log-format / NINFER_LOG_FORMAT): a server's stderr
    must not fill with them by default."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter())
    logger = logging.getLogger("ninfer")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for name in QUIET_UNLESS_ASKED:
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _log_to_stderr()
    try:
        if extra:                      # serve: one line, and why for a vLLM flag NInfer does not take
            raise unknown_flags(extra)
        if args.log_format or os.environ.get("NINFER_LOG_FORMAT"):   # asked for: else logging stays quiet
            from ninfer.logs import configure
            configure(args.log_format)
            for name in QUIET_UNLESS_ASKED:
                logging.getLogger(name).setLevel(logging.NOTSET)
            if args.log_format:            # engines started here (and their actors) log so too
                os.environ["NINFER_LOG_FORMAT"] = args.log_format
        return args.func(args)
    except NInferError as exc:
        print(f"ninfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
