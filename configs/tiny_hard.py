"""The CPU demo's model on tasks one level harder, with issue 33's bootstrapping options on.

Run it:  python scripts/rl.py --config=configs/tiny_hard.py
The demo (configs/tiny.py) reverses three-letter words, which its warm start already solves ~40% of
the time. Here reverse, copy and sort start at level 2 (five symbols), where a warm start rarely
succeeds, so plain GRPO with dynamic sampling drops nearly every group (all wrong). What this preset
turns on:
  - data.level_curriculum=all: each family moves between level 1 (the floor) and 3 by the pass rate
    measured at its current level (rl/envs/levels.py), so the policy trains where it can succeed;
    held-out evaluation stays at level 2 (data.difficulty), the task to be learnt.
  - rl.retry_unsolved=2: a prompt with no success in its group is sampled again, in dynamic
    sampling's refill round or the next step (rl/step/retry.py); the batch keeps its shape.
  - rl.replay_groups=16: groups that held a success come back, with their behaviour log-probs, in
    the places dynamic sampling leaves empty (rl/step/replay.py).
Every record holds solved_frac (prompts with at least one success) and all_groups_dropped.

With your own rows (prompt, answer, verifier: exact): --config.data.jsonl=data.jsonl
--config.eval.jsonl=eval.jsonl --config.data.tasks= --config.data.level_curriculum= (the curriculum
governs generated families only; the retries work on any rows).

Note: the warm start (rl.sft_steps) trains on the data.difficulty prompts of data.tasks.
"""

from meshrl.configs.loader import load_preset


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/tiny_hard.py takes no option, got {arg!r}.")
  config = load_preset("tiny")
  config.name = "tiny_hard"
  config.data.tasks = "reverse:1.0,copy:1.0,sort:1.0"
  config.data.difficulty = 2
  config.rl.sft_difficulty = "1"  # the demo's warm start, at the demo's level; RL and evaluation at level 2
  config.rl.max_new_tokens = 8  # level 3's seven symbols and the stop token
  config.data.level_curriculum = "all"
  config.data.level_curriculum_floor = 1
  config.data.level_curriculum_max = 3
  config.data.level_curriculum_window = 64
  config.data.level_curriculum_promote = 0.6
  config.data.level_curriculum_demote = 0.05
  config.rl.retry_unsolved = 2
  config.rl.retry_share = 0.5
  config.rl.replay_groups = 16
  config.rl.dynamic_sampling = True
  config.rl.max_resample_rounds = 2
  return config
