"""``index.prefix_digests`` (the prefix index's keys): the digest at every frontier is the
digest of that prefix alone — packed once and hashed through views of the packing, it must give
the bytes of hashing each prefix's own packing (a key that differed would miss a real restore
position, or narrow to the wrong candidates)."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.policy.index import digest, prefix_digests
from ninfer.protocol import pack_tokens


def _alone(tokens: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(pack_tokens(list(tokens)))
    return h.digest()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-2**31, 2**31 - 1), max_size=200), st.lists(st.integers(0, 240), max_size=12))
def test_each_frontier_digests_its_own_prefix(tokens, frontiers):
    got = prefix_digests(tokens, frontiers)
    assert set(got) == {f for f in frontiers if f <= len(tokens)}
    for f, d in got.items():
        assert d == _alone(tokens[:f]) == digest(tokens[:f])
    assert prefix_digests(tuple(tokens), frontiers) == got


def test_prefixes_of_different_tokens_differ_and_empty_is_fine():
    assert prefix_digests([1, 2, 3], []) == {}
    a, b = prefix_digests([1, 2, 3], [2, 3]), prefix_digests([1, 2, 4], [2, 3])
    assert a[2] == b[2] and a[3] != b[3]
