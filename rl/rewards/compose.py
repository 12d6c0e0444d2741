"""The reward registry, weighted composition from a spec string, and fault-tolerant batch scoring.

Rewards are host-side Python: they run on decoded completions between the jitted rollout and the
jitted update. `score_batch` never raises for a failing reward function: the failure scores 0 and is
counted in `info["reward_errors"]`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from meshrl.rl.rewards.code import CODE_REWARDS
from meshrl.rl.rewards.countdown import countdown_reward
from meshrl.rl.rewards.verifiers import (exact_match, format_reward, is_number, numeric_match,
                                         tagged_format)

RewardFn = Callable[[str, dict], float]

# Verifiers an example can name in its "verifier" field (each task domain names its default).
VERIFIERS: dict[str, RewardFn] = {
    "exact": exact_match,
    "numeric": numeric_match,
    "countdown": countdown_reward,
    **CODE_REWARDS,  # "code", "code_partial": unit tests run in the sandbox (rewards/code.py)
}


def answer_reward(completion: str, example: dict) -> float:
  """Correctness by the example's own verifier, `VERIFIERS[example["verifier"]]`.

  Without a "verifier" field: "numeric" when the answer is a number, else "exact".
  """
  name = example.get("verifier") or ("numeric" if is_number(str(example["answer"])) else "exact")
  if name not in VERIFIERS:
    raise ValueError(f"example verifier={name!r} is unknown; choose one of {sorted(VERIFIERS)}.")
  return VERIFIERS[name](completion, example)


REWARDS: dict[str, RewardFn] = {
    **VERIFIERS,
    "answer": answer_reward,
    "format": format_reward,
    "tagged": tagged_format,
}


def parse_weights(spec: str, *, field: str = "spec") -> list[tuple[str, float]]:
  """Parses "name:weight,name:weight" (a bare name weighs 1.0) into [(name, weight)].

  Raises:
    ValueError naming `field` and the bad item: empty spec, bad or non-finite weight, a name twice.
  """
  items = [item.strip() for item in spec.split(",") if item.strip()]
  if not items:
    raise ValueError(f"{field}={spec!r} names nothing; expected 'name:weight,...'.")
  parsed = []
  for item in items:
    name, _, weight_text = item.partition(":")
    name = name.strip()
    try:
      weight = float(weight_text) if weight_text.strip() else 1.0
    except ValueError:
      raise ValueError(
          f"{field}={spec!r}: weight {weight_text!r} of {name!r} is not a number.") from None
    if not name or not math.isfinite(weight):
      raise ValueError(f"{field}={spec!r}: item {item!r} needs a name and a finite weight.")
    if name in dict(parsed):
      raise ValueError(f"{field}={spec!r} names {name!r} twice.")
    parsed.append((name, weight))
  return parsed


@dataclasses.dataclass(frozen=True)
class WeightedReward:
  """sum_i weight_i * fn_i(completion, example); `terms` are (name, weight, fn)."""
  terms: tuple[tuple[str, float, RewardFn], ...]

  def __call__(self, completion: str, example: dict) -> float:
    return float(sum(weight * fn(completion, example) for _, weight, fn in self.terms))


def compose(spec: str, *, registry: Mapping[str, RewardFn] = REWARDS) -> WeightedReward:
  """The reward named by cfg.rl.rewards, e.g. "answer:1.0,format:0.1". Every function scores how
  good a completion is (in [0, 1]), so a weight must be positive: a negative one trains the policy
  away from what the function rewards, a zero one does nothing."""
  terms = []
  for name, weight in parse_weights(spec, field="rl.rewards"):
    if name not in registry:
      raise ValueError(f"rl.rewards={spec!r}: {name!r} is unknown; choose from {sorted(registry)}.")
    if not weight > 0:
      raise ValueError(f"rl.rewards={spec!r}: weight {weight} of {name!r} must be positive (each reward "
                       "scores how good a completion is; drop a term you do not want).")
    terms.append((name, weight, registry[name]))
  return WeightedReward(tuple(terms))


def _terms(fns) -> tuple[tuple[str, float, RewardFn], ...]:
  """Normalises a WeightedReward, {name: fn}, [fn, ...] or one fn into (name, weight, fn) terms."""
  if isinstance(fns, WeightedReward):
    return fns.terms
  if isinstance(fns, Mapping):
    return tuple((name, 1.0, fn) for name, fn in fns.items())
  if callable(fns):
    fns = [fns]
  return tuple((getattr(fn, "__name__", f"fn{i}"), 1.0, fn) for i, fn in enumerate(fns))


def _score_one(fn: RewardFn, completion: str, example: dict) -> float:
  value = float(fn(completion, example))
  if not math.isfinite(value):
    raise ValueError(f"reward is not finite: {value}")
  return value


def score_batch(fns, completions: Sequence[str], examples: Sequence[dict]
                ) -> tuple[np.ndarray, dict]:
  """Scores every completion with every term; a term that raises scores 0 and is counted.

  Args:
    fns: a WeightedReward (from `compose`), a {name: fn} dict, a list of fns or one fn (weight 1).
    completions: N decoded completions.
    examples: N example dicts (the prompt's), aligned with `completions`.

  Returns:
    (rewards [N] float32, info) with info = {
      "reward_errors": number of (term, sample) calls that raised or returned a non-finite value,
      "errors_by_fn": {name: count}, "first_errors": up to 3 "name[i]: Error: message" strings,
      "per_fn": {name: [N] float32 unweighted scores}, "by_domain": {domain: mean reward}}.
  """
  if len(completions) != len(examples):
    raise ValueError(f"len(completions)={len(completions)} != len(examples)={len(examples)}.")
  terms = _terms(fns)
  total = np.zeros(len(completions), np.float32)
  per_fn, errors_by_fn, first_errors = {}, {}, []
  for name, weight, fn in terms:
    scores = np.zeros(len(completions), np.float32)
    errors_by_fn[name] = 0
    for i, (completion, example) in enumerate(zip(completions, examples)):
      try:
        scores[i] = _score_one(fn, completion, example)
      except Exception as error:  # pylint: disable=broad-except  (never crash the loop)
        errors_by_fn[name] += 1
        if len(first_errors) < 3:
          first_errors.append(f"{name}[{i}]: {type(error).__name__}: {error}")
    per_fn[name] = scores
    total += np.float32(weight) * scores
  domains = [example.get("domain", "") if isinstance(example, Mapping) else ""
             for example in examples]
  by_domain = {d: float(np.mean(total[[x == d for x in domains]])) for d in sorted(set(domains))}
  info = {"reward_errors": sum(errors_by_fn.values()), "errors_by_fn": errors_by_fn,
          "first_errors": first_errors, "per_fn": per_fn, "by_domain": by_domain}
  return total, info
