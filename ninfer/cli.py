"""The ``ninfer`` command line.

    ninfer make-tiny-model DIR [--seed N] [--arch qwen3_next|qwen3]
    ninfer demo [--model DIR]
    ninfer serve --model DIR [--config FILE] [--host 127.0.0.1] [--port 8000] [--address auto]
    ninfer bench controller|agent|actors|cache-scale|decode [--model DIR] [--out FILE]
    ninfer bench serve [--base-url URL] [--clients 64] [--rounds 4] [--out FILE] [--plot FILE]
    ninfer report FILE [--stall-s S]    the seed's evaluation order over a JSON log or bench JSON
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

from ninfer.errors import NInferError


def _make_tiny_model(args: argparse.Namespace) -> int:
    from ninfer.tiny.build import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed, arch=args.arch)
    print(f"wrote tiny {args.arch} model (seed {args.seed}) to {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ninfer.demo import run_demo

    return run_demo(args.model, dtype=args.dtype, transport=args.transport)


def _serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from ninfer.api import Engine, connect
    from ninfer.frontend.server import serve

    if args.connect:
        engine = connect(address=args.address or "auto", deployment=args.deployment, model_dir=args.model)
    else:                                      # with --address: attaches to the same deployment if it runs
        engine = Engine.start(args.model, config=args.config, transport=args.transport, address=args.address,
                              deployment=args.deployment, detached=bool(args.address))
    name = args.served_model_name or Path(args.model).name
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (transport={engine.transport})", flush=True)
    try:
        serve(engine, name, host=args.host, port=args.port, api_key=args.api_key or os.environ.get("NINFER_API_KEY"),
              max_body_bytes=args.max_body_bytes, max_messages=args.max_messages)
    finally:
        # A deployment started without --address goes with the server; from a detached or an
        # attached one only this client leaves.
        engine.shutdown()
    return 0


BENCHES = {
    "controller": "controller CPU per steady decode cycle, round trips and message sizes",
    "agent": "the 8-session agent trace on both transports (computed prompt tokens vs the floor, TTFT, outputs "
             "checked) and multi-turn agent prefill vs the floor at two capacities",
    "actors": "Ray vs in-process overhead and decode tok/s at C=1..8",
    "cache-scale": "controller cost against the number of cached records (100, 1k, 10k)",
    "decode": "model-forward decode tok/s at C=1..8: the batched path vs the per-sequence reference",
}
SERVE_HELP = ("HTTP load generator for any OpenAI-compatible server: concurrent multi-turn streaming chat users; "
              "TTFT, end-to-end, tokens/s and cached tokens per round; exits 1 if any request failed")


def _bench(args: argparse.Namespace) -> int:
    from importlib import import_module

    import_module(f"ninfer.benchmarks.{args.name.replace('-', '_')}").run(args.model, out=args.out)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    import os

    try:
        import httpx  # noqa: F401
    except ImportError:
        raise NInferError("ninfer bench serve needs httpx: pip install 'ninfer[bench]'") from None
    from ninfer.benchmarks import serve

    result = serve.run(args.base_url, args.model, args.api_key or os.environ.get("OPENAI_API_KEY"), args.clients,
                       args.rounds, args.max_tokens, args.prompt_words, args.temperature, args.ignore_eos,
                       args.timeout, model_dir=args.model_dir, out=args.out, plot=args.plot)
    return 1 if result["errors"] else 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return int(text)


def _report(args: argparse.Namespace) -> int:
    from ninfer.report import render

    if not Path(args.file).is_file():
        raise NInferError(f"no such file: {args.file}")
    print(render(args.file, stall_s=args.stall_s))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description=__doc__.split("\n")[0])
    parser.add_argument("--log-format", choices=["text", "json"], default=None,
                        help="install the engine's log handler: readable lines or one JSON object each "
                             "(default: NINFER_LOG_FORMAT; unset: warnings only)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="generate a tiny HF-layout model directory (no hub needed)")
    p.add_argument("dir", help="output directory (created or overwritten)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--arch", choices=["qwen3_next", "qwen3"], default="qwen3_next",
                   help="hybrid Qwen3-Next (default) or pure-attention Qwen3")
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("demo", help="the main job: a short multi-turn agent conversation on the tiny model")
    p.add_argument("--model", default="models/tiny", help="model directory; built if missing (default models/tiny)")
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16"], default="float32")
    p.add_argument("--transport", choices=["ray", "inproc"], default="ray",
                   help="ray: the three actors on a local Ray (default); inproc: one process")
    p.set_defaults(func=_demo)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat completions, responses, metrics)")
    p.add_argument("--model", required=True, help="model directory (Hugging Face layout)")
    p.add_argument("--config", default=None, help="engine config TOML (see deploy/engine.toml)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None,
                   help="Ray cluster address (e.g. auto after `ray start --head`): the deployment stays up after "
                        "the server exits, and a later serve with the same model and config attaches to it; "
                        "without it a deployment is started (on the cluster this machine runs, else on a "
                        "private Ray) and stopped on exit")
    p.add_argument("--transport", choices=["ray", "inproc"], default="ray")
    p.add_argument("--deployment", default="ninfer", help="deployment name on the Ray cluster")
    p.add_argument("--connect", action="store_true", help="attach to a deployment that is already running")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or set NINFER_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20,
                   help="request body limit, checked while the body streams in (default 16 MiB)")
    p.add_argument("--max-messages", type=int, default=4096,
                   help="messages per chat request, checked before any rendering (default 4096)")
    p.add_argument("--served-model-name", default=None)
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="benchmarks: print a table and JSON (see bench/README.md)")
    benches = p.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, text in BENCHES.items():
        b = benches.add_parser(name, help=text, description=text)
        b.add_argument("--model", default="models/tiny", help="model directory; built if missing")
        b.add_argument("--out", default=None, help="also write the JSON result to this file")
        b.set_defaults(func=_bench)
    b = benches.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP)
    b.add_argument("--base-url", default=None,
                   help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1; without it `ninfer serve "
                        "--transport inproc` is started on the tiny model (--model-dir) on a free port and stopped")
    b.add_argument("--model", default=None, help="model name to request (default: the first id of GET /models)")
    b.add_argument("--model-dir", default="models/tiny", help="model of the built-in server; built if missing")
    b.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` (or set OPENAI_API_KEY)")
    b.add_argument("--clients", type=_positive, default=64, help="concurrent chat users (default 64)")
    b.add_argument("--rounds", type=_positive, default=4, help="turns per user, one after another (default 4)")
    b.add_argument("--max-tokens", type=_positive, default=32, help="max_tokens of every request (default 32)")
    b.add_argument("--prompt-words", type=_positive, default=None,
                   help="user turns of N random words (no system prompt) instead of the built-in chat mix")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (ours, vLLM, SGLang): every reply "
                                                             "runs to --max-tokens")
    b.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a read may wait (a stalled stream counts as an error; default 120)")
    b.add_argument("--out", default=None, help="also write the JSON result (with every request's record) here")
    b.add_argument("--plot", default=None, help="write the TTFT CDF per round to this SVG file")
    b.set_defaults(func=_bench_serve)

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


def _log_to_stderr() -> None:
    """NInfer's own log lines (config values lowered, a deployment attached or replaced) go to
    stderr in the CLI's style; Ray's loggers are left alone."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter())
    logger = logging.getLogger("ninfer")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        if args.log_format or os.environ.get("NINFER_LOG_FORMAT"):   # asked for: else logging stays quiet
            from ninfer.logs import configure
            configure(args.log_format)
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
