"""A replay of verified successes (issue 33): groups that held a success come back in later steps,
in the places dynamic sampling would otherwise leave without a gradient.

  replay = SuccessReplay(capacity=8, group_size=G)
  round = replay.take(missing)    # a ScoredBatch of up to `missing` stored groups, or None
  replay.add(scored)              # a step's fresh rounds: its informative groups with a success

When pass rates are near zero most groups are all wrong and dynamic sampling drops them, so a step
may keep no group at all. A group that did hold a success (and a failure: its rewards differ) is
kept here (host numpy, `capacity` groups, the newest first out; each replayed once) and fills such a
step's empty places. A replayed group carries everything its rollout recorded: tokens, masks, the
behaviour log-probs of the policy that sampled it ("logprobs"), its policy version (the staleness
metrics count it) and its MoE routes. So the update's ratio pi_theta / pi_behaviour is exactly 1 on
an unchanged policy, the PPO clip bounds how far an older sample moves the current one, and with
rl.tis_level the behaviour log-probs weight it as any stale sample (rl/step/program.py `prepare`).
Sample reuse with its behaviour log-probs, as in off-policy PPO (Schulman et al. 2017, sec. 5) and
the truncated importance weights of IMPALA (Espeholt et al. 2018).

The store's host memory is checked before the run (configs/checks.check_replay_memory).

Axis legend: G group size, S = max_prompt_len + max_new_tokens tokens.
"""

from __future__ import annotations

import collections

import numpy as np

from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.batches.rows import DeviceRows
from meshrl.train.checkpoint import array_from_json, array_to_json


def with_replay(rounds: list[ScoredBatch], replay: "SuccessReplay", *, num_groups: int,
                dynamic: bool) -> list[ScoredBatch]:
  """A step's rollout rounds, plus a round of stored successes for the places dynamic sampling
  would leave without a gradient (num_groups minus the informative groups); then the fresh rounds'
  successes are stored (after: a group is never replayed in its own step). Without dynamic
  sampling every place holds a fresh group and nothing is replayed (the successes are still stored)."""
  informative = 0
  for scored in rounds:
    grouped = scored.rewards.reshape(-1, replay.group_size)
    informative += int((grouped.max(axis=1) > grouped.min(axis=1)).sum())
  replayed = replay.take(num_groups - informative) if dynamic else None
  for scored in rounds:
    replay.add(scored)
  return rounds + [replayed] if replayed is not None else rounds


def _host(value, rows: slice) -> np.ndarray:
  return value[rows].to_host() if isinstance(value, DeviceRows) else np.asarray(value)[rows]


class SuccessReplay:
  """The stored groups (see the module docstring) and this step's counts (`metrics`)."""

  def __init__(self, *, capacity: int, group_size: int):
    if capacity < 1:
      raise ValueError(f"rl.replay_groups={capacity} must be at least 1 (0 = off).")
    self.capacity, self.group_size = int(capacity), int(group_size)
    self.groups: collections.deque = collections.deque(maxlen=self.capacity)
    self.step_counts = {"replayed_groups": 0, "replay_added": 0}

  def add(self, scored: ScoredBatch) -> None:
    """Stores `scored`'s groups whose rewards differ and that hold a success (correct > 0), pulled to
    the host (collective with several processes: every host calls it with the same batch)."""
    G = self.group_size
    groups = len(scored.rewards) // G
    if not groups:
      return
    rewards = scored.rewards.reshape(groups, G)
    keep = (rewards.max(axis=1) > rewards.min(axis=1)) & (scored.correct.reshape(groups, G).max(axis=1) > 0)
    for g in np.flatnonzero(keep)[-self.capacity:]:
      rows = slice(g * G, (g + 1) * G)
      self.groups.append({"arrays": {k: _host(v, rows) for k, v in scored.arrays.items()},
                          "rewards": scored.rewards[rows].copy(), "correct": scored.correct[rows].copy(),
                          "domains": list(scored.domains[rows]), "texts": list(scored.texts[rows])})
      self.step_counts["replay_added"] += 1

  def take(self, count: int) -> ScoredBatch | None:
    """Up to `count` stored groups (the newest first), removed from the store, as one ScoredBatch of
    host arrays; None when `count` <= 0 or nothing is stored."""
    chosen = [self.groups.pop() for _ in range(min(max(count, 0), len(self.groups)))]
    if not chosen:
      return None
    self.step_counts["replayed_groups"] += len(chosen)
    cat = lambda get: np.concatenate([get(c) for c in chosen])  # noqa: E731
    return ScoredBatch(arrays={k: cat(lambda c, k=k: c["arrays"][k]) for k in chosen[0]["arrays"]},
                       rewards=cat(lambda c: c["rewards"]), correct=cat(lambda c: c["correct"]),
                       sample_valid=np.ones(len(chosen) * self.group_size, bool),
                       domains=[d for c in chosen for d in c["domains"]],
                       texts=[t for c in chosen for t in c["texts"]],
                       info={"reward_errors": 0, "reward_timeouts": 0, "first_errors": []})

  def metrics(self) -> dict[str, float]:
    """This step's replayed and added groups and the store's size; the step counts restart."""
    out = {k: float(v) for k, v in self.step_counts.items()}
    out["replay_stored"] = float(len(self.groups))
    self.step_counts = dict.fromkeys(self.step_counts, 0)
    return out

  def get_state(self) -> list[dict]:
    """JSON: the stored groups (arrays with their dtypes)."""
    return [{**g, "arrays": {k: array_to_json(v) for k, v in g["arrays"].items()},
             "rewards": array_to_json(g["rewards"]), "correct": array_to_json(g["correct"])}
            for g in self.groups]

  def set_state(self, state: list[dict]) -> None:
    self.groups = collections.deque(
        ({**g, "arrays": {k: array_from_json(v) for k, v in g["arrays"].items()},
          "rewards": array_from_json(g["rewards"]), "correct": array_from_json(g["correct"])} for g in state),
        maxlen=self.capacity)
