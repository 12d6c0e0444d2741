"""The model meshrl is built for: a 3.0T-parameter MoE (about 39B active per token) with a
1,048,576-token context on ring attention, laid out on a v5p 16x16x16 pod (4,096 chips).

Prove it fits without a pod (compile only, libtpu on a CPU):
  python scripts/aot_compile.py --config=configs/paper_3t.py --topology=v5p:16x16x16 --step=all \
      --json runs/aot_paper_3t.json --markdown runs/aot_paper_3t.md
Print its size:  python scripts/aot_compile.py --config=configs/paper_3t.py --count_params
Expect: 3.00e12 parameters, 3.9e10 active per token; docs/benchmarks.md's "Will it fit?" table gives the
bytes per chip of each step (and says which step does not fit yet, and why).

Architecture (GQA, not MLA: a decode step against a 1M-token MLA cache would expand the latent of
every slot into per-head keys and values): 60 blocks of width 8,192, 64 query heads and 8 key/value
heads of 128; the first 2 blocks dense (SwiGLU 28,672), the other 58 MoE blocks with 1,024 routed
experts of width 2,048 (top-8, sigmoid scores, group-limited routing over 8 groups as DeepSeek-V3)
and one shared expert. Untied 151,936-token embeddings (Qwen's tokenizer).

Layout on 4,096 chips: expert=64 (16 experts per chip) x sequence=64 (16,384 tokens per chip of a
1M-token sequence, ring attention with the zigzag layout). `embed` is split over sequence as well as
fsdp (`mesh.train_rules`), so every weight and optimizer moment is sharded over all 4,096 chips
(3T x 12 bytes / 4,096 = 8.8 GB per chip); activations stay split on batch (expert) and length
(sequence). A step of 64 sequences of 1,048,576 tokens (8 prompts x 8 samples): each chip holds one
sequence's 16,384-token slice. Full remat per block; bf16 compute, fp32 parameters and Adam moments.
Expert parallelism uses the capacity buffer (`moe.dispatch="capacity"`, factor 1.25 per destination
device): the dropless worst-case buffer would be P * n * K rows (64 x 16,384 x 8 of 8,192 values,
137 GB per chip). Ring attention's block pairs run on splash (`attention.local_kernel="auto"` on TPU,
model/splash_ring.py): the update needs 80.7 GiB per chip, the prefill 58.3, the SFT step 75.4 (with
the jnp block kernel, local_kernel="jnp": 78.5, 59.8, 71.7). Tokens travel by `ragged_all_to_all`
(`moe.ep_exchange="auto"` on TPU): with the jnp kernel the update needs 78.5 GiB per chip, against
80.45 with the fixed-buffer `all_to_all` (scripts/aot_compile.py --step=update, both; the receive
buffers are the same 163,840 rows either way); the SFT step 71.7 either way (77.2 with ragged until its receive buffers were typed as varying over the token axes,
model/expert_parallel.py). Both updates were 3-4 GiB
higher until the experts' outputs went back to their rows by a gather instead of a scatter, whose
gradient built id arrays the size of the rows (model/expert_parallel.inverse_permutation).
"""

from meshrl.configs.loader import load_preset

CONTEXT = 1_048_576  # tokens per sequence: prompt + response
RESPONSE = 8_192


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/paper_3t.py takes no option, got {arg!r}.")
  config = load_preset("base")
  config.name = "paper_3t"
  m = config.model
  m.vocab_size = 151_936
  m.num_layers = 60
  m.embed_dim = 8_192
  m.num_heads = 64
  m.num_kv_heads = 8
  m.head_dim = 128
  m.mlp_dim = 28_672
  m.max_seq_len = CONTEXT
  m.qk_norm = True
  m.rope_theta = 10_000_000.0
  m.tie_embeddings = False
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat = "full"
  moe = config.moe
  moe.num_experts = 1_024
  moe.num_experts_per_tok = 8
  moe.expert_mlp_dim = 2_048
  moe.num_shared_experts = 1
  moe.shared_expert_mlp_dim = 2_048
  moe.first_k_dense = 2
  moe.score_func = "sigmoid"
  moe.routed_scaling_factor = 2.5
  moe.n_group = 8
  moe.topk_group = 4
  moe.dispatch = "capacity"
  moe.capacity_factor = 1.25
  moe.ep_exchange = "auto"  # ragged_all_to_all on TPU (module docstring)
  moe.aux_loss_coef = 0.0001
  moe.aux_free_bias = True
  config.attention.impl = "ring"
  config.attention.block_q = 2_048
  config.attention.block_kv = 1_024
  config.attention.logits_chunk = 8_192
  config.mesh.data = 1
  config.mesh.fsdp = 1
  config.mesh.expert = 64
  config.mesh.sequence = 64
  config.mesh.tensor = 1
  config.mesh.train_rules = "embed=fsdp,sequence"
  config.optim.learning_rate = 1e-6
  config.optim.weight_decay = 0.01
  config.rl.prompts_per_step = 8
  config.rl.group_size = 8
  config.rl.num_minibatches = 1
  config.rl.max_prompt_len = CONTEXT - RESPONSE
  config.rl.max_new_tokens = RESPONSE
  config.rl.sft_steps = 0
  config.rl.sft_batch_size = 64
  config.data.seq_len = CONTEXT
  config.checkpoint.every = 10
  return config
