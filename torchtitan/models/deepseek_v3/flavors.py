"""DeepSeek-V3 flavors: the published shapes (Hugging Face config.json of each release) plus small
debug models for CPU runs.

- `16B`: Moonlight-16B-A3B (Moonshot AI's DeepSeek-V3-architecture model: DeepSeek-V2-Lite's blocks
  with V3's sigmoid routing and a 163,840-token vocabulary): 16.0B parameters, 2.9B activated.
- `671B`: DeepSeek-V3 (and R1): 671B parameters, 37B activated, plus one MTP module (14B with the
  copies of the embedding and output projection DeepSeek's files store; here they are shared).
"""

from torchtitan.models.deepseek_v3.model import DeepSeekV3ModelArgs, YarnScaling

# DeepSeek-V3's routing: sigmoid scores, 8 groups of experts of which a token may use 4, weights x 2.5.
_V3_ROUTING = dict(score_func="sigmoid", n_group=8, topk_group=4, route_scale=2.5, norm_topk_prob=True)
# Debug shapes: every part of the model at a width a CPU trains in seconds. 8 experts in 4 groups
# (2 usable), 2 chosen; a compressed query; dense first blocks; one MTP depth.
_DEBUG = dict(dim=256, n_heads=8, hidden_dim=768, vocab_size=2048, q_lora_rank=64, kv_lora_rank=64,
              qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8, n_shared_experts=1, top_k=2,
              moe_hidden_dim=128, score_func="sigmoid", n_group=4, topk_group=2, route_scale=1.0)
# The smallest model with every part a layout touches (llama3's `tiny` likewise): width 128 with 16
# heads, 8 experts, so tensor and expert parallelism go to 8.
_TINY = dict(_DEBUG, dim=128, n_heads=16, hidden_dim=512, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8,
             qk_rope_head_dim=8, v_head_dim=8, moe_hidden_dim=128)

deepseek_v3_configs = {
    "debugmodel": DeepSeekV3ModelArgs(n_layers=4, n_dense_layers=2, mtp_depth=1, **_DEBUG),
    "tiny": DeepSeekV3ModelArgs(n_layers=2, n_dense_layers=1, mtp_depth=1, **_TINY),
    "16B": DeepSeekV3ModelArgs(dim=2048, n_layers=27, n_dense_layers=1, n_heads=16, hidden_dim=11264,
                               vocab_size=163840, q_lora_rank=0, kv_lora_rank=512, num_experts=64,
                               n_shared_experts=2, top_k=6, moe_hidden_dim=1408, score_func="sigmoid",
                               route_scale=2.446, norm_topk_prob=True, rope_theta=50000.0, norm_eps=1e-5),
    "671B": DeepSeekV3ModelArgs(dim=7168, n_layers=61, n_dense_layers=3, n_heads=128, hidden_dim=18432,
                                vocab_size=129280, q_lora_rank=1536, kv_lora_rank=512, num_experts=256,
                                n_shared_experts=1, top_k=8, moe_hidden_dim=2048, mtp_depth=1,
                                rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096),
                                **_V3_ROUTING),
}
