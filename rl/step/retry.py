"""Extra sampling for prompts with no success yet (issue 33): their groups are drawn again.

  retry = UnsolvedRetry(max_retries=2, per_round=4)
  examples = retry.stream(fresh)       # a round's prompts: up to per_round queued retries, then fresh
  retry.observe(examples, solved)      # [P] bool per group: an unsolved prompt is queued again

A prompt none of whose G samples succeeded gets another group of G samples in a later rollout round,
up to `max_retries` times: with dynamic sampling the refill rounds of the same step, otherwise the
next step's round. A retry takes the place of a fresh prompt, so every round still has
rl.prompts_per_step prompts and the batch keeps its static shape [P * G, S]; each group is scored and
its advantages computed as any other (an estimator sees a group of G samples of one prompt). At most
`per_round` prompts of a round are retries (fresh prompts keep flowing), and the queue holds at most
`capacity` prompts (the oldest leave first). Each retried example is stamped "retry": n (its n-th
retry).

Pure Python: no jax.
"""

from __future__ import annotations

import collections
from typing import Iterator, Sequence

import numpy as np

RETRY_KEY = "retry"


class UnsolvedRetry:
  """The queue of prompts to sample again and the counts of one step (`metrics`)."""

  def __init__(self, *, max_retries: int, per_round: int, capacity: int | None = None):
    if max_retries < 1 or per_round < 1:
      raise ValueError(f"max_retries={max_retries} and per_round={per_round} must be at least 1.")
    self.max_retries, self.per_round = int(max_retries), int(per_round)
    self.capacity = int(capacity or 4 * per_round * max_retries)
    self.queue: collections.deque = collections.deque()
    self.allowance = 0  # retries the next round may still take (per_round after each observation)
    self.step_counts = {"retried_prompts": 0, "retried_solved": 0, "retries_given_up": 0}

  def stream(self, fresh: Iterator[dict]) -> Iterator[dict]:
    """The queued retries the current round may take, then `fresh` examples; endless like `fresh`."""
    while True:
      if self.queue and self.allowance > 0:
        self.allowance -= 1
        self.step_counts["retried_prompts"] += 1
        yield self.queue.popleft()
      else:
        yield next(fresh)

  def observe(self, examples: Sequence[dict], solved: np.ndarray) -> None:
    """`examples` [P] of a scored round and `solved` [P] (a group with a success): unsolved prompts
    with retries left join the queue; the next round may take up to per_round of them."""
    for example, ok in zip(examples, np.asarray(solved, bool)):
      tries = int(example.get(RETRY_KEY, 0))
      if ok:
        self.step_counts["retried_solved"] += int(tries > 0)
      elif tries < self.max_retries:
        if len(self.queue) == self.capacity:
          self.queue.popleft()
        self.queue.append({**example, RETRY_KEY: tries + 1})
      else:
        self.step_counts["retries_given_up"] += 1
    self.allowance = self.per_round

  def metrics(self) -> dict[str, float]:
    """This step's retried prompts, those solved, those out of retries, and the queue's length;
    the step counts restart."""
    out = {k: float(v) for k, v in self.step_counts.items()}
    out["retry_queue"] = float(len(self.queue))
    self.step_counts = dict.fromkeys(self.step_counts, 0)
    return out

  def get_state(self) -> dict:
    """JSON: the queue (examples) and the allowance."""
    return {"queue": list(self.queue), "allowance": self.allowance}

  def set_state(self, state: dict) -> None:
    self.queue = collections.deque(state["queue"])
    self.allowance = int(state["allowance"])
