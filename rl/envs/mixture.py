"""Task domains and the seeded mixture sampler over them.

A domain is a generator `(rng, difficulty) -> {"prompt", "answer", ...}` with its number of levels
and the name of its default verifier (a key of rl.rewards.VERIFIERS). `TaskMixture` stamps every
example with "domain", "verifier" and "difficulty", so the "answer" reward knows how to check it.

Example i of `TaskMixture(spec, difficulty=d, seed=s)` depends only on (spec, d, s, i): the mixture
is random-access (`mixture[i]`), so a data loader can resume from an index.

Held-out evaluation needs prompts training never sees, and a seed alone does not give that when a
domain has few distinct prompts (single-digit arithmetic has about 150). So prompts are split by a
stable hash of their text: `split="eval"` yields only prompts whose hash falls in the first
`eval_fraction` of the range, `split="train"` only the others; the two never share a prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from meshrl.rl.envs import arithmetic, code_tasks, countdown, sequences
from meshrl.rl.rewards.compose import parse_weights


@dataclasses.dataclass(frozen=True)
class Domain:
  """A family of generated tasks."""
  generate: Callable[[np.random.Generator, int], dict]
  levels: int  # difficulties 1..levels
  verifier: str  # default verifier, a key of rl.rewards.VERIFIERS


DOMAINS: dict[str, Domain] = {
    "arithmetic": Domain(arithmetic.arithmetic, arithmetic.LEVELS, arithmetic.VERIFIER),
    "reverse": Domain(sequences.reverse, sequences.LEVELS, sequences.VERIFIER),
    "sort": Domain(sequences.sort, sequences.LEVELS, sequences.VERIFIER),
    "copy": Domain(sequences.copy, sequences.LEVELS, sequences.VERIFIER),
    "countdown": Domain(countdown.countdown, countdown.LEVELS, countdown.VERIFIER),
    "code": Domain(code_tasks.code_task, code_tasks.LEVELS, code_tasks.VERIFIER),
}


def _check_level(domain: str, difficulty: int) -> Domain:
  """The domain, after checking its name and that it has level `difficulty`."""
  if domain not in DOMAINS:
    raise ValueError(f"task domain={domain!r} is unknown; choose one of {sorted(DOMAINS)}.")
  family = DOMAINS[domain]
  if not 1 <= difficulty <= family.levels:
    raise ValueError(
        f"difficulty={difficulty} for domain {domain!r} must lie in 1..{family.levels}.")
  return family


def make_example(domain: str, rng: np.random.Generator, *, difficulty: int = 1) -> dict:
  """One example of `domain`, stamped with "domain", "verifier" and "difficulty"."""
  family = _check_level(domain, difficulty)
  example = family.generate(rng, difficulty)
  return {**example, "domain": domain, "verifier": family.verifier, "difficulty": difficulty}


def in_eval_split(prompt: str, eval_fraction: float) -> bool:
  """True when `prompt` belongs to the held-out side (a stable hash, the same in every process)."""
  digest = hashlib.blake2b(str(prompt).encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "big") / 2.0 ** 64 < eval_fraction


def distinct_examples(source, count: int, *, max_draws: int | None = None) -> list[dict]:
  """Up to `count` examples of `source` (random access) with distinct prompts, in index order;
  fewer when the source has fewer distinct prompts within `max_draws` (default 50 * count) draws."""
  seen, chosen = set(), []
  for index in range(max_draws or 50 * count):
    example = source[index]
    if example["prompt"] not in seen:
      seen.add(example["prompt"])
      chosen.append(example)
      if len(chosen) == count:
        break
  return chosen


class TaskMixture:
  """Seeded, random-access mixture of task domains (cfg.data.tasks, cfg.data.difficulty).

  Args:
    spec: "name:weight,..." over DOMAINS and the names of `pools`; weights need not sum to 1.
    difficulty: level for every generated domain.
    seed: base seed; example i draws from `np.random.default_rng([seed, i])`.
    pools: optional {name: examples} fixed lists (e.g. JSONL data) sampled uniformly.
    split: "all", or "train" / "eval": only prompts on that side of the hash split.
    eval_fraction: share of the prompt space held out for "eval" (0 < f < 1 when split != "all").
  """

  def __init__(self, spec: str, *, difficulty: int = 1, seed: int = 0,
               pools: Mapping[str, Sequence[dict]] | None = None, split: str = "all",
               eval_fraction: float = 0.0):
    if split not in ("all", "train", "eval"):
      raise ValueError(f"split={split!r}; choose all, train or eval.")
    if split != "all" and not 0.0 < eval_fraction < 1.0:
      raise ValueError(f"data.eval_fraction={eval_fraction} must lie strictly between 0 and 1.")
    self.split, self.eval_fraction = split, float(eval_fraction)
    self.pools = dict(pools or {})
    weighted = parse_weights(spec, field="tasks")
    for name, weight in weighted:
      if name not in DOMAINS and name not in self.pools:
        raise ValueError(f"tasks={spec!r}: {name!r} is unknown; choose from "
                         f"{sorted(DOMAINS) + sorted(self.pools)}.")
      if weight <= 0:
        raise ValueError(f"tasks={spec!r}: weight {weight} of {name!r} must be positive.")
      if name in self.pools and not self.pools[name]:
        raise ValueError(f"tasks={spec!r}: pool {name!r} is empty.")
      if name not in self.pools:
        _check_level(name, difficulty)
    self.names = [name for name, _ in weighted]
    weights = np.array([weight for _, weight in weighted], np.float64)
    self.probs = weights / weights.sum()
    self.difficulty = difficulty
    self.seed = seed

  def _draw(self, rng: np.random.Generator) -> dict:
    name = self.names[int(rng.choice(len(self.names), p=self.probs))]
    if name in self.pools:
      pool = self.pools[name]
      return dict(pool[int(rng.integers(len(pool)))])
    return make_example(name, rng, difficulty=self.difficulty)

  def __getitem__(self, index: int) -> dict:
    if index < 0:
      raise IndexError(f"index={index} must be >= 0.")
    if self.split == "all":
      return self._draw(np.random.default_rng([self.seed, index]))
    for attempt in range(1000):  # rejection onto this side of the split (deterministic per index)
      example = self._draw(np.random.default_rng([self.seed, index, attempt]))
      if in_eval_split(example["prompt"], self.eval_fraction) == (self.split == "eval"):
        return example
    raise ValueError(f"no {self.split} prompt found in 1000 draws for index {index}: the "
                     f"{self.split} side of data.eval_fraction={self.eval_fraction} is (nearly) empty.")

  def __iter__(self) -> Iterator[dict]:
    return (self[i] for i in itertools.count())

  def take(self, count: int, *, start: int = 0) -> list[dict]:
    """Examples start .. start + count - 1."""
    return [self[i] for i in range(start, start + count)]
