"""Worker-side probe of what the connector stores and loads (collective_rpc targets).

`install` wraps the connector's worker half of a live engine: every stored object
is copied as it is written, every loaded block range read back from vLLM's cache
once the step that loaded it has run, each under a content key (the request's tokens
up to the chunk's end plus the token after it, the one an EAGLE drafter read at the
chunk's last position) and group. `report` then says

- which stored positions vLLM wrote again after they were stored (full-attention
  groups, while the request still runs): stored too early, e.g. before a rejected
  speculation was rolled back;
- where captures of the same content disagree: an object stored by one request
  against one stored by another (a recomputation, e.g. under another cache salt), and
  what a hit loaded against what was stored.

The KV of a capture is LMCache's KV_2LTD object layout, [K|V, layer, token, heads *
head_size], read from the logical [block, head, token, K|V] view vLLM registers,
independently of the connector's mover. vLLM's CPU backend lays a block out as
[head, K of every token | V of every token] behind that view, so on CPU a reported
position is exact only to its block; the comparisons are exact either way.
"""

from __future__ import annotations

import hashlib
import struct

import torch

_probe = None


def _blocks_view(cache: torch.Tensor, num_blocks: int, block: int) -> torch.Tensor:
    """[heads, block_size, K|V] of one scheduler block of a [blocks, heads, tokens,
    K|V] view (vLLM may split a block into smaller kernel blocks)."""
    pieces = cache.shape[0] // num_blocks
    x = cache[block * pieces:(block + 1) * pieces]  # [pieces, heads, kernel_block, C]
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])


def read_chunk(group, caches, num_blocks: int, cb) -> tuple[list[int], torch.Tensor]:
    """(token offsets inside the chunk, KV_2LTD tensor of those tokens) of the blocks
    `cb` (a `plan.ChunkBlocks`) of `group`, read from the live cache."""
    bs, hd = group.block_size, group.head_size
    tokens = [s * bs + t for s in cb.slots for t in range(bs)]
    per_layer = []
    for cache in caches:
        blocks = [_blocks_view(cache, num_blocks, b) for b in cb.block_ids]
        x = torch.cat(blocks, dim=1)  # [heads, tokens, C]
        k = x[..., :hd].permute(1, 0, 2).reshape(x.shape[1], -1)
        v = x[..., hd:].permute(1, 0, 2).reshape(x.shape[1], -1)
        per_layer.append(torch.stack([k, v]))
    return tokens, torch.stack(per_layer, dim=1).cpu()


def content_key(tokens, chunk: int, chunk_size: int, group_id: int) -> str | None:
    """Tokens [0, (chunk + 1) * chunk_size] (the next token included) and the group;
    None when the next token is not known yet."""
    end = (chunk + 1) * chunk_size
    if len(tokens) <= end:
        return None
    data = struct.pack(f"<{end + 1}q", *tokens[:end + 1]) + struct.pack("<q", group_id)
    return hashlib.sha256(data).hexdigest()[:16]


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Probe:
    def __init__(self, worker, cw):
        self.worker, self.cw = worker, cw
        self.layout, self.cs = cw.layout, cw.chunk_size
        self.num_blocks = cw.kv_cache_config.num_blocks
        self.captures: dict[str, list[dict]] = {}
        self.watch: list[dict] = []  # stored full-group objects of running requests
        self.rewrites: list[dict] = []
        self.problems: list[str] = []
        self.schedule: list[dict] = []  # per step: tokens computed before it, per request
        self.counts = {"saved": 0, "loaded": 0, "steps": 0}
        self._save = None
        self._pending_loads = []
        orig_saver_save, orig_transfer_save = cw.saves.submit, cw.saves.transfer.save
        orig_wait, orig_load = cw.wait_for_save, cw.start_load_kv

        def saver_save(job):
            self._save = job.write
            try:
                orig_saver_save(job)
            finally:
                self._save = None

        def transfer_save(group, caches, objects, plan, pool):
            out = orig_transfer_save(group, caches, objects, plan, pool)
            _sync()  # on CUDA the copies land later, on a side stream
            for (kv, _, _), cb in zip(objects, plan):
                self._stored(group, caches, kv, cb)
            return out

        def wait_for_save(meta):
            # After this step's forward and drafter: its loads have landed, and any
            # rewrite of a stored position has happened.
            _sync()
            self.counts["steps"] += 1
            self.schedule.append({r: st.num_computed_tokens
                                  for r, st in worker.model_runner.requests.items()})
            for load in self._pending_loads:
                self._loaded(load)
            self._pending_loads = []
            self.check_rewrites()
            return orig_wait(meta)

        def start_load_kv(meta):
            self._pending_loads += meta.loads
            return orig_load(meta)

        cw.saves.submit, cw.saves.transfer.save = saver_save, transfer_save
        cw.wait_for_save, cw.start_load_kv = wait_for_save, start_load_kv

    def _tokens(self, req_id: str) -> list[int] | None:
        st = self.worker.model_runner.requests.get(req_id)
        return None if st is None else list(st.prompt_token_ids) + list(st.output_token_ids)

    def _capture(self, kind, req_id, group, cb, offsets, kv):
        key = content_key(self._tokens(req_id) or [], cb.chunk, self.cs, group.group_id)
        if key is None:
            self.problems.append(f"{kind} of chunk {cb.chunk} group {group.group_id} of "
                                 f"{req_id}: the token after the chunk is not known yet")
            return
        self.captures.setdefault(key, []).append(
            {"kind": kind, "req": req_id, "chunk": cb.chunk, "group": group.group_id,
             "tokens": offsets, "kv": kv, "layers": list(group.layers)})

    def _stored(self, group, caches, kv, cb):
        req_id = self._save.req_id
        self.counts["saved"] += 1
        tokens, live = read_chunk(group, caches, self.num_blocks, cb)
        stored = kv.detach().clone()
        if not torch.equal(stored[:, :, tokens], live):
            self.problems.append(f"stored object of chunk {cb.chunk} group {group.group_id} "
                                 f"of {req_id} differs from the blocks it was copied from")
        self._capture("save", req_id, group, cb, tokens, stored[:, :, tokens])
        if group.window is None:
            self.watch.append({"req": req_id, "group": group, "cb": cb, "kv": live})

    def _loaded(self, load):
        from gemma4_kv.layout.plan import load_blocks

        self.counts["loaded"] += 1
        for cb in load_blocks(self.layout, load.start, load.hit, self.cs, load.block_ids):
            group = self.layout.groups[cb.group_id]
            tokens, live = read_chunk(group, self.cw.saves.caches[group.group_id],
                                      self.num_blocks, cb)
            self._capture("load", load.req_id, group, cb, tokens, live)

    def check_rewrites(self):
        """Stored full-group positions of running requests must be what was stored."""
        running = self.worker.model_runner.requests
        keep = []
        for w in self.watch:
            if w["req"] not in running:
                continue
            group, cb = w["group"], w["cb"]
            tokens, live = read_chunk(group, self.cw.saves.caches[group.group_id],
                                      self.num_blocks, cb)
            diff = (live != w["kv"]).flatten(2).any(-1)  # [K|V, layer, token]
            if diff.any():
                layers, positions = diff.any(0).nonzero(as_tuple=True)
                self.rewrites.append({
                    "req": w["req"], "chunk": cb.chunk, "group": group.group_id,
                    "layers": sorted({group.layers[i] for i in layers.tolist()}),
                    "positions": sorted({cb.chunk * self.cs + tokens[i]
                                         for i in positions.tolist()})})
                continue  # reported once
            keep.append(w)
        self.watch = keep

    def scales(self) -> dict[str, float]:
        """Largest |value| seen per layer (how big a difference would be)."""
        out: dict[str, float] = {}
        for caps in self.captures.values():
            for c in caps:
                for li, layer in enumerate(c["layers"]):
                    out[layer] = max(out.get(layer, 0.0), float(c["kv"][:, li].abs().max()))
        return out

    def compare(self, rtol: float) -> list[dict]:
        """Every pair of captures of the same content that differs in some layer by
        more than `rtol` times that layer's largest value, on the tokens both hold."""
        out = []
        for caps in self.captures.values():
            first = caps[0]
            for other in caps[1:]:
                common = sorted(set(first["tokens"]) & set(other["tokens"]))
                a = first["kv"][:, :, [first["tokens"].index(t) for t in common]]
                b = other["kv"][:, :, [other["tokens"].index(t) for t in common]]
                err = (a - b).abs().amax(dim=(0, 3))  # [layer, token]
                scale = a.abs().amax(dim=(0, 2, 3))  # [layer]
                for li, layer in enumerate(first["layers"]):
                    bad = (err[li] > rtol * scale[li]).nonzero().flatten().tolist()
                    if bad:
                        out.append({"a": (first["kind"], first["req"]),
                                    "b": (other["kind"], other["req"]),
                                    "chunk": first["chunk"], "group": first["group"],
                                    "layer": layer, "max": float(err[li].max()),
                                    "scale": float(scale[li]),
                                    "positions": [first["chunk"] * self.cs + common[i]
                                                  for i in bad]})
        return out


def sharpen_draft(worker) -> int:
    """collective_rpc target: the drafter's norm weights set to 1, as the harness does
    for the target (`sharpen_dummy_weights`): with vLLM's U(-1e-3, 1e-3) dummy norms
    the draft's KV is ~1e-6 and a wrong draft KV would pass any tolerance."""
    n = 0
    for name, t in worker.model_runner.drafter.model.named_parameters():
        if name.endswith("norm.weight"):
            t.data.fill_(1.0)
            n += 1
    return n


def install(worker) -> bool:
    """collective_rpc target: start probing this worker's connector (False: none)."""
    global _probe
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return False
    _probe = _Probe(worker, get_kv_transfer_group()._worker)
    return True


def report(worker, rtol: float = 1e-3) -> dict | None:
    """collective_rpc target: what the probe saw (None without a connector)."""
    if _probe is None:
        return None
    _probe.check_rewrites()
    pairs = sum(len(c) - 1 for c in _probe.captures.values())
    sizes = {}
    for caps in _probe.captures.values():
        for c in caps:
            sizes.setdefault(c["kind"], 0)
            sizes[c["kind"]] += 1
    return {"counts": _probe.counts, "captures": sizes, "pairs": pairs,
            "rewrites": _probe.rewrites, "problems": _probe.problems,
            "mismatches": _probe.compare(rtol), "scale": _probe.scales(),
            "schedule": _probe.schedule,
            "saved": sorted({(c["req"], c["chunk"], c["group"])
                             for caps in _probe.captures.values() for c in caps
                             if c["kind"] == "save"})}
