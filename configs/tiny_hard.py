"""The CPU demo's model on tasks one level harder, with issue 33's bootstrapping options on.

Run it:  python scripts/rl.py --config=configs/tiny_hard.py
The demo (configs/tiny.py) reverses three-letter words, which its warm start already solves ~40% of
the time. Here RL and held-out evaluation run reverse, copy and sort at level 2 (five symbols), one
level harder. The warm start (150 SFT steps) trains at the demo's level with a trace of the hard one
(rl.sft_difficulty="1:1,2:0.03": 3% of its generated rows at level 2), and is right on about 4% of
the held-out level-2 prompts (greedy). Plain GRPO there sees few successes, and dynamic sampling
drops nearly every group (all wrong). What this preset turns on:
  - data.level_curriculum=all: each family moves between level 1 (the floor) and 2 by the pass rate
    measured at its current level (rl/envs/levels.py), so the policy also trains where it succeeds;
    held-out evaluation stays at level 2 (data.difficulty), the task to be learnt.
  - rl.retry_unsolved=2: a prompt with no success in its group is sampled again, in dynamic
    sampling's refill round or the next step (rl/step/retry.py); the batch keeps its shape.
  - rl.replay_groups=16: groups that held a success come back, with their behaviour log-probs, in
    the places dynamic sampling leaves empty (rl/step/replay.py).
  - rl.rft_every=5: every 5 RL steps, 4 SFT steps on the run's own verified successes
    (rejection-sampling fine-tuning, rl/step/rft.py).
Every record holds solved_frac (prompts with at least one success) and all_groups_dropped.
Measured (docs/benchmarks.md): sort rises from 14.5% to ~90% held-out; copy and reverse at five
symbols stay at 0% (no sampled success to learn from: this 2-layer model does not extrapolate the
length), so the mean rises from 4% to ~25%. On these families --config.data.level_curriculum= rose
faster (17% at step 25 against 7%) and ended at 26%: a lower level's skill does not carry here.

With your own rows (prompt, answer, verifier: exact): --config.data.jsonl=data.jsonl
--config.eval.jsonl=eval.jsonl --config.data.tasks= (the curriculum and rl.sft_difficulty govern
generated families only and then have none; the retries, the replay and RFT work on any rows).
"""

from meshrl.configs.loader import load_preset


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/tiny_hard.py takes no option, got {arg!r}.")
  config = load_preset("tiny")
  config.name = "tiny_hard"
  config.data.tasks = "reverse:1.0,copy:1.0,sort:1.0"
  config.data.difficulty = 2
  config.rl.sft_steps = 150  # three families where the demo has one
  config.rl.sft_difficulty = "1:1,2:0.03"  # the warm start at the demo's level with a trace of level 2
  config.rl.max_new_tokens = 8  # level 3's seven symbols and the stop token
  config.data.level_curriculum = "all"
  config.data.level_curriculum_floor = 1
  config.data.level_curriculum_max = 2  # the evaluated level: promoting past it trains what is not measured
  config.data.level_curriculum_window = 64
  config.data.level_curriculum_promote = 0.6
  config.data.level_curriculum_demote = 0.05
  config.rl.retry_unsolved = 2
  config.rl.retry_share = 0.5
  config.rl.replay_groups = 16
  config.rl.dynamic_sampling = True
  config.rl.max_resample_rounds = 2
  config.rl.rft_every = 5
  config.rl.rft_steps = 4
  return config
