"""Countdown: reach a target from given numbers, "15 from 3 5=" -> "3*5".

Any expression that uses each given number exactly once and equals the target earns reward 1 (the
"countdown" verifier, rl/rewards/countdown.py); "answer" is one such expression, for warm-starts.
Levels: 1 two numbers 1..9 with + - *; 2 three numbers 1..9 with + - *; 3 four numbers 1..12 with
+ - * / (exact divisions only). Targets are positive integers.
"""

from __future__ import annotations

import numpy as np

LEVELS = 3
VERIFIER = "countdown"

# (how many numbers, largest number, operators) per level.
_SHAPES = {1: (2, 9, "+-*"), 2: (3, 9, "+-*"), 3: (4, 12, "+-*/")}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _operand(text: str, op: str | None, parent: str, *, right: bool) -> str:
  """Wraps a sub-expression in parentheses where precedence needs it."""
  if op is None:
    return text
  looser = _PRECEDENCE[op] < _PRECEDENCE[parent]
  non_associative = right and parent in "-/" and _PRECEDENCE[op] == _PRECEDENCE[parent]
  return f"({text})" if looser or non_associative else text


def _combine(rng: np.random.Generator, left, right, ops: str):
  """Joins two (value, text, op) nodes with a random operator that keeps values natural numbers."""
  (a, a_text, a_op), (b, b_text, b_op) = left, right
  op = str(rng.choice(list(ops)))
  if op == "-" and a < b:
    (a, a_text, a_op), (b, b_text, b_op) = (b, b_text, b_op), (a, a_text, a_op)
  if op == "/" and (b == 0 or a % b):
    op = "+"
  value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
  text = _operand(a_text, a_op, op, right=False) + op + _operand(b_text, b_op, op, right=True)
  return value, text, op


def countdown(rng: np.random.Generator, difficulty: int) -> dict:
  """One example with extra fields "numbers" (list of int) and "target" (int)."""
  count, largest, ops = _SHAPES[difficulty]
  while True:  # Redraw (deterministically) until the target is a positive integer.
    numbers = [int(n) for n in rng.integers(1, largest + 1, size=count)]
    nodes = [(n, str(n), None) for n in numbers]
    while len(nodes) > 1:  # Combine two random nodes until one expression is left.
      i, j = (int(k) for k in rng.choice(len(nodes), size=2, replace=False))
      joined = _combine(rng, nodes[i], nodes[j], ops)
      nodes = [node for k, node in enumerate(nodes) if k not in (i, j)] + [joined]
    target, expression, _ = nodes[0]
    if target > 0:
      break
  shown = " ".join(str(n) for n in numbers)
  return {"prompt": f"{target} from {shown}=", "answer": expression, "numbers": numbers,
          "target": int(target)}
