"""Shared helpers for benchmarks: a readable table and a JSON result on stdout (or the JSON in
``--out``), and a PNG plot (``plots.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns}
    head = "  ".join(c.rjust(widths[c]) for c in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.4g}"     # 12860, not 1.286e+04
    return "" if v is None else str(v)


def report(name: str, result: dict, rows: list[dict], columns: list[str], out: str | None,
           plot: str | None = None, plot_only: dict | None = None) -> dict:
    """The table on stdout, the JSON document to ``out`` (else stdout after the table), the plot
    to ``plot`` (else next to ``out``, see ``plots.write``) from the document plus ``plot_only``
    (data the plot needs that the printed JSON leaves out); returns the document."""
    print(table(rows, columns))
    data = {"benchmark": name, **result, "rows": rows}
    text = json.dumps(data, indent=2, default=str)
    if out:
        Path(out).write_text(text + "\n")
        print(f"\nJSON written to {out}", file=sys.stderr)
    else:
        print("\n" + text)
    from ninfer.benchmarks.plots import write
    write({**data, **(plot_only or {})}, plot, out)
    return data


def decode_window(handles) -> tuple[list[float], list, float]:
    """Each request's first-token time, the outputs, and when the last ended: decode tok/s is
    measured from the first first token (prefill excluded) to the end."""
    import time
    firsts = []
    for h in handles:
        for _ in h:
            firsts.append(time.perf_counter())
            break
    outs = [h.result(600) for h in handles]
    return firsts, outs, time.perf_counter()


def ensure_model(path: str) -> str:
    """``path``, built first if missing; the build's message goes to stderr (stdout is the report)."""
    from contextlib import redirect_stdout

    from ninfer.demo import ensure_model as _ensure
    with redirect_stdout(sys.stderr):
        return str(_ensure(path))


def routers(routings: tuple[str, ...], queue_tokens: int | None) -> tuple:
    """One router config per routing mode: the mode's name, or with ``queue_tokens`` a dict."""
    if queue_tokens is None:
        return tuple(routings)
    return tuple({"routing": r, "queue_tokens": queue_tokens} for r in routings)


def router_label(router) -> str:
    """How a run names its router: the mode, and a queue price that is not the default."""
    if isinstance(router, dict):
        return f"{router['routing']} q{router['queue_tokens']}"
    return str(router)
