"""Countdown verifier: does an arithmetic expression use the given numbers and hit the target?

The expression is parsed with `ast` and walked by hand: only integer literals, parentheses and the
four operators + - * / are accepted, evaluated exactly with `fractions.Fraction`. Nothing is
`eval`ed, and the numbers are checked before anything is computed, so a completion cannot run code
or build huge numbers.
"""

from __future__ import annotations

import ast
import collections
import fractions
import operator
import re

from meshrl.rl.rewards.verifiers import extract_answer

MAX_EXPRESSION_CHARS = 100

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv}
_EXPRESSION_CHARS = re.compile(r"[0-9+\-*/() ]+")


def _literals(node: ast.AST) -> list[int]:
  """Integer literals of a parsed expression; ValueError for anything but literals and + - * /."""
  if isinstance(node, ast.Expression):
    return _literals(node.body)
  if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
    return _literals(node.left) + _literals(node.right)
  if isinstance(node, ast.Constant) and type(node.value) is int:
    return [node.value]
  raise ValueError(f"disallowed expression element {type(node).__name__}")


def _evaluate(node: ast.AST) -> fractions.Fraction:
  """Exact value of an expression already checked by `_literals` (ZeroDivisionError possible)."""
  if isinstance(node, ast.Expression):
    return _evaluate(node.body)
  if isinstance(node, ast.BinOp):
    return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
  return fractions.Fraction(node.value)


def parse_expression(text: str) -> ast.Expression:
  """Parses `text` as a + - * / expression over integer literals; ValueError otherwise."""
  text = text.strip()
  if not text or len(text) > MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.fullmatch(text):
    raise ValueError(f"not a short arithmetic expression: {text[:40]!r}")
  tree = ast.parse(text, mode="eval")
  _literals(tree)
  return tree


def expression_value(text: str) -> fractions.Fraction:
  """Exact value of a countdown expression (ValueError / ZeroDivisionError when invalid)."""
  return _evaluate(parse_expression(text))


def check_expression(text: str, numbers, target) -> bool:
  """True when `text` uses each of `numbers` exactly once and equals `target`."""
  try:
    tree = parse_expression(text)
    if collections.Counter(_literals(tree)) != collections.Counter(int(n) for n in numbers):
      return False
    return _evaluate(tree) == fractions.Fraction(target)
  except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
    return False


def _candidate_expression(completion: str) -> str:
  """The expression part of a completion: its tagged answer if any, else the completion; then the
  first line, before any '=' (so "3*5+7=22" and "answer: 3*5+7" both work)."""
  tagged = extract_answer(completion)
  lines = (completion if tagged is None else tagged).strip().splitlines()
  return lines[0].split("=")[0] if lines else ""


def countdown_reward(completion: str, example: dict) -> float:
  """1.0 when the completion is an expression over exactly `example["numbers"]` equal to
  `example["target"]`, else 0.0.

  Without "numbers"/"target" (e.g. a JSONL row) both come from the reference `example["answer"]`:
  its literals and its value.
  """
  if "numbers" in example and "target" in example:
    numbers, target = example["numbers"], example["target"]
  else:
    reference = parse_expression(str(example["answer"]))
    numbers, target = _literals(reference), _evaluate(reference)
  return 1.0 if check_expression(_candidate_expression(completion), numbers, target) else 0.0
