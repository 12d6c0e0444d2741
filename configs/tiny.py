"""The CPU demo: a 2-layer MoE (one dense layer, one with 4 experts) that learns to reverse
three-letter words ("rev abc=" -> "cba") by GRPO on 2 CPU cores in a few minutes.

Run it:  python scripts/rl.py --config=configs/tiny.py
Expect: 52 warm-start (SFT) steps leave the policy right on about 40% of held-out prompts (greedy);
100 GRPO steps take it above 90% (docs/benchmarks.md has the measured curve). Held-out prompts are the
words training never sees (data.eval_fraction of the 17,576, by hash).

Why this task and recipe: single-digit arithmetic has ~150 distinct prompts, so a held-out split is
~30 prompts whose answers a 2-layer model can only memorise, not derive; reversal is an algorithm,
so held-out accuracy measures what RL taught. Sampling at temperature 0.7 keeps the warm start's
rollouts informative (at 1.0 its samples are almost all wrong and RL degrades the greedy policy).
Options: `configs/tiny.py:dense` swaps every MoE layer for a dense MLP; `configs/tiny.py:peer` is
the shape issue 9 measures the JAX peers at (4 layers, width 256, 8/4 heads x 32, 8 experts top-2 x
512, 8 prompts x 4 samples, 16 + 64 tokens, GRPO with a KL term, one minibatch): run it with
`python scripts/bench_rl.py --cpu_devices=2 --config=configs/tiny.py:peer --json PATH`.
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
  config.optim.learning_rate = 3e-4
  config.rl.num_steps = 100
  config.rl.prompts_per_step = 16
  config.rl.group_size = 8
  config.rl.num_minibatches = 4
  config.rl.max_prompt_len = 16
  config.rl.max_new_tokens = 8
  config.rl.temperature = 0.7
  config.rl.sft_steps = 52  # short on purpose: RL starts from a policy that is right ~40% of the time
  config.data.seq_len = 64
  config.data.tasks = "reverse:1.0"
  config.eval.every = 20
  config.eval.num_prompts = 200
  config.checkpoint.every = 50
  if arg == "dense":
    config.moe.num_experts = 0
  elif arg == "peer":
    _peer_shape(config)
  elif arg:
    raise ValueError(f"configs/tiny.py takes no option {arg!r}; options: dense, peer.")
  return config


def _peer_shape(config):
  """The shape issue 9 times Tunix at, in place: model, batch and GRPO-with-KL step."""
  config.model.num_layers = 4
  config.model.embed_dim = 256
  config.model.num_heads = 8
  config.model.num_kv_heads = 4
  config.model.head_dim = 32
  config.model.max_seq_len = 128
  config.moe.num_experts = 8
  config.moe.num_experts_per_tok = 2
  config.moe.expert_mlp_dim = 512
  config.moe.first_k_dense = 0
  config.rl.prompts_per_step = 8
  config.rl.group_size = 4
  config.rl.num_minibatches = 1
  config.rl.max_prompt_len = 16
  config.rl.max_new_tokens = 64
  config.rl.kl_coef = 0.01
  config.rl.dynamic_sampling = False
  config.mesh.fsdp = 2
