"""DeepSeek-V3 (deepseek-ai/DeepSeek-V3, config.json as published, without the multi-token-prediction
module): 671B parameters, 37B active per token; 61 blocks of width 7,168, multi-head latent attention
(128 heads, query rank 1,536, key/value rank 512, 128 + 64 rope dims, values 128), the first 3
blocks dense (SwiGLU 18,432), then 256 routed experts of width 2,048 (top-8, sigmoid scores, 8
groups of which 4 may be used, scaling 2.5) and one shared expert; aux-loss-free balancing; YaRN
RoPE (factor 40 over 4,096). Untied 129,280-token embeddings.

Built from the published numbers (no download); tests/configs/test_presets.py checks that
model/convert.py reads the same fields from the published config.json.

  python scripts/aot_compile.py --config=configs/deepseek_v3.py --topology=v5p:8x16x16 --step=update
Expect: 6.71e11 parameters, 3.7e10 active per token (--count_params).
Layout: fsdp=-1 x expert=64, bf16 compute, full remat, blockwise attention.
"""

from meshrl.configs.loader import load_preset


def set_architecture(config) -> None:
  """model.* / moe.* of DeepSeek-V3, as model/convert.py reads them from its config.json."""
  m, moe = config.model, config.moe
  m.vocab_size = 129_280
  m.num_layers = 61
  m.embed_dim = 7_168
  m.num_heads = 128
  m.num_kv_heads = 128
  m.head_dim = 192
  m.mlp_dim = 18_432
  m.max_seq_len = 163_840
  m.attention_type = "mla"
  m.qk_norm = False
  m.q_lora_rank = 1_536
  m.kv_lora_rank = 512
  m.qk_nope_head_dim = 128
  m.qk_rope_head_dim = 64
  m.v_head_dim = 128
  m.norm_eps = 1e-6
  m.rope_theta = 10_000.0
  m.rope_scaling = "yarn"
  m.rope_factor = 40.0
  m.rope_original_max_len = 4_096
  m.rope_beta_fast = 32.0
  m.rope_beta_slow = 1.0
  m.rope_mscale = 1.0
  m.rope_mscale_all_dim = 1.0
  m.rope_interleave = True
  m.tie_embeddings = False
  moe.num_experts = 256
  moe.num_experts_per_tok = 8
  moe.expert_mlp_dim = 2_048
  moe.num_shared_experts = 1
  moe.shared_expert_mlp_dim = 2_048
  moe.first_k_dense = 3
  moe.score_func = "sigmoid"
  moe.norm_topk_prob = True
  moe.routed_scaling_factor = 2.5
  moe.n_group = 8
  moe.topk_group = 4
  moe.aux_free_bias = True


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/deepseek_v3.py takes no option, got {arg!r}.")
  config = load_preset("base")
  config.name = "deepseek_v3"
  set_architecture(config)
  config.model.dtype = "bfloat16"
  config.model.remat = "full"
  config.attention.impl = "blockwise"
  config.attention.logits_chunk = 4_096
  config.moe.aux_loss_coef = 0.0001
  config.moe.z_loss_coef = 0.0
  config.mesh.fsdp = -1
  config.mesh.expert = 64
  config.optim.learning_rate = 1e-6
  config.optim.weight_decay = 0.01
  config.rl.prompts_per_step = 64
  config.rl.group_size = 16
  config.rl.num_minibatches = 4
  config.rl.max_prompt_len = 1_024
  config.rl.max_new_tokens = 7_168
  config.rl.sft_steps = 0
  config.rl.sft_batch_size = 256
  config.data.seq_len = 8_192
  config.data.difficulty = 4
  return config
