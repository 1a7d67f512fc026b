"""Speculative drafts: what a draft model that owns KV changes in what is keyed and stored.

EAGLE-style drafts that own KV compute a position's draft KV from the next token: a
chunk's key then covers one token more (`lookahead`), and generated chunks are stored
only once no later step can rewrite them (`decode_margin`). Gemma 4 assistants own no
KV (their layers read the target's), so nothing changes for them.

vLLM's V1 model runner (the CPU build's; a GPU's when V2 is off or lacks a feature)
writes draft KV that a one-step prefill would not: at the last position of a prefill
step that is not the prompt's last, its padded drafter batch reads the request's last
token instead of the next one (the "backup" token of `prepare_next_token_ids_padded`),
and no draft KV at all in a step whose batch ends within the draft length of the
drafter's max_model_len (`_input_fits_in_drafter`). Neither is rewritten later; such
chunks are not stored (`DraftPolicy.impure_chunks`). The V2 runner feeds the next
prompt token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .groups import KVLayout


def drafts_own_kv(vllm_config, layout: KVLayout) -> bool:
    """Whether a draft model's attention layers own KV in the groups: more layers own KV
    than the target model has (its layers minus the KV-shared ones)."""
    text = vllm_config.model_config.hf_text_config
    target = text.num_hidden_layers - (getattr(text, "num_kv_shared_layers", 0) or 0)
    return sum(len(g.layers) for g in layout.groups) > target


@dataclass(frozen=True)
class DraftPolicy:
    """The draft rules of one engine; the defaults are those of an engine without drafts
    that own KV (nothing changes)."""

    chunk_size: int
    lookahead: int = 0
    """Tokens past a chunk that its KV depends on (1 with drafts that own KV)."""
    decode_margin: int = 0
    """Computed tokens at the end of a decode that a later step may still rewrite."""
    impure_step_ends: bool = False
    """The V1 runner's padded drafter batch: a prefill step's last position is impure."""
    drafter_room: int | None = None
    """V1 runner: the drafter does not run in a step whose batch ends past this."""

    @classmethod
    def from_vllm(cls, vllm_config, layout: KVLayout, chunk_size: int) -> DraftPolicy:
        spec = vllm_config.speculative_config
        if spec is None or not drafts_own_kv(vllm_config, layout):
            return cls(chunk_size)
        if getattr(vllm_config, "use_v2_model_runner", False):
            return cls(chunk_size, 1, spec.num_speculative_tokens + 1)
        draft_len = getattr(spec.draft_model_config, "max_model_len", None)
        queries = spec.num_speculative_tokens + int(spec.method == "dflash")
        return cls(chunk_size, 1, spec.num_speculative_tokens + 1,
                   not spec.disable_padded_drafter_batch,
                   (draft_len or vllm_config.model_config.max_model_len) - queries)

    def drafter_skipped(self, batch_ends: Iterable[int]) -> bool:
        """Whether the drafter does not run in a step whose requests' computed tokens
        end at `batch_ends`."""
        return self.drafter_room is not None and max(batch_ends, default=0) > self.drafter_room

    def impure_chunks(self, computed: int, scheduled: int, known: int,
                      skipped: bool) -> range:
        """Chunks whose draft KV a step leaves other than a one-step prefill would: all
        it computes if the drafter does not run (`skipped`), else the one holding the
        step's last position if the request's `known` tokens go on past it."""
        end, c = computed + scheduled, self.chunk_size
        if skipped:
            return range(computed // c, (end - 1) // c + 1)
        if self.impure_step_ends and end < known:
            return range((end - 1) // c, (end - 1) // c + 1)
        return range(0)
