"""One-off chunk keys of a request, for tests: a fresh `RequestKeyer` (generation "",
nothing bound), as a new engine would key it."""

from __future__ import annotations

from gemma4_kv.keys.request import RequestKeys, RequestKeyer, Uncacheable


def chunk_keys(request, chunk_size: int,
               num_tokens: int | None = None) -> RequestKeys | Uncacheable:
    return RequestKeyer(chunk_size).keys(request, num_tokens)
