"""The quality gate for single-turn datasets: JSONL rows and code tasks (rl/envs/quality.py gates the
terminal task directories).

  report = gate_jsonl("data/math.jsonl", quarantine=Quarantine("q.jsonl"))   # scripts/env_qa.py --jsonl
  report = check_examples(examples, ids)   # e.g. generated `code` tasks

Per example, scored by its own verifier (rl.rewards.answer_reward, the reward training uses):
  - the reference answer, given as the completion, must score 1 (a verifier that cannot accept its
    own reference, or a reference that is wrong, teaches noise);
  - a blank completion must score 0 (a verifier that passes anything rewards nothing);
  - the verifier must not raise on either;
  - a prompt seen before (whitespace-normalised) is a duplicate: it would weigh twice and can leak
    between the train and eval sides.
Malformed JSONL lines are reported by line. Flagged rows with an "id" go to the quarantine the domain
mixture honours (rows without one cannot be named there; the report still lists them by line).
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Callable, Sequence

RewardFn = Callable[[str, dict], float]


def _default_reward() -> RewardFn:
  from meshrl.rl.rewards import answer_reward  # pylint: disable=import-outside-toplevel
  return answer_reward


def judge_example(example: dict, reward: RewardFn) -> list[str]:
  """The reasons one example fails the gate ([] when sound); never raises."""
  verifier = example.get("verifier", "default")
  reasons = []
  for completion, want, what in ((str(example.get("answer", "")), 1.0, "the reference answer"),
                                 ("", 0.0, "a blank answer")):
    try:
      score = float(reward(completion, example))
    except Exception as error:  # pylint: disable=broad-except  (a broken verifier is the finding)
      return [f"verifier {verifier!r} raised on {what}: {type(error).__name__}: {error}"[:300]]
    if score != want:
      reasons.append(f"{what} scores {score:g} by verifier {verifier!r} (must be {want:g})")
  return reasons


def check_examples(examples: Sequence[dict], ids: Sequence[str], *, reward: RewardFn | None = None,
                   workers: int = 2) -> dict:
  """{"rows": n, "quarantined": [ids], "reasons": {id: reason}} over `examples` named by `ids`."""
  if len(ids) != len(examples):
    raise ValueError(f"{len(ids)} ids for {len(examples)} examples.")
  reward = reward or _default_reward()
  reasons: dict[str, str] = {}
  first_of: dict[str, str] = {}
  for row_id, example in zip(ids, examples):
    key = " ".join(str(example.get("prompt", "")).split())
    if key in first_of:
      reasons[row_id] = f"duplicate prompt of {first_of[key]}"
    else:
      first_of[key] = row_id
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # code verifiers wait on sandboxes
    verdicts = list(pool.map(lambda e: judge_example(e, reward), examples))
  for row_id, verdict in zip(ids, verdicts):
    if verdict:
      reasons[row_id] = "; ".join(([reasons[row_id]] if row_id in reasons else []) + verdict)
  return {"rows": len(examples), "quarantined": sorted(reasons), "reasons": reasons}


def gate_jsonl(path: str, *, reward: RewardFn | None = None, quarantine=None, workers: int = 2) -> dict:
  """The gate over a JSONL dataset (rl/envs/jsonl.py rows); ids are the rows' "id" or "line N".
  Flagged rows with an "id" are added to `quarantine`."""
  from meshrl.rl.envs.jsonl import check_row  # pylint: disable=import-outside-toplevel
  examples, ids, reasons, named = [], [], {}, set()
  with open(path, encoding="utf-8") as handle:
    for number, line in enumerate(handle, start=1):
      if not line.strip():
        continue
      try:
        example = check_row(json.loads(line))
      except ValueError as error:
        reasons[f"line {number}"] = f"malformed row: {error}"
        continue
      row_id = str(example["id"]) if example.get("id") not in (None, "") else f"line {number}"
      if example.get("id") not in (None, ""):
        named.add(row_id)
      if row_id in ids:
        reasons[row_id] = f"id {row_id!r} is used twice (line {number})"
        continue
      examples.append(example)
      ids.append(row_id)
  report = check_examples(examples, ids, reward=reward, workers=workers)
  report["reasons"] = {**reasons, **report["reasons"]}
  report["quarantined"] = sorted(report["reasons"])
  report["rows"] += sum(1 for key in reasons if key.startswith("line "))
  if quarantine is not None:
    for row_id, reason in report["reasons"].items():
      if row_id in named:
        quarantine.add(row_id, reason, source=f"qa:{path}")
  return report
