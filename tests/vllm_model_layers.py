"""What vLLM's own Gemma 4 model registers for each attention layer: the KV cache spec
its `Attention` returns and its KV-sharing target. An independent source for
tests/test_hf_layout.py (this package's `layer_specs` re-derives them from the config).

Run as a process of its own (it sets up vLLM's single-rank distributed state):
    python -m vllm_model_layers DTYPE BLOCK_SIZE MODEL_DIR...
prints {model dir: {layer name: {...}}} as JSON. The model is built on the meta device:
no weights are allocated, so real Gemma 4 shapes cost nothing."""

from __future__ import annotations

import json
import sys
import tempfile


def model_layers(model_dirs: list[str], dtype: str, block_size: int) -> dict:
    import torch
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (init_distributed_environment,
                                                 initialize_model_parallel)
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM

    out = {}
    for i, model in enumerate(model_dirs):
        vc = VllmConfig(model_config=ModelConfig(model=model, skip_tokenizer_init=True,
                                                 dtype=dtype, max_model_len=2048),
                        cache_config=CacheConfig(block_size=block_size))
        with set_current_vllm_config(vc):
            if i == 0:
                init_distributed_environment(
                    world_size=1, rank=0, local_rank=0, backend="gloo",
                    distributed_init_method=f"file://{tempfile.mktemp()}")
                initialize_model_parallel(1, 1)
            with torch.device("meta"):
                net = Gemma4ForCausalLM(vllm_config=vc, prefix="")
            layers = {}
            for name, mod in net.named_modules():
                if not isinstance(mod, Attention):
                    continue
                spec = mod.get_kv_cache_spec(vc)
                layers[mod.layer_name] = {
                    "spec": type(spec).__name__,
                    "window": getattr(spec, "sliding_window", None),
                    "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
                    "dtype": str(spec.dtype), "block_size": spec.block_size,
                    "target": mod.kv_sharing_target_layer_name}
        out[model] = layers
    return out


if __name__ == "__main__":
    dtype, block, *dirs = sys.argv[1:]
    json.dump(model_layers(dirs, dtype, int(block)), sys.stdout)
