"""What the scheduler half tells the worker half each step (pickled by vLLM): the
step's jobs (`transfer.jobs`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ..transfer.jobs import FinishJob, LoadJob, SaveJob


@dataclass
class Gemma4KVMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    finished: list[FinishJob] = field(default_factory=list)
    num_tokens: int = 0
    """Tokens the step computes (the worker times the forward per token)."""
