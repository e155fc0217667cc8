"""The ``ninfer`` command line.

    ninfer make-tiny-model DIR [--seed N] [--arch qwen3_next|qwen3]
    ninfer demo [--model DIR]
    ninfer serve --model DIR [--config FILE] [--host 127.0.0.1] [--port 8000] [--address auto]
    ninfer bench controller|agent|actors|cache-scale|serve [options] [--out FILE.json] [--plot FILE.png]
    ninfer bench NAME --help             (each bench's options: ninfer/benchmarks/options.py)

Errors a user can cause (bad directory, bad config) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from ninfer.benchmarks.options import add_parsers
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

    engine = None
    if args.connect or args.address:
        try:                                   # attach to a running deployment of that name
            engine = connect(address=args.address or "auto", deployment=args.deployment, model_dir=args.model)
        except NInferError:
            if args.connect:
                raise
    if engine is None:
        engine = Engine.start(args.model, config=args.config, transport=args.transport, address=args.address,
                              deployment=args.deployment, detached=bool(args.address))
    name = args.served_model_name or Path(args.model).name
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (transport={engine.transport})", flush=True)
    try:
        serve(engine, name, host=args.host, port=args.port, api_key=args.api_key or os.environ.get("NINFER_API_KEY"),
              max_body_bytes=args.max_body_bytes)
    finally:
        if not args.address:
            engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description=__doc__.split("\n")[0])
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
                   help="Ray cluster address (e.g. auto after `ray start --head`); the deployment stays up "
                        "after the server exits; without it a local deployment is started and stopped")
    p.add_argument("--transport", choices=["ray", "inproc"], default="ray")
    p.add_argument("--deployment", default="ninfer", help="deployment name on the Ray cluster")
    p.add_argument("--connect", action="store_true", help="attach to a deployment that is already running")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or set NINFER_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=16 << 20)
    p.add_argument("--served-model-name", default=None)
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="benchmarks: a table, JSON and a PNG plot (see bench/README.md)",
                       description="Benchmarks: a table and JSON on stdout (or --out), a PNG plot, progress on "
                                   "stderr; `ninfer bench NAME --help` lists each one's options.")
    add_parsers(p.add_subparsers(dest="name", required=True, metavar="NAME"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except NInferError as exc:
        print(f"ninfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
