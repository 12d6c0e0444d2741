"""meshrl.rl.envs: verifiable tasks generated offline from a seed, and user tasks from JSONL.

Domains (see DOMAINS): arithmetic, reverse, sort, copy, countdown, code. Each example is a dict
{"prompt", "answer", "domain", "verifier", "difficulty", ...}; the "answer" reward of rl.rewards
checks it with its "verifier".

Environments (base.py): `reset(task) -> observation`, `step(action) -> StepResult`; single-turn tasks
are `SingleTurnEnv`, terminal task directories `terminal.TerminalEnv`; `episode.run_episode` drives a
policy through one. Domains declared in a file: `registry.load_domains`, `registry.DomainMixture`;
scheduling: scheduler.py; the environment quality gate and quarantine: quality.py.
"""

from meshrl.rl.envs.jsonl import JsonlExamples, load_jsonl
from meshrl.rl.envs.mixture import (DOMAINS, Domain, TaskMixture, distinct_examples, in_eval_split,
                                    make_example)
from meshrl.rl.envs.base import Environment, SingleTurnEnv, StepResult, parse_action
from meshrl.rl.envs.episode import Budget, Episode, run_episode
from meshrl.rl.envs.registry import DomainMixture, load_domains
