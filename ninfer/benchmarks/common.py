"""Shared helpers for benchmarks: a JSON result plus a readable table on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    head = "  ".join(c.rjust(widths[c]) for c in columns)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.4g}"     # 12860, not 1.286e+04
    return "" if v is None else str(v)


def report(name: str, result: dict, rows: list[dict], columns: list[str], out: str | None) -> None:
    print(table(rows, columns))
    data = {"benchmark": name, **result, "rows": rows}
    text = json.dumps(data, indent=2, default=str)
    if out:
        Path(out).write_text(text + "\n")
        print(f"\nJSON written to {out}", file=sys.stderr)
    else:
        print("\n" + text)


def ensure_model(path: str) -> str:
    from ninfer.demo import ensure_model as _ensure
    return str(_ensure(path))


def plot_svg(path: str, title: str, xs: list[float], series: dict[str, list[float]]) -> None:
    """A small log-x line plot as a standalone SVG (no plotting dependency)."""
    import math
    w, h, pad = 560, 320, 48
    lx = [math.log10(max(x, 1)) for x in xs]
    ymax = max((v for ys in series.values() for v in ys if v is not None), default=1.0) or 1.0
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1

    def px(x: float) -> float:
        return pad + (w - 2 * pad) * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        return h - pad - (h - 2 * pad) * y / ymax
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{pad - 4}" y="{pad}" text-anchor="end">{ymax:.3g}</text>',
           f'<text x="{pad - 4}" y="{h - pad}" text-anchor="end">0</text>']
    for x, l in zip(xs, lx):
        out.append(f'<text x="{px(l)}" y="{h - pad + 14}" text-anchor="middle">{x}</text>')
    for k, (name, ys) in enumerate(series.items()):
        c = colors[k % len(colors)]
        pts = " ".join(f"{px(l):.1f},{py(y):.1f}" for l, y in zip(lx, ys) if y is not None)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{pts}"/>')
        out.append(f'<text x="{w - pad}" y="{pad + 14 * k}" text-anchor="end" fill="{c}">{name}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")


def plot_cdf_svg(path: str, title: str, series: dict[str, list[float]], xlabel: str = "ms") -> None:
    """Empirical CDFs (fraction of samples <= x, linear x from 0) as a standalone SVG, the
    same frame as ``plot_svg``; an empty series draws nothing."""
    w, h, pad = 560, 320, 48
    xmax = max((v for xs in series.values() for v in xs), default=1.0) or 1.0

    def px(x: float) -> float:
        return pad + (w - 2 * pad) * x / xmax

    def py(y: float) -> float:
        return h - pad - (h - 2 * pad) * y
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           f'<text x="{pad - 4}" y="{pad}" text-anchor="end">1</text>',
           f'<text x="{pad - 4}" y="{h - pad}" text-anchor="end">0</text>',
           f'<line x1="{pad}" y1="{py(0.5)}" x2="{w - pad}" y2="{py(0.5)}" stroke="#ccc"/>',
           f'<text x="{pad - 4}" y="{py(0.5)}" text-anchor="end">0.5</text>',
           f'<text x="{w / 2}" y="{h - pad + 28}" text-anchor="middle">{xlabel}</text>']
    for k in range(5):
        x = xmax * k / 4
        out.append(f'<text x="{px(x)}" y="{h - pad + 14}" text-anchor="middle">{x:.4g}</text>')
    for k, (name, xs) in enumerate(series.items()):
        c = colors[k % len(colors)]
        xs = sorted(xs)
        pts, n = [f"{px(0):.1f},{py(0):.1f}"], len(xs)
        for i, x in enumerate(xs):                  # a step up by 1/n at each sample
            pts += [f"{px(x):.1f},{py(i / n):.1f}", f"{px(x):.1f},{py((i + 1) / n):.1f}"]
        if xs:
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{" ".join(pts)}"/>')
        out.append(f'<text x="{w - pad}" y="{h - pad - 40 - 14 * (len(series) - 1 - k)}" text-anchor="end" '
                   f'fill="{c}">{name}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out) + "\n")
