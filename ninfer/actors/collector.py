"""Python's cyclic garbage collector in an engine process: what startup built is set aside.

The collector's oldest generation is scanned whole every time enough new long-lived objects
have piled up, and after startup it holds everything the engine will keep for its lifetime —
the model's modules and parameters, the tokenizer, Ray's and torch's own structures (~180,000
tracked objects in an in-process engine on the tiny model). Each such scan stops the control
loop: on the 300-request trace slice six of them took 657 ms in all, up to 137 ms each, and
every request in flight waited that long. ``settle_startup`` collects once and moves what
survives into the permanent generation (``gc.freeze``) when the process has finished starting;
the scans then walk only what serving created since (the same run: 156-196 ms in all, at most
45-67 ms). vLLM freezes its engine's startup heap the same way.

Serving also allocates tracked containers in bulk: every reclaim quote decodes ~1,000 fact
messages with their tuples, which at CPython's default young-generation threshold (700) started
a collection in nearly every quote, and the collections' survivors fed the older scans. The
engine raises the young threshold to ``YOUNG`` (most of a quote's objects are freed by reference
counting before the next scan): on the slice the collector's time went from 0.42 s in 902
collections (the longest 36 ms, a full one) to 0.15 s in 43 (the longest 10 ms).

Frozen objects are still freed by reference counting; only cycles among them wait — so
``release`` (an engine's shutdown) unfreezes them and puts the thresholds back, and a process
that starts many engines one after another (the tests) does not keep the cyclic garbage of the
ones it shut down.
"""

from __future__ import annotations

import gc


YOUNG = 5_000                 # allocations between young-generation scans while an engine runs
_before: list[tuple[int, ...]] = []     # the thresholds each running engine found


def settle_startup() -> None:
    """After an engine process finished starting: collect, then freeze what survived, and
    scan the young generation less often."""
    gc.collect()
    gc.freeze()
    now = gc.get_threshold()
    _before.append(now)
    gc.set_threshold(max(now[0], YOUNG), *now[1:])


def release() -> None:
    """At an engine's shutdown: the frozen objects are collectable again, and the thresholds
    are the ones it found."""
    gc.unfreeze()
    if _before:
        gc.set_threshold(*_before.pop())
