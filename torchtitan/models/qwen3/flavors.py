"""Qwen3 flavors: the published shapes (Hugging Face config.json of each release), plus small
debug models for CPU runs. `hidden_dim` is HF's intermediate_size, `moe_hidden_dim` its
moe_intermediate_size; every published Qwen3 has head_dim 128, RoPE theta 1e6 and RMSNorm eps
1e-6, and the three smallest tie the output projection to the embedding."""

from torchtitan.models.qwen3.model import Qwen3ModelArgs

_DEBUG = dict(dim=256, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048)
_TINY = dict(_DEBUG, dim=128, n_heads=16, n_kv_heads=8, head_dim=8)
# Published MoE releases: 128 experts, 8 chosen per token, probabilities renormalised.
_MOE = dict(num_experts=128, top_k=8, norm_topk_prob=True)

qwen3_configs = {
    "debugmodel": Qwen3ModelArgs(n_layers=8, hidden_dim=768, tie_word_embeddings=True, **_DEBUG),
    "debugmodel_moe": Qwen3ModelArgs(n_layers=4, num_experts=8, top_k=2, moe_hidden_dim=256, **_DEBUG),
    # The smallest models with every part a layout touches (llama3's `tiny` likewise): 2 blocks of
    # width 128, 16 query and 8 key/value heads, tensor and expert parallelism up to 8.
    "tiny": Qwen3ModelArgs(n_layers=2, hidden_dim=512, tie_word_embeddings=True, **_TINY),
    "tiny_moe": Qwen3ModelArgs(n_layers=2, num_experts=8, top_k=2, moe_hidden_dim=128, **_TINY),
    "0.6B": Qwen3ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, tie_word_embeddings=True),
    "1.7B": Qwen3ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=6144, tie_word_embeddings=True),
    "4B": Qwen3ModelArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=9728, tie_word_embeddings=True),
    "8B": Qwen3ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, hidden_dim=12288),
    "14B": Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, hidden_dim=17408),
    "32B": Qwen3ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, hidden_dim=25600),
    "30B-A3B": Qwen3ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, moe_hidden_dim=768, **_MOE),
    "235B-A22B": Qwen3ModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, moe_hidden_dim=1536, **_MOE),
}
