"""The CPU demo: a 2-layer MoE (one dense layer, one with 4 experts) that learns single-digit
arithmetic by GRPO on 2 CPU cores in a few minutes.

Run it:  python scripts/rl.py --config=configs/tiny.py
Expect: 80 warm-start (SFT) steps, then 150 GRPO steps; reward_mean rises from about 0.2 to about
0.5 (see README for the measured curve).
Options: `configs/tiny.py:dense` swaps every MoE layer for a dense MLP.
"""

from meshrl.configs.loader import load_preset


def get_config(arg=None):
  config = load_preset("base")
  config.name = "tiny" if not arg else f"tiny_{arg}"
  config.model.num_layers = 2
  config.model.embed_dim = 128
  config.model.num_heads = 4
  config.model.num_kv_heads = 2
  config.model.head_dim = 32
  config.model.mlp_dim = 256
  config.model.max_seq_len = 64
  config.moe.num_experts = 4
  config.moe.num_experts_per_tok = 2
  config.moe.expert_mlp_dim = 128
  config.moe.first_k_dense = 1
  config.attention.impl = "reference"
  config.optim.learning_rate = 5e-4
  config.rl.num_steps = 150
  config.rl.prompts_per_step = 16
  config.rl.group_size = 8
  config.rl.num_minibatches = 4
  config.rl.max_prompt_len = 24
  config.rl.max_new_tokens = 12
  config.rl.sft_steps = 80  # short on purpose: RL starts from a policy that is right ~25% of the time
  config.data.seq_len = 64
  config.data.tasks = "arithmetic:1.0"
  config.checkpoint.every = 50
  if arg == "dense":
    config.moe.num_experts = 0
  elif arg:
    raise ValueError(f"configs/tiny.py takes no option {arg!r}; options: dense.")
  return config
