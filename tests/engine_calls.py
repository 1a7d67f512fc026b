"""collective_rpc targets the tests run inside an engine (the harness's
`{"call": "engine_calls:<name>"}` step; tests/ is on the engine's PYTHONPATH)."""

from __future__ import annotations


def perturb_weights(worker, name: str = "model.layers.0.self_attn.k_norm.weight",
                    seed: int = 7, scale: float = 0.5) -> float:
    """collective_rpc target: change one weight in place, as an RL weight update does
    (norm weights: on CPU, linear weights are repacked and their `.weight` is empty)."""
    import torch

    p = dict(worker.model_runner.model.named_parameters())[name]
    gen = torch.Generator().manual_seed(seed)
    p.data.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * scale)
    return float(p.data.abs().mean())


def forget_warm_launches(worker, to_chunk: bool = False) -> int:
    """collective_rpc target: drop the warm-up's launch signatures of one direction
    (False: loads), as if warm-up had skipped them. Returns how many were dropped."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    covered = get_kv_transfer_group()._worker.loads.transfer.launches.covered
    drop = {s for s in covered if ("TO_CHUNK", to_chunk) in s[1]}  # (arguments, constexprs)
    covered -= drop
    return len(drop)
