"""Names of cached pages below the device pool: a hash chain over the prompt's whole pages.

A page below the device has no radix-tree node to say what it holds, so it is named by what
determines its K/V: the partition (model, cache salt, sampling settings), the storage layout
(layers, heads, head size, dtype, page size) and every token from the start of the prompt to the
page's end. Page `k`'s digest is `H(digest of page k-1, tokens of page k)`, starting from a root
digest of the partition and layout, so a lookup walks a prompt page by page and stops at the
first page no tier holds. BLAKE2b with 16-byte digests: collisions are out of reach, and the
disk tier checks each file's own digest and checksum before its contents are used.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from kvctl.agent.prefix import IsolationKey

DIGEST_BYTES = 16


def root_digest(key: IsolationKey, layout: str) -> bytes:
    """The chain's start for one partition of one storage layout (see `layout_of`)."""
    parts = (key.model, key.salt, key.sampling, layout)
    text = repr((*parts, key.group) if key.group else parts).encode()
    return hashlib.blake2b(text, digest_size=DIGEST_BYTES, person=b"kvctl-root").digest()


def layout_of(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, page_size: int) -> str:
    """What a page's bytes depend on besides the tokens: pages of another layout never match."""
    return f"L{num_layers}.H{num_kv_heads}.D{head_dim}.{dtype}.P{page_size}"


def page_digests(root: bytes, tokens: Sequence[int], page_size: int, pages: int) -> list[bytes]:
    """The digests of the first `pages` whole pages of `tokens`."""
    digests = []
    previous = root
    for k in range(pages):
        chunk = array("q", tokens[k * page_size : (k + 1) * page_size]).tobytes()
        previous = hashlib.blake2b(previous + chunk, digest_size=DIGEST_BYTES).digest()
        digests.append(previous)
    return digests
