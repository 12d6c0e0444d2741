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


def make_pair(example: dict, rng: np.random.Generator, is_correct: Callable[[str, dict], bool],
              where: str, others: Sequence[str] = ()) -> Pair | None:
  """The pair (answer, a wrong near miss or, half the time when `others` is given, one of `others`:
  other examples' answers) of one example, or None when none is found."""
  answer = str(example["answer"])
  alphabet = _alphabet(example)
  for _ in range(32):
    if len(others) and rng.random() < 0.5:
      wrong = str(others[int(rng.integers(len(others)))])
    else:
      wrong = corrupt(answer, rng, alphabet)
    if wrong.strip() and wrong != answer and not is_correct(wrong, example):
      return Pair(example["prompt"], answer, wrong, 0.0, where)
  return None


def synthetic_pairs(examples: Sequence[dict], *, is_correct: Callable[[str, dict], bool], seed: int,
                    origin: str = "synthetic") -> list[Pair]:
  """One pair per example that has a wrong near miss (or another example's answer, `make_pair`), in order; example i draws from
  `np.random.default_rng([seed, i])` and is named "<origin>:<i>" in errors."""
  pairs = []
  answers = [str(example["answer"]) for example in examples]
  for i, example in enumerate(examples):
    pair = make_pair(example, np.random.default_rng([seed, i]), is_correct, f"{origin}:{i}", answers)
    if pair is not None:
      pairs.append(pair)
  return pairs
