"""Progress on stderr for the long things a user waits on: benchmarks, model loading, the demo.

Bars are tqdm's, so stdout stays what a command reports (a table, JSON). When they show:

    NINFER_PROGRESS unset   only when stderr is a terminal (tqdm's ``disable=None``): quiet in
                            tests, pipes and CI logs, where a redrawn line is noise
    NINFER_PROGRESS=0       never
    NINFER_PROGRESS=1       always, also into a file or a CI log

tqdm is a ``bench`` / ``dev`` extra, not a runtime dependency: without it nothing is drawn.
``note`` lines (a step of the demo, a phase of a bench) are plain stderr text, hidden only by
``NINFER_PROGRESS=0``.
"""

from __future__ import annotations

import os
import sys


def _setting() -> bool | None:
    """True: always, False: never, None: when stderr is a terminal."""
    v = os.environ.get("NINFER_PROGRESS", "").strip().lower()
    if v in ("0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    return None


class _Quiet:
    """What ``bar`` returns when nothing is drawn: iterates, counts nothing, says nothing."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *a, **kw) -> None:
        pass

    def set_description(self, *a, **kw) -> None:
        pass

    def close(self) -> None:
        pass


def bar(iterable=None, *, total: int | None = None, desc: str | None = None, unit: str = "it",
        delay: float = 0.0, leave: bool = True):
    """A tqdm bar on stderr (or a silent stand-in, see the module docstring). ``delay``: draw
    only once it has run that many seconds (model loading that is over in a moment stays quiet)."""
    setting = _setting()
    if setting is False:
        return _Quiet(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Quiet(iterable)
    return tqdm(iterable, total=total, desc=desc, unit=unit, delay=delay, leave=leave, file=sys.stderr,
                dynamic_ncols=True, disable=None if setting is None else False)


def note(text: str) -> None:
    """One line of progress text on stderr (unless NINFER_PROGRESS=0)."""
    if _setting() is not False:
        print(text, file=sys.stderr, flush=True)
