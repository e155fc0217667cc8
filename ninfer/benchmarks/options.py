"""The ``ninfer bench NAME`` sub-commands: one parser per benchmark, its options, and the call
into the bench's ``run``. Imports nothing heavy (``ninfer --help`` must not load torch); every
default is the committed measurement's setting, so a run without options reproduces it.

    ninfer bench controller  [--concurrency 1,2,4,8] [--pressure 2,4,8] [--decode-tokens 64] ...
    ninfer bench agent       [--transport inproc,ray] [--sessions 8] [--turns 6] [--capacity 16:2,64:64] ...
    ninfer bench actors      [--transport inproc,ray] [--concurrency 1,2,4,8] [--max-tokens 48] ...
    ninfer bench cache-scale [--records 100,1000,10000] [--dtype float32]
    ninfer bench serve       [--base-url URL] [--clients 64] [--rounds 4] ...
    ninfer bench speculative [--method mtp|dflash|dflash2] [--drafts 1,2,3] [--concurrency 1,4,8] ...

Every bench: ``--out F.json`` writes the JSON document (else it follows the table on stdout),
``--plot F.png`` the figure (default: next to ``--out``, F.png); progress bars on stderr.
"""

from __future__ import annotations

import argparse

from ninfer.errors import NInferError

DTYPES = ["float32", "bfloat16", "float64"]
TRANSPORTS = ("inproc", "ray")


class _Help(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless it has no default worth showing."""

    def _get_help_string(self, action):
        text = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not hidden and "%(default)" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return int(text)


def _positives(text: str) -> tuple[int, ...]:
    """``1,2,4,8`` -> (1, 2, 4, 8); ``none`` or an empty string -> () (skip that part)."""
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(_positive(t.strip()) for t in text.split(","))


def _transports(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TRANSPORTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"must be inproc, ray or inproc,ray, not {text!r}")
    return names


def _capacities(text: str) -> tuple[tuple[int, int], ...]:
    """``16:2,64:64`` -> ((16, 2), (64, 64)): KV pages : Host MiB pairs; ``none`` -> ()."""
    if text.strip().lower() in ("", "none"):
        return ()
    out = []
    for part in text.split(","):
        pages, sep, mib = part.strip().partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"must be PAGES:HOST_MIB pairs like 16:2,64:64, not {text!r}")
        out.append((_positive(pages), _positive(mib)))
    return tuple(out)


def _lanes(text: str) -> int:
    n = _positive(text)
    if n > 8:
        raise argparse.ArgumentTypeError(f"must be 1..8 (the engine's lanes), not {n}")
    return n


def _common(b: argparse.ArgumentParser, dtype: bool = True) -> None:
    b.add_argument("--model", default="models/tiny", metavar="DIR",
                   help="model directory; the tiny model is built there if missing")
    if dtype:
        b.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype")
    b.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the JSON result to this file instead of stdout")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write the figure to this PNG file (default: --out with .png)")


def _controller(b: argparse.ArgumentParser) -> None:
    b.add_argument("--concurrency", type=_positives, default="1,2,4,8", metavar="C,...",
                   help="steady-decode runs: C concurrent requests each (comma list; none skips)")
    b.add_argument("--pressure", type=_positives, default="2,4,8", metavar="C,...",
                   help="pressure runs (a third of the KV pages needed, 90 + 100 tokens each): C per run "
                        "(comma list; none skips)")
    b.add_argument("--prompt-tokens", type=_positive, default=32, metavar="N", help="prompt length of the steady runs")
    b.add_argument("--decode-tokens", type=_positive, default=64, metavar="N",
                   help="output tokens of the steady runs (the middle half of the cycles is measured)")
    _common(b)


def _agent(b: argparse.ArgumentParser) -> None:
    b.add_argument("--transport", type=_transports, default="inproc,ray", metavar="T[,T]",
                   help="the trace's transports, one run each: inproc, ray or inproc,ray")
    b.add_argument("--sessions", type=_positive, default=8, metavar="N",
                   help="trace: agent sessions, one request each per round")
    b.add_argument("--turns", type=_positive, default=6, metavar="N", help="trace: rounds (turns per session)")
    b.add_argument("--system-tokens", type=_positive, default=1500, metavar="N",
                   help="trace: shared system prompt length")
    b.add_argument("--out-tokens", type=_positive, default=32, metavar="N",
                   help="trace: greedy output tokens per request")
    b.add_argument("--lanes", type=_lanes, default=None, metavar="N",
                   help="trace: max_concurrency, 1..8 (default: one per session, at most 8)")
    b.add_argument("--capacity", type=_capacities, default="16:2,64:64", metavar="PAGES:MIB,...",
                   help="the multi-turn workload (6 sessions x 5 turns, 4 lanes), one run per KV pages:Host MiB "
                        "pair (comma list; none skips)")
    b.add_argument("--seed", type=int, default=0, help="seed of the trace's and the workload's token RNG")
    _common(b)


def _actors(b: argparse.ArgumentParser) -> None:
    b.add_argument("--transport", type=_transports, default="inproc,ray", metavar="T[,T]",
                   help="one engine per transport: inproc, ray or inproc,ray")
    b.add_argument("--concurrency", type=_positives, default="1,2,4,8", metavar="C,...",
                   help="runs of C concurrent requests each (comma list)")
    b.add_argument("--prompt-tokens", type=_positive, default=16, metavar="N", help="prompt length")
    b.add_argument("--max-tokens", type=_positive, default=48, metavar="N",
                   help="output tokens per request (ignore_eos)")
    b.add_argument("--lanes", type=_lanes, default=8, metavar="N", help="the engine's max_concurrency, 1..8")
    _common(b)


def _cache_scale(b: argparse.ArgumentParser) -> None:
    b.add_argument("--records", type=_positives, default="100,1000,10000", metavar="N,...",
                   help="cache sizes to fill and measure at (comma list; the 10k fill takes most of the time)")
    _common(b)


def _decode(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default="models/tiny", metavar="DIR",
                   help="model directory; the tiny model is built there if missing")
    b.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype")
    b.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the JSON result to this file instead of stdout")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write the figure to this PNG file (default: --out with .png)")


def _gpu(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default="models/tiny", metavar="DIR",
                   help="model directory for the engine check; the tiny model is built there if missing")
    b.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the JSON result to this file instead of stdout")


def _speculative(b: argparse.ArgumentParser) -> None:
    b.add_argument("--method", choices=["mtp", "dflash", "dflash2"], default="mtp",
                   help="the draft backend: the model's MTP head, or a DFlash / DFlash2 draft model")
    b.add_argument("--draft", default=None, metavar="DIR",
                   help="the DFlash draft's directory (default: a fitted tiny draft, built next to --model)")
    b.add_argument("--drafts", type=_positives, default=None, metavar="K,...",
                   help="drafts per step, one engine each (speculation off always runs first; default MTP "
                        "1,2,3, DFlash 3,7: blocks of 4 and 8)")
    b.add_argument("--concurrency", type=_positives, default="1,4,8", metavar="C,...",
                   help="runs of C concurrent requests each (comma list)")
    b.add_argument("--prompt-tokens", type=_positive, default=32, metavar="N", help="prompt length (corpus text)")
    b.add_argument("--max-tokens", type=_positive, default=64, metavar="N", help="output tokens per request")
    b.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (seeded per request)")
    _common(b)


def _serve(b: argparse.ArgumentParser) -> None:
    b.add_argument("--base-url", default=None, metavar="URL",
                   help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1; without it `ninfer serve "
                        "--transport inproc` is started on the tiny model (--model-dir) on a free port and stopped")
    b.add_argument("--model", default=None, help="model name to request (default: the first id of GET /models)")
    b.add_argument("--model-dir", default="models/tiny", metavar="DIR",
                   help="model of the built-in server; built if missing")
    b.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY` (or set OPENAI_API_KEY)")
    b.add_argument("--clients", type=_positive, default=64, metavar="N",
                   help="concurrent chat users (the most requests in flight)")
    b.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="start requests no faster than a Poisson process of R per second (default: as fast as "
                        "the clients can; vLLM's --request-rate)")
    b.add_argument("--transport", choices=["inproc", "ray"], default="inproc",
                   help="the built-in server's transport (without --base-url)")
    b.add_argument("--rounds", type=_positive, default=4, metavar="N", help="turns per user, one after another")
    b.add_argument("--max-tokens", type=_positive, default=32, metavar="N", help="max_tokens of every request")
    b.add_argument("--prompt-words", type=_positive, default=None, metavar="N",
                   help="user turns of N random words (no system prompt) instead of the built-in chat mix")
    b.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    b.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (ours, vLLM, SGLang): every reply "
                                                             "runs to --max-tokens")
    b.add_argument("--structured", choices=["none", "json", "both"], default="none",
                   help="json: every request asks for a json_schema response; both: the load without, then with "
                        "it, and the grammar's mask time per constrained token (NInfer's /metrics)")
    b.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a read may wait (a stalled stream counts as an error)")
    b.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the JSON result (with every request's record) to this file "
                                               "instead of stdout")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write the TTFT CDF per round to this PNG file (default: --out with .png)")


BENCHES = {
    "controller": (_controller, "controller CPU per engine cycle (excluding the worker call), round trips per cycle "
                                "and message sizes: steady decode, and under KV pressure; in-process by design"),
    "agent": (_agent, "the agent trace (sessions sharing a system prompt, every round submitted together) on each "
                      "transport: computed prompt tokens vs the floor, TTFT, outputs checked against the "
                      "reference; then a multi-turn agent workload at each capacity"),
    "actors": (_actors, "Ray vs in-process: round trips and transport overhead per cycle, decode tok/s per C"),
    "cache-scale": (_cache_scale, "controller cost against the number of cached records: decode cycle, "
                                  "admission, admission with reclaim, per request while filling and with the "
                                  "Host full"),
    "speculative": (_speculative, "speculative decoding (MTP, DFlash, DFlash2) on vs off on the same machine "
                                  "in one run: decode tok/s and their ratio per C, tokens per target step, "
                                  "accepted length per block, acceptance by draft position; outputs checked "
                                  "identical"),
    "decode": (_decode, "the model forward alone: decode tok/s at C=1..8 on the batched path and on the "
                        "per-sequence reference beside it, and their ratio at C=8 (same tokens checked)"),
    "gpu": (_gpu, "the prepared GPU check: every kernel against its torch reference on CUDA (tiny and "
                  "interpreted without one), kernel times, pinned H2D/D2H GB/s, the engine on CUDA against "
                  "reference_generate; bench/gpu_check.sh bounds it at 8 minutes"),
    "serve": (_serve, "HTTP load generator for any OpenAI-compatible server: concurrent multi-turn streaming chat "
                      "users; TTFT, end-to-end, tokens/s and cached tokens per round; exits 1 if any request "
                      "failed"),
}


def add_parsers(benches) -> None:
    """One sub-parser per benchmark under ``ninfer bench``."""
    for name, (options, text) in BENCHES.items():
        b = benches.add_parser(name, help=text, description=text, formatter_class=_Help)
        options(b)
        b.set_defaults(func=run_serve if name == "serve" else run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from importlib import import_module

    if args.name == "gpu":
        import_module("ninfer.benchmarks.gpu").run(args.model, out=args.out)
        return 0
    if args.name == "decode":
        import_module("ninfer.benchmarks.decode").run(args.model, out=args.out, dtype=args.dtype, plot=args.plot)
        return 0
    kw = {"out": args.out, "plot": args.plot, "dtype": args.dtype}
    if args.name == "controller":
        kw.update(concurrency=args.concurrency, pressure=args.pressure, decode_tokens=args.decode_tokens,
                  prompt_tokens=args.prompt_tokens)
    elif args.name == "agent":
        kw.update(transports=args.transport, sessions=args.sessions, turns=args.turns,
                  system_tokens=args.system_tokens, out_tokens=args.out_tokens, lanes=args.lanes,
                  capacities=args.capacity, seed=args.seed)
    elif args.name == "actors":
        kw.update(transports=args.transport, concurrency=args.concurrency, max_tokens=args.max_tokens,
                  prompt_tokens=args.prompt_tokens, lanes=args.lanes)
    elif args.name == "cache-scale":
        kw.update(sizes=args.records)
    elif args.name == "speculative":
        kw.update(drafts=args.drafts, concurrency=args.concurrency, max_tokens=args.max_tokens,
                  prompt_tokens=args.prompt_tokens, temperature=args.temperature, method=args.method,
                  draft=args.draft)
    import_module(f"ninfer.benchmarks.{args.name.replace('-', '_')}").run(args.model, **kw)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import os

    try:
        import httpx  # noqa: F401
    except ImportError:
        raise NInferError("ninfer bench serve needs httpx: pip install 'ninfer[bench]'") from None
    from ninfer.benchmarks import serve

    result = serve.run(args.base_url, args.model, args.api_key or os.environ.get("OPENAI_API_KEY"), args.clients,
                       args.rounds, args.max_tokens, args.prompt_words, args.temperature, args.ignore_eos,
                       args.timeout, model_dir=args.model_dir, out=args.out, plot=args.plot,
                       request_rate=args.request_rate, transport=args.transport, structured=args.structured)
    return 1 if result["errors"] else 0
