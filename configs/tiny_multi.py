"""The CPU demo's model trained jointly on 8 domains of the registry, each evaluated on its own held-out prompts.

Run it:  python scripts/rl.py --config=configs/tiny_multi.py
The domains (configs/tiny_multi_domains.jsonl, the registry format of rl/envs/registry.py): reverse,
copy and sort at levels 1 (three symbols, the demo's) and 2 (five), countdown and arithmetic at level
1. Every batch of 16 prompts holds at least one of each domain (quota 1/16 each, rl/envs/scheduler.py
plan_batch); the other 8 slots go by weight (level 2 weighs 1.5, the rest 1). The warm start
(rl.sft_steps) draws from the same mix. Held-out evaluation takes eval.num_prompts // 8 prompts of
every domain from the other side of the hash split; eval.jsonl, TensorBoard and eval_curve.png carry
eval/accuracy/<domain> beside the mean.

Left out, and why: code (rl/envs/code_tasks.py) has prompts of 160-240 characters and answers of
40-120, past this model's 64-token context (rl.max_prompt_len 16 + rl.max_new_tokens 8); the
files_copy family is multi-turn (rl.multi_turn: every domain would then run as an episode through the
multi-turn loop) and the registry declares only single-turn generators, JSONL rows and terminal task
directories, so it cannot be given a level, weight and quota beside the others.

The model is the demo's (2 layers, width 128, 4 experts): 8 short-string tasks share one vocabulary
of characters and fit its context; scripts/bench_learning.py --experiments joint compares this joint
run with each domain trained alone for the same total compute (docs/benchmarks.md).
One domain alone: --config.data.domains=<a file holding that one row> (what the benchmark does).
"""

import os

from meshrl.configs.loader import load_preset

DOMAINS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_multi_domains.jsonl")


def get_config(arg=None):
  if arg:
    raise ValueError(f"configs/tiny_multi.py takes no option, got {arg!r}.")
  config = load_preset("tiny")
  config.name = "tiny_multi"
  config.data.tasks = ""  # data.domains replaces it
  config.data.domains = DOMAINS_FILE
  config.rl.sft_steps = 300  # the warm start over the same 8-domain mix: right on ~63% of held-out prompts
  config.rl.num_steps = 100
  config.optim.learning_rate = 1e-4  # the demo's 3e-4 let copy crowd out reverse (held-out mean 43% -> 36% in 60 steps)
  config.rl.max_new_tokens = 8  # countdown's longest level-1 answer and level 2's five symbols fit
  config.eval.every = 20
  config.eval.num_prompts = 400  # 50 held-out prompts per domain
  return config
