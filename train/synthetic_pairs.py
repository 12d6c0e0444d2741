"""Synthetic preference pairs from tasks a verifier checks: chosen = the task's answer, rejected = a
near miss of it that the verifier calls wrong. A reward model trained on them can be checked by the
same verifier (held-out pairwise accuracy here; the policy's verified accuracy in RL).

  pairs = synthetic_pairs(examples, is_correct=lambda text, ex: answer_reward(text, ex) >= 1, seed=0)

Near misses are what a policy's wrong samples look like: two symbols swapped, one replaced by a
symbol of the prompt or answer, one dropped or doubled, or the symbols shuffled. Half the pairs'
rejected side is instead another example's answer: well formed, wrong for this prompt. Without them
a reward model checks form and not the prompt, and RL against it finds that out (measured: RMs
trained on near misses alone, 0.89 and 0.99 held-out pairwise accuracy, were gamed within 10 RL
steps by well-formed answers to no prompt: "xjx" for "rev abc=", "116" for every "sort ...").
rm.negatives="policy_errors" draws the rejected side from the errors a policy learning the task
writes instead (`policy_error`): the answer's own symbols in another order (the prompt's order, a
partial reversal, any permutation), one symbol written throughout ("rrr" for "kir"), one dropped or
doubled, a symbol the answer lacks, or another example's answer. Near misses alone left RMs
that learned which letters appear and not their order ("rrr" for "rev rik=" outscored "kir"; the
correct answer was the RM's top choice among 100 candidates for 0-12.5% of prompts); these pairs
teach order and count (and RL still games the 2- and 4-layer RMs trained on them: docs/benchmarks.md).
A corruption (or another answer) the verifier still accepts (e.g. the same digits of a sum in another order that happen to be right) is
drawn again; an example with no wrong corruption in 32 draws gives no pair.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from meshrl.train.preferences import Pair


def _alphabet(example: dict) -> list[str]:
  """The symbols a near miss may use: the letters and digits of the prompt and answer."""
  return sorted({c for c in example["prompt"] + str(example["answer"]) if c.isalnum()}) or list("0123456789")


def corrupt(answer: str, rng: np.random.Generator, alphabet: Sequence[str]) -> str:
  """One near miss of `answer` (may equal it when the edit changes nothing; the caller checks)."""
  chars = list(answer)
  kind = int(rng.integers(5)) if len(chars) > 1 else int(rng.choice([1, 3]))
  i = int(rng.integers(len(chars)))
  if kind == 0:  # swap two positions
    j = int(rng.integers(len(chars)))
    chars[i], chars[j] = chars[j], chars[i]
  elif kind == 1:  # replace one symbol
    chars[i] = str(rng.choice(list(alphabet)))
  elif kind == 2:  # drop one symbol
    del chars[i]
  elif kind == 3:  # double one symbol
    chars.insert(i, chars[i])
  else:  # shuffle
    chars = [chars[k] for k in rng.permutation(len(chars))]
  return "".join(chars)


NEGATIVES = ("near_misses", "policy_errors")  # rm.negatives
_SYMBOLS = "abcdefghijklmnopqrstuvwxyz0123456789"


def policy_error(answer: str, rng: np.random.Generator, alphabet: Sequence[str]) -> str:
  """One error of the kind a policy writing `answer` makes (may equal it; the caller checks): half
  the time the same symbols in another order (reversed back, i.e. the prompt's order; a reversed
  prefix or suffix; a permutation), else one symbol throughout, one dropped or doubled, or one
  replaced by any symbol the answer lacks (`alphabet` unused: drawing from outside the prompt never
  showed a reward model the prompt's "r", "e", "v" in a wrong answer, and RL against it wrote
  "eee", measured)."""
  chars = list(answer)
  n = len(chars)
  kind = int(rng.integers(8)) if n > 1 else int(rng.choice([5, 6, 7]))
  if kind == 0:  # the symbols back in the order they came (the prompt's, for a reversal)
    chars = chars[::-1]
  elif kind == 1:  # a partial reversal: a prefix or a suffix of 2..n-1 symbols turned round
    k = int(rng.integers(2, n)) if n > 2 else 2
    chars = chars[:k][::-1] + chars[k:] if rng.random() < 0.5 else chars[:n - k] + chars[n - k:][::-1]
  elif kind in (2, 3):  # any permutation
    chars = [chars[k] for k in rng.permutation(n)]
  elif kind == 4:  # one symbol written throughout
    chars = [chars[int(rng.integers(n))]] * n
  elif kind == 5:  # one dropped (a lone symbol is doubled)
    i = int(rng.integers(n))
    chars = chars[:i] + chars[i + 1:] if n > 1 else chars * 2
  elif kind == 6:  # one doubled
    i = int(rng.integers(n))
    chars.insert(i, chars[i])
  else:  # one replaced by a symbol the answer lacks (the prompt's own "rev" letters among them)
    outside = [c for c in _SYMBOLS if c not in answer]
    chars[int(rng.integers(n))] = str(rng.choice(outside))
  return "".join(chars)


def make_pair(example: dict, rng: np.random.Generator, is_correct: Callable[[str, dict], bool],
              where: str, others: Sequence[str] = (), negatives: str = "near_misses") -> Pair | None:
  """The pair (answer, a wrong near miss, or a policy's error when `negatives`="policy_errors",
  or, when `others` is given, one of `others`: other examples' answers, half the time with near
  misses and a quarter with policy errors) of one example, or None when none is found."""
  if negatives not in NEGATIVES:
    raise ValueError(f"rm.negatives={negatives!r} is not one of {', '.join(map(repr, NEGATIVES))}.")
  answer = str(example["answer"])
  alphabet = _alphabet(example)
  edit, share_of_others = (corrupt, 0.5) if negatives == "near_misses" else (policy_error, 0.25)
  for _ in range(32):
    if len(others) and rng.random() < share_of_others:
      wrong = str(others[int(rng.integers(len(others)))])
    else:
      wrong = edit(answer, rng, alphabet)
    if wrong.strip() and wrong != answer and not is_correct(wrong, example):
      return Pair(example["prompt"], answer, wrong, 0.0, where)
  return None


def synthetic_pairs(examples: Sequence[dict], *, is_correct: Callable[[str, dict], bool], seed: int,
                    origin: str = "synthetic", negatives: str = "near_misses") -> list[Pair]:
  """One pair per example that has a wrong near miss (or another example's answer, `make_pair`), in order; example i draws from
  `np.random.default_rng([seed, i])` and is named "<origin>:<i>" in errors; `negatives`: NEGATIVES
  (rm.negatives: what the rejected sides are)."""
  pairs = []
  answers = [str(example["answer"]) for example in examples]
  for i, example in enumerate(examples):
    pair = make_pair(example, np.random.default_rng([seed, i]), is_correct, f"{origin}:{i}", answers,
                     negatives)
    if pair is not None:
      pairs.append(pair)
  return pairs
