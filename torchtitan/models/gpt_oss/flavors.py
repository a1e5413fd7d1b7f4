"""gpt-oss flavors: the published shapes (Hugging Face config.json of openai/gpt-oss-20b and
-120b), plus small debug models for CPU runs.

Both releases: width 2880, 64 query and 8 key/value heads of 64 dims, a 128-position window on the
even blocks, 4 experts of width 2880 chosen per token, the o200k_harmony vocabulary (201,088 rows),
YaRN RoPE (theta 150,000, factor 32 over 4,096 positions). They differ in depth and experts: 24
blocks of 32 experts (20B) and 36 blocks of 128 (120B).

Published parameter counts (OpenAI's gpt-oss model card): 20.91B total and 3.61B activated per
token for 20B, 116.83B and 5.13B for 120B; the activated counts include the output projection
(unembedding) but not the embedding lookup. tests/unit_tests/test_gpt_oss_model.py checks the
meta-device models against them.
"""

from torchtitan.models.gpt_oss.model import GptOssModelArgs

# The debug models keep every feature: banded and full blocks (window shorter than the test
# sequences), sinks, biases, clamped SwiGLU experts, YaRN.
_DEBUG = dict(dim=256, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048, sliding_window=16,
              moe_hidden_dim=256)
# The smallest model every layout of the matrix can cut: 2 blocks (one banded, one full) of width
# 128, 16 query and 8 key/value heads (tensor parallelism up to 8), 8 experts (expert parallelism up to 8).
_TINY = dict(_DEBUG, dim=128, n_heads=16, n_kv_heads=8, head_dim=8, moe_hidden_dim=128, sliding_window=8)

gpt_oss_configs = {
    "debugmodel": GptOssModelArgs(n_layers=4, num_experts=8, top_k=2, **_DEBUG),
    "tiny": GptOssModelArgs(n_layers=2, num_experts=8, top_k=2, **_TINY),
    "20B": GptOssModelArgs(n_layers=24, num_experts=32),
    "120B": GptOssModelArgs(n_layers=36, num_experts=128),
}
