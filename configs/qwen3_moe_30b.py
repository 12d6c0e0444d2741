"""Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B, config.json as published): 30.5B parameters, 3.3B active per
token; 48 blocks of width 2,048, 32 query and 4 key/value heads of 128 with q/k RMSNorm, 128 routed
experts of width 768 (top-8, softmax, renormalised), untied 151,936-token embeddings.

Built from the published numbers, so it needs no download: compile it for a pod, or start from
random weights. To train the real checkpoint use configs/hf_qwen3_moe.py:/path/to/Qwen3-30B-A3B
(the same numbers, read from the folder's config.json; tests/configs/test_presets.py checks the two
agree field by field).

  python scripts/aot_compile.py --config=configs/qwen3_moe_30b.py --topology=v5p:4x4x4 --step=all
Expect: 3.05e10 parameters, 3.3e9 active per token (--count_params).
Layout: fsdp=-1 x expert=8 (16 experts per chip group), bf16 compute, full remat, blockwise attention.
"""

from meshrl.configs.loader import load_preset


def set_architecture(config) -> None:
  """model.* / moe.* of Qwen3-30B-A3B, as model/convert.py reads them from its config.json."""
  m, moe = config.model, config.moe
  m.vocab_size = 151_936
  m.num_layers = 48
  m.embed_dim = 2_048
  m.num_heads = 32
  m.num_kv_heads = 4
  m.head_dim = 128
  m.mlp_dim = 6_144
  m.max_seq_len = 40_960
  m.attention_type = "gqa"
  m.qk_norm = True
  m.norm_eps = 1e-6
  m.rope_theta = 1_000_000.0
  m.rope_scaling = "none"
  m.rope_interleave = False
  m.tie_embeddings = False
  moe.num_experts = 128
  moe.num_experts_per_tok = 8
  moe.expert_mlp_dim = 768
  moe.num_shared_experts = 0
  moe.first_k_dense = 0
  moe.score_func = "softmax"
  moe.norm_topk_prob = True
  moe.routed_scaling_factor = 1.0
  moe.n_group = 1
  moe.topk_group = 1
  moe.aux_free_bias = False


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/qwen3_moe_30b.py takes no option, got {arg!r}.")
  config = load_preset("base")
  config.name = "qwen3_moe_30b"
  set_architecture(config)
  config.model.dtype = "bfloat16"
  config.model.remat = "full"
  config.attention.impl = "blockwise"
  config.attention.logits_chunk = 4_096
  config.moe.aux_loss_coef = 0.001
  config.moe.z_loss_coef = 0.0
  config.mesh.fsdp = -1
  config.mesh.expert = 8
  config.optim.learning_rate = 1e-6
  config.optim.weight_decay = 0.01
  config.rl.prompts_per_step = 32
  config.rl.group_size = 8
  config.rl.num_minibatches = 4
  config.rl.max_prompt_len = 512
  config.rl.max_new_tokens = 2_048
  config.rl.sft_steps = 0
  config.rl.sft_batch_size = 64
  config.data.seq_len = 4_096
  config.data.difficulty = 4
  return config
