"""A real single-host run on a TPU v5e-8 (8 chips of 16 GB): GRPO from scratch on a 0.8B-parameter
MoE (about 0.2B active), byte tokenizer, reversal and arithmetic tasks with a short supervised warm
start.

Run it on the TPU VM:
  python scripts/rl.py --config=configs/v5e_8.py
Check first that it fits (compile only, from any CPU with libtpu):
  python scripts/aot_compile.py --config=configs/v5e_8.py --topology=v5e:2x4 --step=all
Layout: fsdp=4 x expert=2 over the 8 chips; bf16 compute, fp32 parameters and Adam moments,
blockwise attention, remat of everything but the attention outputs.
"""

from meshrl.configs.loader import load_preset


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/v5e_8.py takes no option, got {arg!r}.")
  config = load_preset("base")
  config.name = "v5e_8"
  m = config.model
  m.num_layers = 16
  m.embed_dim = 1_024
  m.num_heads = 16
  m.num_kv_heads = 4
  m.head_dim = 64
  m.mlp_dim = 2_816
  m.max_seq_len = 1_024
  m.qk_norm = True
  m.tie_embeddings = True
  m.dtype = "bfloat16"
  m.remat = "save_attention"
  moe = config.moe
  moe.num_experts = 32
  moe.num_experts_per_tok = 4
  moe.expert_mlp_dim = 512
  moe.first_k_dense = 1
  config.attention.impl = "blockwise"
  config.mesh.fsdp = 4
  config.mesh.expert = 2
  config.optim.learning_rate = 3e-5
  config.optim.warmup_steps = 10
  config.rl.num_steps = 500
  config.rl.prompts_per_step = 64
  config.rl.group_size = 8
  config.rl.num_minibatches = 4
  config.rl.max_prompt_len = 64
  config.rl.max_new_tokens = 64
  config.rl.temperature = 0.8
  config.rl.sft_steps = 300
  config.rl.sft_learning_rate = 3e-4
  config.rl.sft_batch_size = 64
  config.data.seq_len = 256
  config.data.tasks = "reverse:1.0,arithmetic:1.0"
  config.eval.every = 50
  config.checkpoint.every = 50
  return config
