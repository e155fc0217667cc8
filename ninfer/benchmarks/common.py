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
        return f"{v:.4g}"
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
