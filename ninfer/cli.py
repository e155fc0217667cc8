"""The ``ninfer`` command line.

    ninfer make-tiny-model DIR [--seed N] [--arch qwen3_next|qwen3]
    ninfer demo [--model DIR]
    ninfer bench controller|agent [--model DIR] [--out FILE]

Errors a user can cause (bad directory, bad config) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from ninfer.errors import NInferError


def _make_tiny_model(args: argparse.Namespace) -> int:
    from ninfer.tiny.build import make_tiny_model

    out = make_tiny_model(args.dir, seed=args.seed, arch=args.arch)
    print(f"wrote tiny {args.arch} model (seed {args.seed}) to {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ninfer.demo import run_demo

    return run_demo(args.model, dtype=args.dtype, transport=args.transport)


def _bench(args: argparse.Namespace) -> int:
    from importlib import import_module

    import_module(f"ninfer.benchmarks.{args.name}").run(args.model, out=args.out)
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

    p = sub.add_parser("bench", help="benchmarks: print a table and JSON (see bench/README.md)")
    p.add_argument("name", choices=["controller", "agent"], help="controller: cost per steady decode cycle; "
                   "agent: multi-turn agent prefill vs the infinite-cache floor at two capacities")
    p.add_argument("--model", default="models/tiny", help="model directory; built if missing")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=_bench)
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
