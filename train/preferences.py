"""Preference pairs for reward-model training: read and checked from JSONL, encoded into token rows.

  pairs = read_pairs("prefs.jsonl", field="rm.train_jsonl")      # every line checked, or ValueError
  train, held_out = split_pairs(pairs, is_held_out)               # by the prompt's hash (the caller's)
  arrays = encode_pairs(train, tokenizer, max_len=64, overflow="reject")

A pair is one JSONL line `{"prompt": str, "chosen": str, "rejected": str, "margin": number?}` (other
keys are kept out of the way: a "domain" may ride along). Each side is encoded as the policy sees a
prompt and its answer (train/data.py `encode_example`): BOS, the prompt rendered by the chat template,
the response, EOS; the reward is read at the row's last token (train/reward_model.py).

Bad input is a one-line ValueError naming the file and 1-based line before anything is trained or
written: a line that is not JSON or not an object, a side missing, not a string or empty, a margin
that is not a finite number, a pair whose sides are the same text, a file without pairs, and (with
`overflow="reject"`) a prompt + response longer than `max_len`. Nothing is skipped silently: a reward
model trained on a file whose bad rows vanished would be trained on other data than its owner thinks.

Axis legend: N pairs, T = max_len tokens per row.
"""

from __future__ import annotations

import json
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

from meshrl.model.tokenizer import Tokenizer
from meshrl.train.data import encode_example

SIDES = ("prompt", "chosen", "rejected")
OVERFLOW = ("reject", "truncate")  # rm.overflow


class Pair(NamedTuple):
  prompt: str
  chosen: str  # the preferred response
  rejected: str  # the other response
  margin: float  # the row's own margin (0 when the row gives none)
  where: str  # "file:line" (or another origin, e.g. "synthetic:17"): what errors name


class PairArrays(NamedTuple):
  """Encoded pairs, host side (numpy), rows right-padded with the tokenizer's pad id."""
  chosen: np.ndarray  # [N, T] int32 tokens of prompt + chosen
  chosen_lengths: np.ndarray  # [N] int32 tokens before the padding (>= 1)
  rejected: np.ndarray  # [N, T] int32 tokens of prompt + rejected
  rejected_lengths: np.ndarray  # [N] int32
  margins: np.ndarray  # [N] float32 the rows' own margins

  def __len__(self) -> int:
    return int(self.margins.shape[0])

  def take(self, indices) -> "PairArrays":
    """The pairs at `indices` ([n] ints), in that order."""
    return PairArrays(*(a[np.asarray(indices)] for a in self))


def check_pair(row, where: str) -> Pair:
  """The Pair of one parsed JSON value; ValueError "<where>: <what is wrong>" otherwise."""
  if not isinstance(row, dict):
    raise ValueError(f"{where}: a JSON {type(row).__name__}, not an object with "
                     f"{', '.join(map(repr, SIDES))}.")
  for key in SIDES:
    if key not in row:
      raise ValueError(f"{where}: {key!r} is missing; a pair needs {', '.join(map(repr, SIDES))}.")
    if not isinstance(row[key], str):
      raise ValueError(f"{where}: {key!r} is a {type(row[key]).__name__}, not a string.")
    if not row[key].strip():
      raise ValueError(f"{where}: {key!r} is empty.")
  if row["chosen"] == row["rejected"]:
    raise ValueError(f"{where}: 'chosen' and 'rejected' are the same text (a pair must prefer one).")
  margin = row.get("margin", 0.0)
  if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
    raise ValueError(f"{where}: 'margin'={margin!r} is not a finite number.")
  return Pair(row["prompt"], row["chosen"], row["rejected"], float(margin), where)


def read_pairs(path: str, *, field: str) -> list[Pair]:
  """Every pair of the JSONL file `path` (blank lines ignored), in file order.

  Raises ValueError naming `field` when the file is missing or holds no pair, and naming
  `path:line` for the first bad line (see the module docstring).
  """
  try:
    with open(path, encoding="utf-8") as file:
      lines = list(file)
  except FileNotFoundError:
    raise ValueError(f"{field}={path!r}: no such file.") from None
  except UnicodeDecodeError as e:
    raise ValueError(f"{field}={path!r} is not UTF-8 text ({e.reason} at byte {e.start}).") from None
  pairs = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{number}: not JSON ({e.msg} at column {e.colno}); each line is one "
                       f"object with {', '.join(map(repr, SIDES))}.") from None
    pairs.append(check_pair(row, f"{path}:{number}"))
  if not pairs:
    raise ValueError(f"{field}={path!r} holds no preference pairs.")
  return pairs


def split_pairs(pairs: Sequence[Pair], held_out: Callable[[str], bool]) -> tuple[list[Pair], list[Pair]]:
  """(train, held-out) by `held_out(prompt)`: a prompt's pairs all land on one side."""
  train = [p for p in pairs if not held_out(p.prompt)]
  return train, [p for p in pairs if held_out(p.prompt)]


def encode_side(tokenizer: Tokenizer, prompt: str, response: str) -> list[int]:
  """BOS, the rendered prompt, the response, EOS: the row the reward model reads."""
  return encode_example({"prompt": prompt, "answer": response}, tokenizer)["tokens"].tolist()


def _fit(ids: list[int], pair: Pair, side: str, max_len: int, overflow: str) -> list[int]:
  if len(ids) <= max_len:
    return ids
  if overflow == "reject":
    raise ValueError(f"{pair.where}: prompt + {side} is {len(ids)} tokens, longer than rm.max_len="
                     f"{max_len}; raise rm.max_len or set rm.overflow='truncate' (keeps the last "
                     f"{max_len} tokens: the response and the end of its prompt).")
  return ids[-max_len:]


def encode_pairs(pairs: Sequence[Pair], tokenizer: Tokenizer, *, max_len: int,
                 overflow: str = "reject") -> PairArrays:
  """`pairs` -> PairArrays of [N, max_len] rows.

  Args:
    pairs: checked pairs (`read_pairs`, or built by the caller with `check_pair`).
    tokenizer: the policy's tokenizer (the reward model reads the policy's tokens).
    max_len: tokens per row (rm.max_len).
    overflow: "reject" (ValueError naming the pair's file and line) or "truncate" (the last
      `max_len` tokens: the response, its EOS and the end of the prompt; the score position stays).
  """
  if overflow not in OVERFLOW:
    raise ValueError(f"rm.overflow={overflow!r} is not one of {', '.join(map(repr, OVERFLOW))}.")
  if max_len < 2:
    raise ValueError(f"rm.max_len={max_len} must be at least 2 (BOS and EOS).")
  rows = {"chosen": [], "rejected": []}
  for pair in pairs:
    for side in rows:
      rows[side].append(_fit(encode_side(tokenizer, pair.prompt, getattr(pair, side)), pair, side,
                             max_len, overflow))

  def pad(side):
    tokens = np.full((len(pairs), max_len), tokenizer.pad_id, np.int32)
    for i, ids in enumerate(rows[side]):
      tokens[i, :len(ids)] = ids
    return tokens, np.asarray([len(ids) for ids in rows[side]], np.int32).reshape(len(pairs))
  chosen, chosen_lengths = pad("chosen")
  rejected, rejected_lengths = pad("rejected")
  return PairArrays(chosen, chosen_lengths, rejected, rejected_lengths,
                    np.asarray([p.margin for p in pairs], np.float32).reshape(len(pairs)))
