"""What a hit is worth before anything has been measured: the prefill time of the tokens
it adds, estimated from the model's FLOPs and the device's rate (`lookup.wait` uses it
until the engine has timed its own prefill steps).

On a CPU there is no useful datasheet rate (cores, AVX width, memory bandwidth and
other tenants decide it): there the first measured prefill (`wait.Rates.prefill`), or
one an earlier engine of the same fingerprint persisted on this host
(`rate_file.RateFile`), is the prior, and this module answers None.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout.groups import KVLayout

DENSE_BF16_FLOPS = {"H200": 989e12, "H100": 989e12,
                    "A100": 312e12, "L40S": 362e12, "L4": 121e12}
"""Dense BF16 tensor-core peaks from NVIDIA's datasheets (SXM parts; no sparsity), by a
substring of `torch.cuda.get_device_name`. Longer names are tried first."""
PEAK_FRACTION = 0.5
"""Share of the peak a prefill is assumed to reach. Conservative (prefill of long
prompts usually reaches less: docs/scale-out.md's 31B shape, 8K tokens, 1.6 s on an
H200, is about a third): the prior then undervalues a hit rather than overvalues it,
so a wait it allows is never longer than recomputing would take."""


@dataclass(frozen=True)
class ModelShape:
    """What the prefill FLOPs depend on: per decoder layer (query width = query heads x
    head size, window or None), and the non-embedding weights."""

    layers: tuple[tuple[int, int | None], ...]
    params: int


def model_shape(hf_text_config, layout: KVLayout) -> ModelShape:
    """The shape of the model vLLM serves, from its text config (hidden size, MLP width,
    query heads) and the KV layout (per layer its head size, KV heads and window; layers
    that read another's KV count as that layer). Weights per layer: the q, k, v and o
    projections and a gated MLP (3 matrices); norms and biases are left out (small), a
    mixture of experts counts as its dense `intermediate_size` MLP only."""
    hidden = int(hf_text_config.hidden_size)
    mlp = int(getattr(hf_text_config, "intermediate_size", 0) or 0)
    heads = int(hf_text_config.num_attention_heads)
    layers, params = [], 0
    for g in layout.groups:
        own = [n for n in g.layers if n not in g.draft_layers]
        for _ in range(len(own) + len(g.aliases)):
            q = heads * g.head_size
            kv = g.num_kv_heads * (g.head_size + g.head_size_v)
            params += hidden * (2 * q + kv) + 3 * hidden * mlp
            layers.append((q, g.window))
    return ModelShape(tuple(layers), params)


def _attended(n: int, window: int | None) -> int:
    """Keys attended by the queries at positions 0..n-1 together (causal; a sliding
    window of W lets each see at most W)."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def prefill_flops(shape: ModelShape, start: int, tokens: int) -> int:
    """FLOPs to prefill tokens [start, start + tokens) after `start` cached ones:
    2 per weight per token (one multiply-add; Kaplan et al. 2020, "Scaling Laws for
    Neural Language Models", C_forward ~ 2N), plus per layer 4 x query width per
    (query, key) pair it attends (QK^T and the weighted sum of V, a multiply-add each)."""
    end = start + tokens
    attention = sum(4 * q * (_attended(end, w) - _attended(start, w)) for q, w in shape.layers)
    return 2 * shape.params * tokens + attention


def device_flops(device) -> float | None:
    """A rate the device reaches in prefill (`PEAK_FRACTION` of its datasheet peak), or
    None where none is known (CPUs; GPUs not in `DENSE_BF16_FLOPS`)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(DENSE_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FRACTION * DENSE_BF16_FLOPS[key]
    return None


def prefill_prior(shape: ModelShape, flops_per_s: float | None):
    """(start, tokens) -> estimated prefill seconds, or None without a device rate."""
    if not flops_per_s or flops_per_s <= 0:
        return None
    return lambda start, tokens: prefill_flops(shape, start, tokens) / flops_per_s
