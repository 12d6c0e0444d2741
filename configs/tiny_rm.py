"""The reward-model demo: the tiny policy's shape (configs/tiny.py) with a value head as the score,
trained by Bradley-Terry on synthetic preference pairs of the reverse task ("rev abc=": chosen "cba",
rejected a near miss the task's verifier calls wrong: two letters swapped, one replaced, dropped or
doubled, or all shuffled), so held-out pairwise accuracy measures what a verifier would say.

Run it:  python scripts/train_rm.py --config=configs/tiny_rm.py
Expect (measured once, 2 shared cores, one CPU device): held-out pairwise accuracy 0.498 before
training -> 0.893 after 300 steps, in about 100 s (0.795 at step 50). Held-out pairs are made from
the prompts training never sees (data.eval_fraction of the 17,576 words, by hash).
Options: `configs/tiny_rm.py:quick` trains 40 steps (a smoke run).
"""

from meshrl.configs.loader import load_preset


def get_config(arg=None):
  config = load_preset("tiny")
  config.name = "tiny_rm" if not arg else f"tiny_rm_{arg}"
  config.model.value_head = True
  config.rm.synthetic_pairs = 4096
  config.rm.eval_pairs = 512
  config.rm.steps = 300
  config.rm.batch_size = 32
  config.rm.learning_rate = 1e-3  # 3e-4 reached 0.809 in 300 steps (measured)
  config.rm.max_len = 32
  config.rm.eval_every = 50
  config.optim.warmup_steps = 20
  config.checkpoint.every = 100
  if arg == "quick":
    config.rm.steps = 40
    config.rm.eval_every = 20
  elif arg:
    raise ValueError(f"configs/tiny_rm.py takes no option {arg!r}; options: quick.")
  return config
