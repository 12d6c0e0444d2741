"""Rule-based verifiers: `(completion: str, example: dict) -> float in [0, 1]`.

`example` holds at least "answer" (the reference). Verifiers return 0.0 for a wrong or unparsable
completion and raise only when the example itself is malformed (e.g. no "answer"); `score_batch`
counts those as errors.
"""

from __future__ import annotations

import fractions
import re

# A number: optional sign (not after a word character or closing bracket, so "5-3" ends in "3"),
# digits with optional thousands commas, optional decimals, optional "/denominator".
_NUMBER = re.compile(r"(?:(?<![\w)\].])-)?(?<![\d.])\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_ANSWER_TAG = re.compile(r"answer\s*[:=]", re.IGNORECASE)
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
  """Contents of the last \\boxed{...}, braces balanced; None when absent or unclosed."""
  start = text.rfind(_BOXED)
  if start < 0:
    return None
  depth, begin = 1, start + len(_BOXED)
  for position in range(begin, len(text)):
    depth += {"{": 1, "}": -1}.get(text[position], 0)
    if depth == 0:
      return text[begin:position]
  return None


def extract_answer(text: str) -> str | None:
  """The tagged answer of a completion: the last \\boxed{...}, else the rest of the line after the
  last "answer:" (case-insensitive); None when the completion has neither tag."""
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  tags = list(_ANSWER_TAG.finditer(text))
  if tags:
    rest = text[tags[-1].end():].strip()
    return rest.splitlines()[0].strip() if rest else ""
  return None


def parse_number(text: str) -> fractions.Fraction | None:
  """Exact value of one number string ("1,000", "-2.5", "3/4"); None when it is not one."""
  text = text.strip().replace(",", "")
  try:
    return fractions.Fraction(text)
  except (ValueError, ZeroDivisionError):
    return None


def last_number(text: str) -> fractions.Fraction | None:
  """The last number in `text`, exactly; None when there is none."""
  for match in reversed(_NUMBER.findall(text)):
    value = parse_number(match)
    if value is not None:
      return value
  return None


def is_number(text: str) -> bool:
  """True when the whole stripped `text` is one number."""
  return bool(_NUMBER.fullmatch(text.strip())) and parse_number(text) is not None


def exact_match(completion: str, example: dict) -> float:
  """1.0 when the (tagged, else whole) completion equals the answer after stripping whitespace."""
  tagged = extract_answer(completion)
  candidate = completion if tagged is None else tagged
  return 1.0 if candidate.strip() == str(example["answer"]).strip() else 0.0


def numeric_match(completion: str, example: dict) -> float:
  """1.0 when the completion's number equals the answer's, compared exactly as fractions.

  The completion's number is the last number of its tagged answer (\\boxed{} or "answer:") when it
  has one, else the last number anywhere in it; the reference's is the last number of "answer".
  """
  reference = last_number(str(example["answer"]))
  if reference is None:
    raise ValueError(f"example answer {example['answer']!r} holds no number")
  tagged = extract_answer(completion)
  value = last_number(completion if tagged is None else tagged)
  return 1.0 if value is not None and value == reference else 0.0


def format_reward(completion: str, example: dict) -> float:
  """1.0 when the completion is in the expected short-answer format, else 0.0.

  Expected: one non-empty line; when the reference answer is a number, that line (or its tagged
  answer) must be exactly one number, e.g. "19", "answer: 19" or "\\boxed{19}", not "19 apples".
  """
  text = completion.strip()
  if not text or "\n" in text:
    return 0.0
  if not is_number(str(example["answer"])):
    return 1.0
  tagged = extract_answer(text)
  return 1.0 if is_number(text if tagged is None else tagged) else 0.0


def tagged_format(completion: str, example: dict) -> float:
  """1.0 when the completion tags its answer with \\boxed{} or "answer:", else 0.0."""
  del example
  return 0.0 if extract_answer(completion) is None else 1.0
