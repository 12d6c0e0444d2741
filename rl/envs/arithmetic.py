"""Multi-digit arithmetic: "12+7=" -> "19". Verified by the "numeric" verifier.

Levels: 1 one-digit + and - (never negative); 2 two-digit + and -; 3 three-digit + and -, or a
two-digit times a one-digit number; 4 three two-digit operands with + and - (may be negative).
"""

from __future__ import annotations

import numpy as np

LEVELS = 4
VERIFIER = "numeric"


def _pair(rng: np.random.Generator, low: int, high: int, op: str) -> tuple[int, int]:
  a, b = (int(x) for x in rng.integers(low, high + 1, size=2))
  return (max(a, b), min(a, b)) if op == "-" else (a, b)


def arithmetic(rng: np.random.Generator, difficulty: int) -> dict:
  """One example {"prompt": "a+b=", "answer": str(value)} at `difficulty` (1..LEVELS)."""
  if difficulty == 4:
    a, b, c = (int(x) for x in rng.integers(10, 100, size=3))
    op1, op2 = (str(op) for op in rng.choice(["+", "-"], size=2))
    expression = f"{a}{op1}{b}{op2}{c}"
    value = (a + b if op1 == "+" else a - b) + (c if op2 == "+" else -c)
    return {"prompt": expression + "=", "answer": str(value)}
  if difficulty == 3 and rng.random() < 1 / 3:
    a, b = int(rng.integers(10, 100)), int(rng.integers(2, 10))
    return {"prompt": f"{a}*{b}=", "answer": str(a * b)}
  op = str(rng.choice(["+", "-"]))
  low, high = {1: (0, 9), 2: (10, 99), 3: (100, 999)}[difficulty]
  a, b = _pair(rng, low, high, op)
  return {"prompt": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a - b)}
