"""Every field of a meshrl run, with its default and a one-line comment.

Presets (tiny.py, ...) start from `get_config()`, change what differs, and are locked by the loader, so
a misspelt override fails with the key's name. Print a resolved config with
  python scripts/show_config.py --config=configs/base.py
A preset may be picked through this file too: `--config=configs/base.py:tiny`.
"""

import ml_collections


def get_config(arg=None):
  """Returns the base config, or the preset named by `arg` (`configs/base.py:tiny`)."""
  if arg:
    from meshrl.configs import load_preset  # pylint: disable=import-outside-toplevel
    return load_preset(arg)
  config = ml_collections.ConfigDict()
  config.name = "base"  # Run name; shows in logs and the work directory.
  config.seed = 0  # Seed for parameter init, data order and sampling.
  config.workdir = "runs/{name}"  # Outputs (config.json, metrics, checkpoints); {name} is filled in.

  # --- mesh: the one device mesh (sharding/mesh.py). At most one size may be -1 (takes the rest).
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = 1  # Pure data parallelism (replicated params); multi-slice DCN runs on this axis.
  config.mesh.fsdp = -1  # Data parallelism with params sharded (ZeRO-3).
  config.mesh.expert = 1  # Expert parallelism for MoE layers.
  config.mesh.sequence = 1  # Context parallelism (ring attention over the sequence).
  config.mesh.tensor = 1  # Tensor parallelism over heads and MLP columns.
  config.mesh.num_slices = 1  # TPU slices joined over DCN (>1 builds a hybrid ICI/DCN mesh).
  config.mesh.stage = 1  # Pipeline stages of the whole mesh (not per slice): each holds num_layers / stage blocks; across slices first when num_slices > 1 (model/pipeline.py).
  config.mesh.microbatches = 0  # Pipeline microbatches per forward (dividing each batch shard's rows); 0 = auto (the most up to 4 x stage), 1 with stage = 1.
  config.mesh.train_rules = ""  # Overrides of TRAIN_RULES, e.g. "embed=fsdp;vocab=none".
  config.mesh.rollout_rules = ""  # Overrides of ROLLOUT_RULES, same syntax.

  # --- model: the decoder transformer (model/).
  config.model = ml_collections.ConfigDict()
  config.model.vocab_size = 259  # Vocabulary size (byte tokenizer: 256 bytes + bos, eos, pad).
  config.model.num_layers = 4  # Transformer blocks (dense and MoE together).
  config.model.embed_dim = 256  # Width of the residual stream.
  config.model.num_heads = 4  # Query heads.
  config.model.num_kv_heads = 2  # Key/value heads (grouped-query attention); divides num_heads.
  config.model.head_dim = 64  # Per-head width for GQA.
  config.model.mlp_dim = 512  # Hidden width of dense SwiGLU MLPs.
  config.model.max_seq_len = 512  # Longest sequence the model accepts (prompt + response).
  config.model.attention_type = "gqa"  # "gqa" or "mla" (multi-head latent attention).
  config.model.qk_norm = False  # RMSNorm on queries and keys per head (Qwen3).
  config.model.q_lora_rank = 0  # MLA: rank of the query down-projection; 0 = no query compression.
  config.model.kv_lora_rank = 64  # MLA: rank of the compressed key/value latent.
  config.model.qk_nope_head_dim = 32  # MLA: per-head query/key width without RoPE.
  config.model.qk_rope_head_dim = 16  # MLA: per-head query/key width carrying RoPE (key part shared).
  config.model.v_head_dim = 32  # MLA: per-head value width.
  config.model.rope_theta = 10000.0  # RoPE base frequency.
  config.model.rope_scaling = "none"  # Long-context RoPE scaling: "none", "linear" or "yarn".
  config.model.rope_factor = 1.0  # Context extension factor for linear / YaRN scaling.
  config.model.rope_original_max_len = 4096  # YaRN: pretraining context length.
  config.model.rope_beta_fast = 32.0  # YaRN: rotations above which frequencies are kept.
  config.model.rope_beta_slow = 1.0  # YaRN: rotations below which frequencies are interpolated.
  config.model.rope_mscale = 1.0  # YaRN / DeepSeek: attention-scale multiplier coefficient.
  config.model.rope_mscale_all_dim = 0.0  # DeepSeek YaRN: mscale_all_dim (0 = unused).
  config.model.rope_interleave = False  # Rotate interleaved pairs (DeepSeek) instead of halves.
  config.model.norm_eps = 1e-6  # RMSNorm epsilon.
  config.model.tie_embeddings = True  # Share the input embedding with the LM head.
  config.model.value_head = False  # Add a scalar value head (PPO critic).
  config.model.dtype = "float32"  # Activation/compute dtype: "float32" or "bfloat16".
  config.model.param_dtype = "float32"  # Parameter storage dtype.
  config.model.remat = "none"  # Rematerialisation: "none", "full", "save_attention", "save_dots".
  config.model.scan_layers = True  # Stack blocks and lax.scan over them (one compiled block).
  config.model.decode_layers = "auto"  # Generation loops: "scan" the stacked blocks, or "unrolled" on per-layer weights taken once per loop (a copy of the blocks' weights; no per-step slice copies); "auto": unrolled on CPU.
  config.model.init_std = 0.02  # Std of the normal initialiser of weights.
  config.model.init_from = ""  # "" = random init; or a Hugging Face dir (Qwen3-MoE, DeepSeek-V3) or a meshrl checkpoint.
  config.model.tokenizer = "byte"  # "byte", or a tokenizer.json or a dir holding one (and its chat template).

  # --- moe: mixture-of-experts layers (model/moe.py).
  config.moe = ml_collections.ConfigDict()
  config.moe.num_experts = 8  # Routed experts per MoE layer; 0 makes every layer dense.
  config.moe.num_experts_per_tok = 2  # Top-k experts per token.
  config.moe.expert_mlp_dim = 256  # Hidden width of each routed expert.
  config.moe.num_shared_experts = 0  # Always-on shared experts (DeepSeek); 0 = none.
  config.moe.shared_expert_mlp_dim = 256  # Hidden width of one shared expert.
  config.moe.first_k_dense = 0  # The first k layers use a dense MLP instead of MoE.
  config.moe.score_func = "softmax"  # Router scores: "softmax" or "sigmoid".
  config.moe.norm_topk_prob = True  # Renormalise the top-k weights to sum to one.
  config.moe.routed_scaling_factor = 1.0  # Multiplies the routed experts' output (DeepSeek-V3).
  config.moe.n_group = 1  # Group-limited routing: expert groups (1 = off).
  config.moe.topk_group = 1  # Group-limited routing: groups a token may use.
  config.moe.dispatch = "auto"  # "auto" (fastest exact one per backend and phase), "dropless" (sort +
  # ragged_dot), "buffered", "blocks", "dense", "gather" (all exact) or "capacity" (drops overflow).
  config.moe.capacity_factor = 1.25  # Rows per expert = factor * tokens * k / experts: the capacity
  # buffer (overflow dropped) and the buffered fast path (overflow falls back to blocks, not dropped).
  config.moe.ep_exchange = "auto"  # Expert-parallel token exchange: "all_to_all" (fixed buffers), "ragged"
  # (ragged_all_to_all, TPU only; an error on CPU) or "auto" (ragged on TPU for training and prefill; all_to_all for decode steps and elsewhere).
  config.moe.ep_weights = "auto"  # Expert parallelism: "sharded" (expert weights never gathered; activations
  # move, fsdp x larger), "gathered" (each layer gathers its experts' D over fsdp, as FSDP does) or "auto"
  # (per call, whichever moves/holds fewer bytes for its static shapes: expert_parallel.ep_weight_bytes).
  config.moe.aux_loss_coef = 0.01  # Switch-style load-balancing loss weight.
  config.moe.z_loss_coef = 0.001  # Router z-loss weight.
  config.moe.aux_free_bias = False  # DeepSeek-V3 aux-loss-free balancing bias (state, not a param).
  config.moe.bias_update_rate = 0.001  # Step of the aux-loss-free bias update per training step.

  # --- attention: which kernel computes softmax attention (model/attention.py).
  config.attention = ml_collections.ConfigDict()
  config.attention.impl = "reference"  # "reference", "blockwise" or "ring".
  config.attention.block_q = 512  # Blockwise/ring: query block length.
  config.attention.block_kv = 256  # Blockwise/ring: key/value block length (512x256 is fastest here).
  config.attention.zigzag = True  # Ring: lay the sequence out zigzag for causal load balance.
  config.attention.local_kernel = "auto"  # Blockwise self-attention compute: "jnp", "splash" (Pallas; interpret mode off TPU) or "auto" (splash on TPU).
  config.attention.logits_chunk = 0  # Chunked vocab projection + loss (SFT, RL update): tokens per chunk (0 = off).

  # --- optim: the optimiser (train/optim.py).
  config.optim = ml_collections.ConfigDict()
  config.optim.name = "adamw"  # "adamw", "adam", "sgd" or "adafactor".
  config.optim.learning_rate = 1e-4  # Peak learning rate.
  config.optim.schedule = "constant"  # "constant", "cosine" or "linear" decay after warmup.
  config.optim.warmup_steps = 0  # Linear warmup steps.
  config.optim.decay_steps = 1000  # Steps of the decay after warmup (cosine/linear).
  config.optim.end_lr_ratio = 0.1  # Final learning rate as a fraction of the peak.
  config.optim.b1 = 0.9  # Adam beta1.
  config.optim.b2 = 0.95  # Adam beta2.
  config.optim.eps = 1e-8  # Adam epsilon.
  config.optim.weight_decay = 0.0  # Decoupled weight decay.
  config.optim.grad_clip = 1.0  # Global-norm gradient clipping (0 = off).
  config.optim.grad_accum_steps = 1  # Micro-batches accumulated per optimiser step.
  config.optim.grad_collective_dtype = "float32"  # Gradients' reduce-scatter / all-reduce over the batch axes: "float32" (as computed), "bfloat16", or "int8" (per-block scales, error feedback) (sharding/compress.py).

  # --- rl: the GRPO / PPO loop (rl/).
  config.rl = ml_collections.ConfigDict()
  config.rl.num_steps = 100  # RL steps (one rollout batch and its updates each).
  config.rl.prompts_per_step = 8  # Distinct prompts per rollout batch.
  config.rl.group_size = 8  # Samples per prompt (GRPO group); >= 2 for group-relative estimators.
  config.rl.max_prompt_len = 64  # Prompt budget in tokens.
  config.rl.prompt_overflow = "truncate"  # Prompts over budget: "truncate" (left) or "reject".
  config.rl.max_new_tokens = 32  # Response budget in tokens.
  config.rl.temperature = 1.0  # Sampling temperature (0 = greedy).
  config.rl.top_k = 0  # Top-k sampling (0 = off).
  config.rl.top_p = 1.0  # Nucleus sampling (1 = off).
  config.rl.stop_tokens = ""  # Extra stop token ids, comma separated (eos always stops).
  config.rl.engine = "static"  # Rollout: "static" (one batch until its longest sample ends) or "continuous" (decode slots refilled as samples end; multi-turn: no episode waits for another; rl/generation).
  config.rl.decode_slots = 0  # Continuous engine: decode slots (0 = one per sample of the step's batch).
  config.rl.rollout_token_budget = 0  # Continuous engine: tokens per RL step (decode_slots x steps); unfinished groups (and episodes, with their environments) carry over (0 = off).
  config.rl.speculative = "none"  # Speculative decoding (any engine, multi-turn included; the samples equal plain decoding's): "none", "draft" (a small model) or "ngram" (prompt lookup).
  config.rl.speculative_k = 4  # Speculative decoding: tokens proposed per target forward (>= 1).
  config.rl.ngram_n = 3  # N-gram speculation: length of the suffix looked up in the row's context.
  config.rl.draft_config = ""  # Draft model for rl.speculative="draft": "path[:arg];a.b=value;..." (same vocab as the target).
  config.rl.draft_checkpoint = ""  # Draft params: a meshrl checkpoint / work dir of rl.draft_config's model (scripts/distill_draft.py writes one).
  config.rl.kv_cache_dtype = "model"  # Generation KV cache: "model" (model.dtype) or "int8" (per-token, per-head scales; model/quant.py).
  config.rl.prefill_chunk = 0  # Chunked prefill: prompts prefilled this many tokens at a time, between the other slots' decode steps (0 = one pass; rl/generation/core.py).
  config.rl.kv_host_bytes = 0  # Tiered KV cache: bytes of host memory for the cache rows of paused episodes (waiting on their environment) moved off the devices (0 = none; rl/generation/tiers.py).
  config.rl.generation_weights = "full"  # Generation matmul weights: "full" or "int8" (per-channel; needs rl.tis_level != "none").
  config.rl.generation_layout = "train"  # Generation weight layout: "train" (the update's arrays, FSDP-gathered at every decode step) or "gathered" (resharded once per rollout to tensor/expert only; sharding/rules.generation_shardings).
  config.rl.advantage = "grpo"  # "grpo", "dr_grpo", "rloo", "reinforce_pp" or "gae".
  config.rl.adv_eps = 1e-6  # Epsilon added to the group std.
  config.rl.policy_loss = "ppo"  # "ppo" (token-level ratio) or "gspo" (sequence-level ratio).
  config.rl.clip_low = 0.2  # Lower clip range of the ratio (1 - clip_low).
  config.rl.clip_high = 0.28  # Upper clip range of the ratio (1 + clip_high; DAPO clip-higher).
  config.rl.dual_clip = 0.0  # Dual-clip constant c (> 1 enables) for negative advantages.
  config.rl.loss_agg = "token_mean"  # "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant_norm".
  config.rl.kl_coef = 0.0  # Weight of the KL to the reference policy (0 = no reference kept).
  config.rl.kl_estimator = "k3"  # "k1", "k2" or "k3".
  config.rl.kl_in_reward = False  # Put the KL in the reward as a per-token penalty instead of the loss.
  config.rl.entropy_coef = 0.0  # Entropy bonus weight.
  config.rl.value_coef = 0.5  # Critic loss weight (advantage = "gae").
  config.rl.value_clip = 0.2  # Clip range of the value loss.
  config.rl.gamma = 1.0  # GAE discount.
  config.rl.gae_lambda = 1.0  # GAE lambda.
  config.rl.epochs = 1  # Passes over each rollout batch (sample reuse).
  config.rl.replay_routing = True  # Update replays the experts the rollout chose (MoE stability).
  config.rl.num_minibatches = 1  # Minibatches per epoch.
  config.rl.pack_updates = False  # Update on trajectories packed into rows with segment ids (rl/batches/packing.py).
  config.rl.packed_row_len = 0  # Packed update: tokens per row (0 = max_prompt_len + max_new_tokens).
  config.rl.packed_rows = 0  # Packed update: rows per batch, static; must hold every step's tokens (0 = one per sample).
  config.rl.packed_row_buckets = 1  # Packed update: a step takes the fewest of n row counts that hold its kept samples (one compile each), spaced by packed_row_spacing.
  config.rl.packed_row_spacing = "halve"  # The n row counts: "halve" (packed_rows, /2, ... /2^(n-1)) or "even" (packed_rows * k / n, k = 1..n).
  config.rl.tis_level = "none"  # Truncated importance weights vs the behaviour policy: "none", "token", "sequence".
  config.rl.tis_cap = 2.0  # Truncation cap of the importance weights (>= 1).
  config.rl.max_staleness = 0  # Asynchronous RL: rollouts generated up to this many updates ahead (0 = synchronous).
  config.rl.dynamic_sampling = True  # Drop groups whose rewards are all equal and refill (DAPO).
  config.rl.max_resample_rounds = 2  # Dynamic sampling: extra rollout rounds to refill a batch.
  config.rl.retry_unsolved = 0  # Prompts with no success in their group are sampled again (a new group) up to this many times (0 = off); the batch keeps its shape.
  config.rl.retry_share = 0.5  # Most share of a rollout round's prompts that are such retries, in (0, 1].
  config.rl.replay_groups = 0  # Groups with a verified success kept (host memory) and replayed, with their behaviour log-probs, in places dynamic sampling leaves empty (0 = off).
  config.rl.rft_every = 0  # Rejection-sampling fine-tuning: after every this many RL steps, SFT steps on the run's own verified successes (0 = off).
  config.rl.rft_steps = 4  # Rejection-sampling fine-tuning: SFT steps per round (rl.sft_batch_size rows of data.seq_len).
  config.rl.rft_bank = 256  # Rejection-sampling fine-tuning: distinct (prompt, verified response) pairs kept, the newest.
  config.rl.rft_learning_rate = 3e-4  # Rejection-sampling fine-tuning: peak learning rate (a fresh optimizer state per round).
  config.rl.overlong_buffer = 0  # Overlong shaping: penalty ramps over the last N tokens (0 = off).
  config.rl.overlong_penalty = 1.0  # Overlong shaping: penalty at the budget.
  config.rl.rewards = "answer:1.0"  # Reward functions and weights: "name:weight,..." (rl/rewards).
  config.rl.reward_workers = 8  # Threads scoring a batch's rewards concurrently (rl/rewards/pool.py).
  config.rl.reward_timeout_s = 30.0  # Per-sample reward time limit; a sample past it scores 0 (counted).
  config.rl.reward_sources = ""  # Per domain (rl/rewards/sources.py): "domain=source:weight,...;...", source verifier (rl.rewards), reward_model or judge; "*" = every other domain; "" = verifier everywhere.
  config.rl.reward_norm = "none"  # "domain": whiten rewards within each domain of a batch (sources on other scales weigh alike); "none": as scored.
  config.rl.reward_model_checkpoint = ""  # A reward model (scripts/train_rm.py's work directory, or a Qwen3MoeForSequenceClassification folder) for the reward_model source.
  config.rl.rm_length_penalty = 0.0  # Subtracted from a reward-model score per response token (>= 0; a guard against rewarding length).
  config.rl.rm_binarize = False  # Reward 1 when the reward model's score is above the threshold calibrated on its held-out pairs (calibration.json beside it), else 0: a learned verifier (train/rm_calibration.py).
  config.rl.rm_length_normalize = False  # Divide a reward-model score by the response's tokens (a guard against rewarding length).
  config.rl.judge_checkpoint = ""  # A policy-shaped judge model (meshrl checkpoint or Hugging Face causal LM folder) for the judge source.
  config.rl.judge_rubrics = ""  # Rubric files per domain, "domain=path;*=path": text with {prompt}, {response} and the verdict format "Score: N".
  config.rl.judge_max_score = 10  # The top of the judge's scale; a verdict "Score: N" gives N / judge_max_score, a malformed one 0 (counted).
  config.rl.judge_prompt_len = 512  # Tokens of a judge prompt (rubric, prompt and response; longer ones keep their last tokens, counted).
  config.rl.judge_max_tokens = 16  # Tokens the judge may write for its verdict (greedy).
  config.rl.max_nonfinite_steps = 3  # Stop, checkpointed, after this many all-non-finite steps in a row (0 = never).
  config.rl.sft_steps = 200  # Supervised warm-start steps before RL (0 = none).
  config.rl.sft_learning_rate = 1e-3  # Warm-start learning rate.
  config.rl.sft_batch_size = 16  # Warm-start sequences per step.
  config.rl.sft_difficulty = ""  # Warm-start levels of the generated domains: "1", or a mix "1:0.95,2:0.05", or per domain "copy=1:1,2:0.8;*=1:1,2:0.03" ("*": the others; "" = the RL's own: data.difficulty or each data.domains row's); RL and held-out evaluation keep theirs.
  config.rl.multi_turn = False  # Multi-turn tool episodes (rl/step/episodes.py): turn, env step, observation into the KV cache; rl.max_new_tokens is the episode's budget after the prompt.
  config.rl.max_turns = 4  # Multi-turn: policy turns per episode (an example's own max_turns may be lower).
  config.rl.max_turn_tokens = 32  # Multi-turn: tokens of one policy turn.
  config.rl.max_obs_tokens = 64  # Multi-turn: observation tokens appended per turn (longer keep their head); also the KV cache's slack.
  config.rl.env_workers = 8  # Multi-turn: threads stepping the episodes' environments.
  config.rl.env_timeout_s = 30.0  # Multi-turn: seconds one environment call may take (past it: an env failure).
  config.rl.env_backend = "memory"  # Multi-turn: where generated families of data.tasks (files_copy) run: "memory" (an in-memory four-command shell) or "sandbox" (a persistent bubblewrap session, rl/envs/file_sandbox.py).
  config.rl.env_retries = 2  # Environment jobs (an episode's environment start): retries of an infrastructure failure, with backoff (rl/envs/env_work.py); a wrong answer is never retried.
  config.rl.env_backoff_s = 0.5  # First retry's delay in seconds; doubles per attempt.

  # --- data: prompts and tasks (rl/envs, train/data.py).
  config.data = ml_collections.ConfigDict()
  config.data.tasks = "arithmetic:1.0"  # Task families and mixture weights: "name:weight,...".
  config.data.difficulty = 1  # Difficulty level of generated tasks (1 = easiest).
  config.data.level_curriculum = ""  # Generated domains whose level follows their measured pass rate ("reverse,sort", "all"; "" = off); they start at their configured level.
  config.data.level_curriculum_floor = 1  # Level curriculum: the lowest level a domain is demoted to.
  config.data.level_curriculum_max = 0  # Level curriculum: the highest level a domain is promoted to (0 = each family's top level).
  config.data.level_curriculum_promote = 0.7  # Level curriculum: pass rate at the current level at or above which a domain moves one level up.
  config.data.level_curriculum_demote = 0.02  # Level curriculum: pass rate at or below which a domain moves one level down (never below the floor).
  config.data.level_curriculum_window = 64  # Level curriculum: samples at the current level before a move is decided.
  config.data.jsonl = ""  # Optional JSONL file of {"prompt", "answer", "domain"} rows.
  config.data.array_record = ""  # Optional ArrayRecord file(s), comma-separated, of JSON rows like data.jsonl's.
  config.data.domains = ""  # Domain registry (JSONL, rl/envs/registry.py); when set, replaces data.tasks and the file pools.
  config.data.quarantine = ""  # Quarantine list (JSONL, scripts/env_qa.py): its task ids are never drawn; env failures add to it.
  config.data.quarantine_after = 2  # Environment failures of one task (out of retries) that quarantine it while training runs.
  config.data.curriculum = ""  # Quality-gate report (scripts/env_qa.py --json) whose always/never-solved tasks are drawn less (data.domains).
  config.data.flagged_weight = 0.25  # Curriculum: a flagged task's draw weight relative to an unflagged one, in (0, 1] (a floor: never 0).
  config.data.skip_bad_rows = True  # Malformed JSONL rows: skip and count (else raise).
  config.data.eval_fraction = 0.2  # Share of the prompt space held out for evaluation (hash split).
  config.data.seq_len = 128  # SFT: packed sequence length.
  config.data.num_workers = 0  # grain worker processes (0 = in-process).

  # --- eval: held-out evaluation (rl/step/evaluation.py, scripts/eval.py).
  config.eval = ml_collections.ConfigDict()
  config.eval.every = 0  # RL steps between evaluations (0 = off); also after the warm start and at the end.
  config.eval.num_prompts = 200  # Held-out prompts (distinct; fewer if the domain has fewer).
  config.eval.batch_size = 64  # Prompts per evaluation rollout.
  config.eval.pass_k = 0  # Also report pass@k with k samples at rl.temperature (0 = greedy only).
  config.eval.jsonl = ""  # Held-out JSONL of {"prompt", "answer", "domain"} (else the data.tasks split).

  # --- rm: reward-model training (scripts/train_rm.py, train/reward_model.py); the model is model.* and its score head is model.value_head.
  config.rm = ml_collections.ConfigDict()
  config.rm.train_jsonl = ""  # Preference pairs, JSONL of {"prompt", "chosen", "rejected", "margin"?}; "" = synthetic pairs from data.tasks.
  config.rm.eval_jsonl = ""  # Held-out pairs, same format; "" = the pairs whose prompt hashes into data.eval_fraction.
  config.rm.synthetic_pairs = 4096  # Synthetic training pairs (rm.train_jsonl=""): chosen = the task's answer, rejected = a wrong one.
  config.rm.negatives = "near_misses"  # Synthetic pairs' rejected sides: "near_misses" (an edit of the answer, or another prompt's answer) or "policy_errors" (the answer's symbols in another order, one symbol throughout, one dropped/doubled/foreign; train/synthetic_pairs.py).
  config.rm.pairs_from = "synthetic"  # Pairs when rm.train_jsonl="": "synthetic" (train/synthetic_pairs.py), "policy" (the warm-started policy's own samples, chosen verifier-right, rejected verifier-wrong, same prompt; with rl.multi_turn whole episodes graded by their environments; rl/rewards/policy_pairs.py) or "policy+synthetic" (both).
  config.rm.init = "model"  # The reward model's first weights: "model" (model.*: random, or model.init_from) or "policy" (the warm-started policy, rl.sft_steps, with a zero score head: InstructGPT's RM from the SFT model).
  config.rm.policy_prompts = 1024  # rm.pairs_from="policy": training-split prompts sampled (one in 8 gives the held-out pairs).
  config.rm.policy_samples = 8  # rm.pairs_from="policy": completions per prompt at each of rm.policy_temperatures.
  config.rm.policy_temperatures = ""  # rm.pairs_from="policy": sampling temperatures, comma-separated ("0.3,0.7": K samples at each; "" = rl.temperature).
  config.rm.eval_pairs = 512  # Held-out pairs evaluated (fewer when the held-out side has fewer).
  config.rm.steps = 300  # Training steps.
  config.rm.batch_size = 32  # Pairs per step (each pair is two rows: chosen and rejected).
  config.rm.learning_rate = 1e-4  # Peak learning rate (schedule, clipping: optim.*).
  config.rm.warmup_steps = -1  # Linear warmup steps of the reward model's learning rate (-1 = optim.warmup_steps).
  config.rm.lm_coef = 0.0  # Weight of a next-token loss on the chosen rows beside Bradley-Terry (hidden states of a model that writes them: a reward model harder to game).
  config.rm.margin = 0.0  # Margin added to every pair's own "margin": loss = -log sigmoid(r_chosen - r_rejected - margin).
  config.rm.max_len = 0  # Tokens of prompt + response per row (0 = model.max_seq_len).
  config.rm.overflow = "reject"  # A pair longer than rm.max_len: "reject" (error naming file and line) or "truncate" (keep its last tokens).
  config.rm.eval_every = 50  # Steps between held-out pairwise-accuracy evaluations (also at the end).
  config.rm.train_before_rl = False  # scripts/rl.py: first train the reward model (rm.*, model.* with a score head) into rl.reward_model_checkpoint when that folder holds none; one of the same settings there is reused, another refused (rl/rewards/rm_first.py).

  # --- checkpoint: orbax checkpointing (train/checkpoint.py).
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.enabled = True  # Write checkpoints.
  config.checkpoint.every = 50  # Steps between checkpoints.
  config.checkpoint.max_to_keep = 2  # Checkpoints kept.
  config.checkpoint.async_save = True  # Save in the background while training goes on.
  config.checkpoint.restore = True  # Resume from the work directory's latest checkpoint.

  # --- log: metrics and progress (train/metrics.py).
  config.log = ml_collections.ConfigDict()
  config.log.every = 1  # Steps between metric writes.
  config.log.tensorboard = True  # Write TensorBoard event files.
  config.log.progress_bar = True  # Show a progress bar on the console.
  config.log.plot = True  # Write reward_curve.png and eval_curve.png (held-out accuracy, one line per domain) at the end.
  config.log.profile_start = 0  # Trace steps profile_start.. of each loop (SFT, RM, RL) with jax.profiler into <workdir>/profile, with summary.json: time per compiled program (train/profile.py). 0 = off.
  config.log.profile_steps = 3  # Steps traced from log.profile_start.

  # --- serve: the OpenAI-compatible server (serve/, scripts/serve.py).
  config.serve = ml_collections.ConfigDict()
  config.serve.slots = 8  # Decode slots: requests decoded together (more wait in a queue).
  config.serve.max_len = 0  # Context length in tokens, prompt + completion (0 = model.max_seq_len).
  config.serve.decode_chunk = 8  # Decode steps per jitted chunk; new requests are admitted between chunks.
  config.serve.prefix_block = 16  # Tokens per prefix-cache block (blocks hashed as a chain).
  config.serve.prefix_cache_mb = 256.0  # Prefix-cache budget in MiB of saved KV (0 = off).
  config.serve.model_name = ""  # Model id clients send and /v1/models lists ("" = the config's name).
  return config
