"""The agent demo: a tiny MoE policy learns a two-step tool episode by GRPO on multi-turn rollouts.

Run it:  python scripts/rl.py --config=configs/tiny_agent.py
Expect (docs/benchmarks.md "The multi-turn agent demo"; 2 cores): held-out greedy multi-turn success
8-11% after the warm start -> 55-69% after 320 GRPO steps with this preset (MoE, routing replay,
continuous engine, asynchronous RL, an update sized to the groups dynamic sampling keeps; 16-30% after
80 steps, 37-59% after 240: the MoE asynchronous policy learns steadily but more slowly than the dense
synchronous one), 2.5-4 minutes in all (2 min 33 s and 2 min 39 s alone on 2 cores, 2026-12-06). The dense,
synchronous recipe (moe.num_experts=0, rl.engine=static, rl.max_staleness=0, rl.tis_level=none,
rl.replay_routing=false, rl.num_steps=80) measured 6.2% -> 53.1% (the code before the generation
engine: 6.2% -> 43.8%).
Task (rl/envs/file_tasks.py, "files_copy"): "copy q.txt to f.txt:" with one of 16 words in q.txt that
the prompt does not show; solved by <cmd>cat q.txt</cmd> -> "owl", <cmd>echo owl > f.txt</cmd>, <done>.
The observation must be read and copied, so the episode is really multi-turn. Held-out prompts are the
file-name pairs training never sees (data.eval_fraction of the 650, by hash).

Recipe: a short warm start (SFT, rl.sft_steps) on oracle episodes cut at each policy turn
(rl/step/episode_collect.Demonstrations) leaves the greedy policy solving part of the held-out episodes; GRPO on
multi-turn episodes (rl/step/episodes.py: turn, environment step, observation into the KV cache; loss on the
policy's own tokens) then raises held-out success.
Options: `configs/tiny_agent.py:quick` runs 10 RL steps (a smoke run); `configs/tiny_agent.py:sandbox`
runs the same recipe with every episode (warm-start demonstrations, rollouts, held-out evaluation) in
the real sandbox (rl.env_backend = "sandbox", rl/envs/file_sandbox.py): a persistent bubblewrap session
per episode, the example's file written into its work directory, the policy's commands run by bash
(observations are the real shell's output and exit status), the target file checked by a command the
harness runs beside the shell. Its recipe is the dense synchronous one above (the MoE asynchronous
preset in the sandbox: docs/benchmarks.md), with room for the shell's longer observations
(rl.max_obs_tokens=24, rl.max_new_tokens=112) and 240 RL steps. Measured: held-out 28.1% after the warm
start -> 70.3% after 240 steps (59.4% in a 200-step run), 6 min 47 s for the whole command on 2 idle
cores; with the blocks unrolled (2026-12-05) 29.7% -> 64.1% in 4 min 22 s (docs/benchmarks.md "The
multi-turn agent demo" has the curves and the variants tried).
"""

from meshrl.configs.loader import load_preset


def get_config(arg=None):
  config = load_preset("base")
  config.name = "tiny_agent" if not arg else f"tiny_agent_{arg}"
  config.model.num_layers = 2
  config.model.embed_dim = 128
  config.model.num_heads = 4
  config.model.num_kv_heads = 2
  config.model.head_dim = 32
  config.model.mlp_dim = 256
  config.model.max_seq_len = 136  # prompt 24 + episode 96 + observation slack 16
  # Two blocks, unrolled: a scan over two layers zero-fills its stacked residuals; the unrolled step
  # took 0.94x the scanned one's time (docs/benchmarks.md "The multi-turn agent demo").
  config.model.scan_layers = False
  config.moe.num_experts = 4  # an MoE policy: 4 experts, top-2, each half the dense width (the same active MLP)
  config.moe.num_experts_per_tok = 2
  config.moe.expert_mlp_dim = 128
  config.moe.first_k_dense = 0
  config.rl.replay_routing = True  # the update replays the experts of every token of every turn
  config.attention.impl = "reference"
  config.optim.learning_rate = 1e-4  # 3e-4 rose faster, then collapsed at step 40 (measured)
  config.rl.multi_turn = True
  config.rl.max_turns = 4
  config.rl.max_turn_tokens = 32
  config.rl.max_obs_tokens = 16
  config.rl.env_workers = 2
  config.rl.env_timeout_s = 10.0
  config.rl.engine = "continuous"  # episodic: an episode's slot pauses for its environment, the others decode on
  config.rl.max_staleness = 1  # asynchronous: batch k+1's episodes run while batch k is scored and updated
  config.rl.tis_level = "token"  # importance-correct the one-update-old samples
  config.rl.num_steps = 320  # sampled success rises steadily, 0.10 -> 0.54-0.56 in the last 40 steps (measured; 80 steps: held-out 28-30%)
  config.rl.prompts_per_step = 8
  config.rl.group_size = 8
  config.rl.num_minibatches = 1  # one update per step: its forward is also the proximal policy of TIS
  config.rl.max_prompt_len = 24
  config.rl.max_new_tokens = 96
  config.rl.temperature = 0.7
  config.rl.max_resample_rounds = 0
  # Dynamic sampling keeps the groups whose rewards differ (1-5 of 8 early in the run, 4-7 later): the
  # update takes the fewest of 16, 32, 48, 64 rows that hold them (one compile each), not 64 rows of
  # which most are masked. Halvings (8, 16, 32, 64) took all 64 rows for 5-7 groups.
  config.rl.pack_updates = True
  config.rl.packed_row_buckets = 4
  config.rl.packed_row_spacing = "even"
  config.rl.sft_steps = 200
  config.rl.sft_batch_size = 16
  config.data.seq_len = 128
  config.data.tasks = "files_copy:1.0"  # rl/envs/file_tasks.py (presets import nothing but configs)
  config.eval.every = 20
  config.eval.num_prompts = 64
  config.eval.batch_size = 64
  config.checkpoint.every = 50
  if arg == "quick":
    config.rl.num_steps = 10
  elif arg == "sandbox":
    config.rl.env_backend = "sandbox"  # rl/envs/file_sandbox.py: bubblewrap sessions, not the in-memory shell
    # The real shell's observations carry the exit status ("<out>owl\n[exit 0]</out>": 23 byte tokens), so
    # they get room to be shown whole, as the warm start's demonstrations show them.
    config.rl.max_obs_tokens = 24
    config.rl.max_new_tokens = 112
    config.model.max_seq_len = 160  # prompt 24 + episode 112 + observation slack 24
    config.rl.env_timeout_s = 30.0  # a session start on a loaded machine can take seconds
    # The dense synchronous recipe (see above): the MoE asynchronous preset gains less in 80 steps.
    config.moe.num_experts = 0
    config.rl.engine = "static"
    config.rl.max_staleness = 0
    config.rl.tis_level = "none"
    config.rl.replay_routing = False
    config.rl.num_minibatches = 2  # as measured (2026-12-04): two updates a step on a padded batch
    config.rl.pack_updates = False
    config.rl.packed_row_buckets = 1
    config.rl.packed_row_spacing = "halve"
    config.rl.num_steps = 240  # held-out 28-30% -> 42-50% at step 80, 64-70% at 240 (measured)
    config.eval.every = 20
  elif arg:
    raise ValueError(f"configs/tiny_agent.py takes no option {arg!r}; options: quick, sandbox.")
  return config
