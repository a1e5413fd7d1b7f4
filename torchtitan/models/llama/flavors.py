"""Llama 2 and Llama 3 flavors: the published shapes, plus small debug models for CPU runs."""

from torchtitan.models.llama.model import ModelArgs, RopeScaling

llama2_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16),
    "tiny": ModelArgs(dim=128, n_layers=2, n_heads=16, n_kv_heads=8),  # as llama3's `tiny`
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32),
    "13B": ModelArgs(dim=5120, n_layers=40, n_heads=40),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
}

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rope_scaling=RopeScaling())
# Llama 3.2's small models tie the output projection to the embedding and scale RoPE by 32.
_LLAMA32 = dict(_LLAMA3, rope_scaling=RopeScaling(factor=32.0), tie_word_embeddings=True)
llama3_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16, **_LLAMA3),
    "debugmodel_tied": ModelArgs(dim=256, n_layers=8, n_heads=16, **_LLAMA32),
    # The smallest model with every part a layout touches: grouped-query attention (16 query, 8
    # key/value heads), tensor parallelism up to 8, a pipeline of 2 stages. A run of it costs about
    # a quarter of the debug model's, so smoke tests (and this project's test suite) train it.
    "tiny": ModelArgs(dim=128, n_layers=2, n_heads=16, n_kv_heads=8, **_LLAMA3),
    "tiny_tied": ModelArgs(dim=128, n_layers=2, n_heads=16, n_kv_heads=8, **_LLAMA32),
    # About 100M parameters with the bundled tokenizer (the vocabulary always comes from the
    # tokenizer: with Llama 3's 128K tokens it is 0.3B): a CPU-sized model of real proportions,
    # for memory estimates checked against real runs (docs/memory.md) and benchmarks.
    "100M": ModelArgs(dim=768, n_layers=16, n_heads=12, n_kv_heads=4, multiple_of=256, **_LLAMA3),
    # A CPU benchmark of realistic proportions (head_dim 64, as the published models): where matmuls,
    # not per-op overheads, should dominate a step (docs/performance.md).
    "bench1k": ModelArgs(dim=1024, n_layers=8, n_heads=16, **_LLAMA3),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256, **_LLAMA32),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256, **_LLAMA32),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024, **_LLAMA3),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096, **_LLAMA3),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096, **_LLAMA3),
}
