"""The reward-model demo: RL against a learned reward model only, checked by a verifier it never sees.

Run it:  python scripts/rl.py --config=configs/tiny_rm.py
One command, two jobs (rm.train_before_rl, rl/rewards/rm_first.py): first a reward model of the tiny
policy's shape (configs/tiny.py) with a value head as its score is trained by Bradley-Terry on
synthetic preference pairs of the reverse task ("rev abc=": chosen "cba", rejected a near miss the
task's verifier calls wrong, or another prompt's answer; train/synthetic_pairs.py) into
rl.reward_model_checkpoint (runs/tiny_rm/reward_model; a later run reuses it, and refuses a folder
holding a reward model of other settings); then the tiny demo's warm start and GRPO, with every
reward from that model (rl.reward_sources="*=reward_model": the verifier scores nothing in
training). eval.jsonl reports the verifier's held-out greedy accuracy (eval/accuracy) beside the
reward model's mean score of the same completions (eval/rm_score).
Expect (measured, 2 shared cores): held-out pairwise accuracy 0.477 -> 0.922 after 300 steps; then
RL games the reward model: eval/accuracy 41.5% after the warm start, 3% after 10 RL steps, while
eval/rm_score does not fall. docs/benchmarks.md ("RL against a learned reward model") has the
variants tried and why a reward model this small is gamed; the target of issue 35 (accuracy up 20
points) is not met by any of them, policy-error negatives included (--config.rm.negatives=
policy_errors: rejected = the answer's letters in another order, one letter throughout, one
dropped, doubled or foreign; 0.926 held-out pairwise accuracy in rm.steps=700, then 41.5% -> 0%).

Your own preferences: --config.rm.train_jsonl=prefs.jsonl (and rm.eval_jsonl) with
--config.rl.reward_model_checkpoint=runs/my_rm (a new folder); `scripts/train_rm.py` with this
config trains the same reward model on its own (into rl.reward_model_checkpoint).
Options: `configs/tiny_rm.py:quick` trains the reward model 40 steps and runs 10 RL steps (a smoke run).
"""

from meshrl.configs.loader import load_preset


def get_config(arg=None):
  config = load_preset("tiny")
  config.name = "tiny_rm" if not arg else f"tiny_rm_{arg}"
  config.rm.train_before_rl = True
  config.rl.reward_sources = "*=reward_model"
  config.rl.reward_model_checkpoint = f"runs/{config.name}/reward_model"
  # The reward model: pairs over the warm-started policy's own samples (train/policy_pairs.py),
  # starting from that policy's weights, trained to 0.96 held-out pairwise accuracy.
  config.rm.pairs_from = "policy"
  config.rm.init = "policy"
  config.rm.policy_prompts = 4096
  config.rm.policy_samples = 8
  config.rm.policy_temperatures = "0.3,0.7"  # 0.7 alone: 3.7% of the samples right, 0.3: 25%
  config.rm.synthetic_pairs = 4096  # rm.pairs_from=synthetic / policy+synthetic
  config.rm.eval_pairs = 512
  config.rm.steps = 1200  # 300 steps: 0.88 held-out pairwise accuracy, and RL games it (measured)
  config.rm.batch_size = 64
  config.rm.learning_rate = 1e-3  # 3e-4 reached 0.809 in 300 steps (synthetic pairs, measured)
  config.rm.warmup_steps = 20  # the policy's optimizer keeps configs/tiny.py's (no warmup)
  config.rm.max_len = 32
  config.rm.eval_every = 200
  # RL against it: the reward model as a learned verifier (1 above its calibrated threshold), the
  # samples' temperature of its pairs, and a KL term to the warm start (reward-hacking guards).
  config.rl.rm_binarize = True
  config.rl.temperature = 0.3
  config.rl.kl_coef = 0.1
  if arg == "quick":
    config.rm.policy_prompts = 256
    config.rm.steps = 40
    config.rm.eval_every = 20
    config.rl.num_steps = 10
    config.eval.every = 10
  elif arg:
    raise ValueError(f"configs/tiny_rm.py takes no option {arg!r}; options: quick.")
  return config
