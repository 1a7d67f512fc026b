"""A random-weight EAGLE3 draft checkpoint for the tiny Gemma 4 target of the tests.

vLLM's `LlamaForCausalLMEagle3` (llama_eagle3.py) reads the target's hidden states
(Gemma 4 implements SupportsEagle3) and owns its attention KV. With the target's
full-attention geometry (1 KV head of `global_head_dim`) its one layer's spec equals
the target's full-attention spec, so vLLM merges it into that group as one more layer;
with another head size it gets a group of its own. `load_format="dummy"` gives it
random weights like the target; embeddings and LM head are shared with the target.
"""

from __future__ import annotations


def tiny_eagle3_config(target, *, head_dim: int | None = None):
    """One-layer EAGLE3 llama draft for `target` (a Gemma4TextConfig)."""
    import transformers

    full = target.per_layer_config[-1]
    cfg = transformers.LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=2 * target.hidden_size, num_hidden_layers=1,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=full.num_key_value_heads,
        head_dim=head_dim or full.head_dim,
        max_position_embeddings=target.max_position_embeddings, rms_norm_eps=1e-6)
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.draft_vocab_size = target.vocab_size
    return cfg
