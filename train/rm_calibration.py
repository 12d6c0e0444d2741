"""A reward model's decision threshold, calibrated on its held-out pairs (rl.rm_binarize).

  threshold, accuracy = best_threshold(chosen [N], rejected [N])   # scores of the held-out pairs
  write_calibration(folder, chosen, rejected)                      # <folder>/calibration.json
  threshold = read_threshold(folder)                               # ValueError naming the file

A Bradley-Terry reward model orders the answers of one prompt; RL against its raw score also follows
the order it gives among wrong answers, which in a GRPO group whose samples are all wrong is all the
signal there is (and none of it the verifier's). Read as a classifier instead, score > threshold is
"right" (1) and anything else "wrong" (0): a learned verifier, the outcome verifier of Cobbe et al.
2021 (arXiv:2110.14168, trained on the generator's own samples labelled right or wrong), so a group of
wrong samples scores all 0 and is dropped as the verifier's would be (rl.dynamic_sampling). The
threshold is the one that classifies the held-out pairs' sides best (chosen right, rejected wrong).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

FILE = "calibration.json"


def best_threshold(chosen: np.ndarray, rejected: np.ndarray) -> tuple[float, float]:
  """(threshold, accuracy): the cut between sorted scores that classifies most sides right
  (chosen > threshold, rejected <= threshold; accuracy over all 2N sides), the midpoint of its two
  neighbouring scores."""
  chosen, rejected = np.asarray(chosen, np.float64), np.asarray(rejected, np.float64)
  if not len(chosen) or len(chosen) != len(rejected):
    raise ValueError(f"calibration needs pairs: {len(chosen)} chosen and {len(rejected)} rejected scores.")
  scores = np.concatenate([chosen, rejected])
  labels = np.concatenate([np.ones(len(chosen)), np.zeros(len(rejected))])
  order = np.argsort(scores, kind="stable")
  scores, labels = scores[order], labels[order]
  # Cut after position k (k = -1: everything right): rejected at or below, chosen above.
  wrong_below = np.concatenate([[0.0], np.cumsum(1 - labels)])
  right_above = np.concatenate([[labels.sum()], labels.sum() - np.cumsum(labels)])
  correct = wrong_below + right_above
  correct[1:-1][scores[1:] == scores[:-1]] = -1  # no cut between two equal scores
  k = int(np.argmax(correct))
  low = scores[k - 1] if k > 0 else scores[0] - 1.0
  high = scores[k] if k < len(scores) else scores[-1] + 1.0
  return float((low + high) / 2), float(correct[k] / len(scores))


def write_calibration(folder: str, chosen: np.ndarray, rejected: np.ndarray) -> dict:
  """Writes <folder>/calibration.json {"threshold", "accuracy", "pairs"} and returns it."""
  threshold, accuracy = best_threshold(chosen, rejected)
  record = {"threshold": threshold, "accuracy": accuracy, "pairs": int(len(chosen))}
  with open(os.path.join(folder, FILE), "w", encoding="utf-8") as f:
    json.dump(record, f)
  return record


def read_threshold(folder: str, *, field: str = "rl.reward_model_checkpoint") -> float:
  """The threshold of <folder>/calibration.json; ValueError naming the file and what to do."""
  path = os.path.join(folder, FILE)
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)["threshold"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"rl.rm_binarize=true reads the reward model's threshold from {path}, which "
                     f"{'does not exist' if isinstance(e, OSError) else 'holds no number threshold'}: train the "
                     f"reward model with this version (scripts/train_rm.py writes it), or set rl.rm_binarize=false "
                     f"({field}={folder!r}).") from None
  if not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"{path}: threshold={value!r} is not a finite number; retrain the reward model or set "
                     "rl.rm_binarize=false.")
  return float(value)
