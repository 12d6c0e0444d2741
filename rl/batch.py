"""Host-side glue between rollout and update: prompts in, scored and filtered update batches out.

Pure numpy over one step's arrays; no jax here, so it runs beside the accelerator's work.

Axis legend: P prompts, G group size, B = P * G sequences, S tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from meshrl.model.tokenizer import Tokenizer
from meshrl.rl.rewards import overlong_penalty, score_batch


@dataclasses.dataclass
class PromptBatch:
  examples: list[dict]  # P task examples ({"prompt", "answer", "domain", ...})
  tokens: np.ndarray  # [P, Lp] int32, left-padded
  mask: np.ndarray  # [P, Lp] bool
  rejected: int  # prompts over budget that were skipped (prompt_overflow = "reject")
  truncated: int  # prompts over budget that were cut to their last Lp tokens


def next_prompts(examples: Iterator[dict], tokenizer: Tokenizer, *, count: int, max_len: int,
                 overflow: str) -> PromptBatch:
  """Draws `count` prompts, encodes them left-padded to `max_len`; over-long ones are truncated or
  skipped (and counted) per `overflow` ("truncate" or "reject")."""
  if overflow not in ("truncate", "reject"):
    raise ValueError(f"rl.prompt_overflow={overflow!r}; choose truncate or reject.")
  chosen, rejected, truncated = [], 0, 0
  while len(chosen) < count:
    example = next(examples)
    length = len(tokenizer.encode(example["prompt"]))
    if length > max_len:
      if overflow == "reject":
        rejected += 1
        if rejected > 100 * count:
          raise ValueError(f"every prompt is longer than rl.max_prompt_len={max_len} tokens "
                           f"(the last had {length}); raise the budget or use truncate.")
        continue
      truncated += 1
    chosen.append(example)
  tokens, mask = tokenizer.encode_batch([e["prompt"] for e in chosen], length=max_len,
                                        padding="left", overflow="truncate")
  return PromptBatch(chosen, tokens, mask, rejected, truncated)


@dataclasses.dataclass
class ScoredRollout:
  """One rollout's arrays (numpy, [B, ...]) with rewards, for dynamic sampling and the update."""
  arrays: dict  # RolloutBatch fields as numpy
  rewards: np.ndarray  # [B] float32, shaped (overlong penalty included)
  correct: np.ndarray  # [B] float32, the raw task reward
  info: dict


def score_rollout(arrays: dict, examples: list[dict], tokenizer: Tokenizer, reward_fn, *, group_size: int,
                  max_new_tokens: int, overlong_buffer: int, overlong_penalty_value: float) -> ScoredRollout:
  """Decodes the responses and scores them; a reward function that raises scores 0 and is counted."""
  response = np.where(arrays["response_mask"], arrays["tokens"], tokenizer.pad_id)
  prompt_len = arrays["tokens"].shape[1] - max_new_tokens
  texts = tokenizer.decode_batch(response[:, prompt_len:])
  per_sample = [ex for ex in examples for _ in range(group_size)]
  rewards, info = score_batch(reward_fn, texts, per_sample)
  correct = rewards.astype(np.float32)
  shaped = correct.copy()
  if overlong_buffer:
    shaped -= overlong_penalty(arrays["lengths"], max_len=max_new_tokens, buffer=overlong_buffer,
                               penalty=overlong_penalty_value)
  info["texts"] = texts
  return ScoredRollout(arrays=arrays, rewards=shaped.astype(np.float32), correct=correct, info=info)


def informative_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
  """[P] bool: groups whose rewards are not all equal (DAPO dynamic sampling keeps only these)."""
  grouped = rewards.reshape(-1, group_size)
  return grouped.max(axis=1) > grouped.min(axis=1)


def select_groups(rollouts: list[ScoredRollout], *, num_groups: int, group_size: int,
                  dynamic: bool) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
  """Assembles a batch of exactly `num_groups` groups from one or more rollouts.

  With `dynamic`, informative groups come first (in order of arrival); if too few exist the batch is
  topped up with uninformative ones, which get `group_valid = False` (no gradient). Returns
  (arrays [B, ...], rewards [B], correct [B], group_valid [num_groups]).
  """
  pieces = []  # (rollout index, group index, informative)
  for r, rollout in enumerate(rollouts):
    useful = informative_groups(rollout.rewards, group_size)
    pieces += [(r, g, bool(u)) for g, u in enumerate(useful)]
  if dynamic:
    pieces = [p for p in pieces if p[2]] + [p for p in pieces if not p[2]]
  pieces = pieces[:num_groups]

  def gather(get):
    return np.concatenate([get(rollouts[r])[g * group_size:(g + 1) * group_size] for r, g, _ in pieces])
  arrays = {k: gather(lambda ro, k=k: ro.arrays[k]) for k in rollouts[0].arrays}
  rewards = gather(lambda ro: ro.rewards)
  correct = gather(lambda ro: ro.correct)
  valid = np.array([u or not dynamic for _, _, u in pieces])
  return arrays, rewards, correct, valid
