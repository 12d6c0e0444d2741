"""meshrl.rl.envs: verifiable tasks generated offline from a seed, and user tasks from JSONL.

Domains (see DOMAINS): arithmetic, reverse, sort, copy, countdown, code. Each example is a dict
{"prompt", "answer", "domain", "verifier", "difficulty", ...}; the "answer" reward of rl.rewards
checks it with its "verifier".
"""

from meshrl.rl.envs.jsonl import JsonlExamples, load_jsonl
from meshrl.rl.envs.mixture import (DOMAINS, Domain, TaskMixture, distinct_examples, in_eval_split,
                                    make_example)
