"""Chunk keys of a request: everything its KV depends on, chunk by chunk.

vLLM's scheduler-side `Request` decides the KV of a chunk through more than its token
ids: multimodal items (an image is `boi + N x image_token + eoi`, so two images of one
size have equal ids), prompt embeddings (mixed prompts zero the ids of embedded rows),
the LoRA adapter, the cache salt. A key that leaves one out returns another request's
KV. So chunk `i` is keyed by a rolling sha256

    root  = H(MAGIC || F(1, generation) || F(2, cache salt) || F(3, LoRA identity))
    key_i = H(key_{i-1} || F(16, token ids) || F(17, multimodal items) || F(18, embeds))

(key_{-1} = root) over the request's `all_token_ids`, one full chunk at a time.
`F(tag, payload) = struct "<BQ" (tag, len(payload)) || payload`; every field is framed
even when empty, so no two field lists encode alike. Encoding version 1:

- generation: utf-8 (the connector bumps it on `reset_cache`, e.g. after new weights)
- cache salt: utf-8; None and "" are the same (vLLM treats "" as no salt)
- LoRA identity: empty without an adapter, else F(1, name) F(2, int id "<q")
  F(3, resolved path) F(4, sha256 of the adapter's files, see `AdapterDigests`)
- token ids: "<q" each (`request.all_token_ids`, so mixed prompts' embedded rows are 0)
- multimodal items overlapping the chunk, in `mm_features` order, each F(1, identifier)
  F(2, "<qq" offset relative to the chunk start (negative: it began earlier), length)
- embeds (rows of the chunk inside the prompt, only when `prompt_embeds` is set):
  F(1, torch dtype) F(2, "<qqq" first row relative to the chunk, rows, row width)
  F(3, sha256 of the rows' raw bytes) F(4, one byte per row: 1 = token id, 0 = embedded)

Items and rows before the chunk are named through the chain. Requests whose KV cannot
be keyed this way get an `Uncacheable(reason)` and are neither stored nor loaded.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import threading
import uuid
from dataclasses import dataclass, field

ENCODING_VERSION = 1
MAGIC = b"gemma4-kv:request-keys:%d\n" % ENCODING_VERSION

# vLLM's renderer names items it did not hash `renderer{rank}-mm-{counter}-{modality}-{i}`
# (`renderers/base.py::_process_mm_uuids`, when the processor cache and prefix caching are
# both off): a per-process counter, equal across engines and restarts for other content.
_PLACEHOLDER_ID = re.compile(r"(^|:)renderer\d+-mm-\d+-\w+-\d+$")


@dataclass(frozen=True)
class Uncacheable:
    """Why a request's KV must be neither stored nor loaded."""
    reason: str


def _f(tag: int, payload: bytes) -> bytes:
    return struct.pack("<BQ", tag, len(payload)) + payload


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# -- LoRA adapters ------------------------------------------------------------------------

def resolve_adapter_path(lora_path: str) -> str | None:
    """The local path vLLM would read (`lora/utils.py::get_adapter_absolute_path`), or None
    where vLLM would download it from a hub instead (its bytes are then unknown here)."""
    if os.path.isabs(lora_path):
        path = lora_path
    elif lora_path.startswith("~"):
        path = os.path.expanduser(lora_path)
    elif os.path.exists(lora_path):
        path = os.path.abspath(lora_path)
    else:
        return None
    return path if os.path.exists(path) else None


def _adapter_files(path: str) -> list[tuple[str, os.stat_result]]:
    if os.path.isfile(path):
        return [("", os.stat(path))]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            st = os.stat(full)
            if stat.S_ISREG(st.st_mode):
                out.append((os.path.relpath(full, path), st))
    return out


class AdapterDigests:
    """sha256 of an adapter's files (every regular file under its directory), computed once
    per version: cached by each file's (relative name, size, mtime_ns, ctime_ns, inode), so
    a lookup costs a `stat` per file and a changed file is read again (ctime: a rewrite
    that restores size and mtime, as `cp -p` does, still changes it)."""

    def __init__(self):
        self._cache: dict[str, tuple[tuple, bytes]] = {}
        self._lock = threading.Lock()

    def digest(self, path: str) -> bytes | None:
        """None if `path` has no readable regular file."""
        try:
            files = _adapter_files(path)
            sig = tuple((rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                        for rel, st in files)
            if not files:
                return None
            with self._lock:
                hit = self._cache.get(path)
            if hit is not None and hit[0] == sig:
                return hit[1]
            h = hashlib.sha256(b"gemma4-kv:adapter:1\n")
            for rel, _ in files:
                fh = hashlib.sha256()
                with open(os.path.join(path, rel) if rel else path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        fh.update(block)
                h.update(_f(1, rel.encode()) + _f(2, fh.digest()))
            # Read again: a file rewritten while we read it must not be cached as this sig.
            if tuple((r, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino)
                     for r, s in _adapter_files(path)) != sig:
                return None
            digest = h.digest()
            with self._lock:
                self._cache[path] = (sig, digest)
            return digest
        except OSError:
            return None


# -- keys of one request ------------------------------------------------------------------

@dataclass
class RequestKeys:
    """Keys of a request's full chunks so far; `extend` adds chunks as tokens arrive."""
    request_id: str
    chunk_size: int
    epoch: int
    """The keyer's epoch when these keys were made (see `RequestKeyer.refresh`)."""
    lora_id: int | None
    hashes: list[bytes] = field(default_factory=list)
    ahead: list[bytes] = field(default_factory=list)
    """Keys that also name the token after their chunk (`lookahead`)."""
    _root: bytes = b""
    _mm_next: int = 0
    """First multimodal item that does not end before the next chunk."""

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the keys (a multiple of the chunk size)."""
        return len(self.hashes) * self.chunk_size

    def extend(self, request, num_tokens: int | None = None) -> list[bytes]:
        """Keys of the chunks that `num_tokens` (default: all the request's tokens) newly
        completes; costs only those chunks. Tokens already keyed must not have changed."""
        if request.request_id != self.request_id:
            raise ValueError(f"keys of {self.request_id} extended with {request.request_id}")
        total = request.num_tokens if num_tokens is None else num_tokens
        if total > request.num_tokens:
            raise ValueError(f"{total} tokens asked, the request has {request.num_tokens}")
        c = self.chunk_size
        new = []
        prev = self.hashes[-1] if self.hashes else self._root
        tokens = request.all_token_ids
        for start in range(self.num_tokens, total // c * c, c):
            end = start + c
            ids = tokens[start:end]
            prev = _h(prev + _f(16, struct.pack(f"<{c}q", *ids))
                      + _f(17, self._mm_field(request.mm_features, start, end))
                      + _f(18, _embeds_field(request, start, end)))
            new.append(prev)
            self.hashes.append(prev)
        return new

    def lookahead(self, request, n: int) -> list[bytes]:
        """Keys of the first `n` chunks that also name the token after each chunk: with
        drafts that own KV, a position's draft KV comes from the next token, so chunk
        c's KV depends on token (c + 1) * chunk_size too. Costs only new chunks."""
        self.extend(request, n * self.chunk_size)
        tokens = request.all_token_ids
        for c in range(len(self.ahead), n):
            self.ahead.append(_h(self.hashes[c] + struct.pack(
                "<q", tokens[(c + 1) * self.chunk_size])))
        return self.ahead[:n]

    def _mm_field(self, features, start: int, end: int) -> bytes:
        if not features:
            return b""
        while (self._mm_next < len(features)
               and _mm_end(features[self._mm_next]) <= start):
            self._mm_next += 1
        out = []
        for f in features[self._mm_next:]:
            pos = f.mm_position
            if pos.offset >= end:
                break  # sorted by offset (vLLM's input processor sorts them)
            if pos.offset + pos.length > start:
                out.append(_f(1, f.identifier.encode())
                           + _f(2, struct.pack("<qq", pos.offset - start, pos.length)))
        return b"".join(out)


def _mm_end(feature) -> int:
    return feature.mm_position.offset + feature.mm_position.length


def _embeds_field(request, start: int, end: int) -> bytes:
    embeds = request.prompt_embeds
    if embeds is None:
        return b""
    stop = min(end, embeds.shape[0])
    if stop <= start:
        return b""  # a chunk of decoded tokens
    import torch

    rows = embeds[start:stop]
    raw = rows.detach().flatten().cpu().contiguous().view(torch.uint8).numpy()
    mask = request.prompt_is_token_ids
    bits = bytes(1 if m else 0 for m in mask[start:stop]) if mask is not None \
        else bytes(stop - start)
    return (_f(1, str(rows.dtype).encode())
            + _f(2, struct.pack("<qqq", 0, stop - start, rows[0].numel()))
            + _f(3, hashlib.sha256(raw).digest()) + _f(4, bits))


# -- the keyer (one per scheduler) --------------------------------------------------------

class RequestKeyer:
    """Builds `RequestKeys` for requests of one engine; holds what outlives a request: the
    generation (bumped by `reset`), adapter digests and which adapter each LoRA int id
    was first seen with."""

    def __init__(self, chunk_size: int, *, mm_content_hashed: bool = True,
                 generation: str = "", adapter_digests: AdapterDigests | None = None):
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.mm_content_hashed = mm_content_hashed
        """False where vLLM names multimodal items by a counter, not by their content
        (`mm_identifiers_are_content_hashes`): multimodal requests are then uncacheable."""
        self.generation = generation
        self.epoch = 0
        self.adapters = adapter_digests or AdapterDigests()
        self._bound: dict[int, tuple[str, str, bytes]] = {}  # int id -> name, path, digest
        self._tainted: dict[int, str] = {}
        self._lock = threading.Lock()

    def reset(self) -> str:
        """New generation (call from the connector's `reset_cache`): keys made before are
        never looked up again, and requests in flight stop saving (`refresh`)."""
        with self._lock:
            self.generation = f"reset-{uuid.uuid4().hex}"
            self.epoch += 1
            return self.generation

    def keys(self, request, num_tokens: int | None = None) -> RequestKeys | Uncacheable:
        """Keys of the request's full chunks among its first `num_tokens` tokens (default:
        all). Costs one sha256 per chunk (plus the chunk's embedding rows); `extend` later."""
        bad = self._check(request)
        if bad is not None:
            return bad
        lora = self._lora_identity(request.lora_request)
        if isinstance(lora, Uncacheable):
            return lora
        salt = request.cache_salt or ""
        with self._lock:
            generation, epoch = self.generation, self.epoch
        root = _h(MAGIC + _f(1, generation.encode()) + _f(2, salt.encode()) + _f(3, lora))
        lora_id = request.lora_request.lora_int_id if request.lora_request else None
        keys = RequestKeys(request.request_id, self.chunk_size, epoch, lora_id, _root=root)
        keys.extend(request, num_tokens)
        return keys

    def refresh(self, keys: RequestKeys, request) -> RequestKeys | Uncacheable:
        """`keys` if still valid; after a `reset` (or a LoRA id that changed adapter) the
        keys of a request that has computed nothing yet are made again, and a request
        with KV computed before is uncacheable from then on (its KV mixes both)."""
        with self._lock:
            tainted = self._tainted.get(keys.lora_id) if keys.lora_id is not None else None
            current = keys.epoch == self.epoch
        if tainted is not None:
            return Uncacheable(tainted)
        if current:
            return keys
        if request.num_computed_tokens > 0:
            return Uncacheable("the connector was reset while the request was in flight")
        return self.keys(request, keys.num_tokens)

    def _check(self, request) -> Uncacheable | None:
        if request.pooling_params is not None:
            return Uncacheable("pooling request (its attention and outputs may need every "
                               "token computed)")
        if getattr(request, "resumable", False):
            return Uncacheable("streaming session: vLLM rewrites the token tail between "
                               "updates")
        for f in request.mm_features or ():
            ident = getattr(f, "identifier", None)
            if not ident:
                return Uncacheable(f"{f.modality} item without an identifier")
            if not self.mm_content_hashed or _PLACEHOLDER_ID.search(ident):
                return Uncacheable(f"{f.modality} item named {ident!r}: vLLM did not hash "
                                   "its content (processor cache and prefix caching off)")
        embeds = request.prompt_embeds
        if embeds is not None:
            mask = request.prompt_is_token_ids
            if embeds.dim() != 2 or embeds.is_sparse or embeds.is_quantized \
                    or embeds.shape[0] != request.num_prompt_tokens \
                    or (mask is not None and len(mask) != embeds.shape[0]):
                return Uncacheable(f"prompt_embeds of shape {tuple(embeds.shape)} (mask "
                                   f"{None if mask is None else len(mask)}) for "
                                   f"{request.num_prompt_tokens} prompt tokens")
        return None

    def _lora_identity(self, lora) -> bytes | Uncacheable:
        if lora is None:
            return b""
        if lora.load_inplace:
            return Uncacheable(f"LoRA {lora.lora_name!r} has load_inplace: vLLM may replace "
                               "its weights at any step")
        path = resolve_adapter_path(lora.lora_path)
        if path is None:
            return Uncacheable(f"LoRA {lora.lora_name!r}: {lora.lora_path!r} is not a "
                               "local path (vLLM would fetch it)")
        digest = self.adapters.digest(path)
        if digest is None:
            return Uncacheable(f"LoRA {lora.lora_name!r}: cannot read {path!r}")
        ident = (lora.lora_name, path, digest)
        with self._lock:
            if lora.lora_int_id in self._tainted:
                return Uncacheable(self._tainted[lora.lora_int_id])
            bound = self._bound.setdefault(lora.lora_int_id, ident)
            if bound != ident:
                # vLLM reuses the weights it loaded for an int id until it evicts them:
                # which version a request now runs with is unknown.
                reason = (f"LoRA int id {lora.lora_int_id} changed adapter (name, path or "
                          "files) while this engine runs")
                self._tainted[lora.lora_int_id] = reason
                return Uncacheable(reason)
        return (_f(1, lora.lora_name.encode()) + _f(2, struct.pack("<q", lora.lora_int_id))
                + _f(3, path.encode()) + _f(4, digest))


def mm_identifiers_are_content_hashes(vllm_config) -> bool:
    """Whether vLLM names multimodal items by a hash of their content (or a caller's uuid):
    not when both its processor cache and prefix caching are off."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    return not (mm is not None and mm.mm_processor_cache_gb == 0
                and not vllm_config.cache_config.enable_prefix_caching)


def placeholder_spans(request) -> list[tuple[int, int]]:
    """Token ranges [a, b) of the request's multimodal items. Gemma 4 attends both ways
    within an image: a hit that ends inside one lets vLLM compute the rest of the image
    in a later step, whose tokens the first part then never sees. Every item counts (a
    cut that was not needed only costs a shorter hit)."""
    spans = []
    for f in request.mm_features or ():
        pos = f.mm_position
        if pos.length > 1:
            spans.append((pos.offset, pos.offset + pos.length))
    return spans

