"""String tasks over short random sequences, verified by the "exact" verifier.

reverse "rev abc=" -> "cba"; sort "sort 3142=" -> "1234"; copy "copy abc=" -> "abc".
Levels set the length and alphabet: 1 three symbols, 2 five, 3 seven, 4 ten (letters and digits).
"""

from __future__ import annotations

import string

import numpy as np

LEVELS = 4
VERIFIER = "exact"

_LETTERS = string.ascii_lowercase
_DIGITS = string.digits
# (length, alphabet for reverse/copy, alphabet for sort) per level.
_SHAPES = {1: (3, _LETTERS, _DIGITS), 2: (5, _LETTERS, _DIGITS), 3: (7, _LETTERS, _LETTERS),
           4: (10, _LETTERS + _DIGITS, _LETTERS + _DIGITS)}


def _symbols(rng: np.random.Generator, difficulty: int, *, for_sort: bool = False) -> str:
  length, alphabet, sort_alphabet = _SHAPES[difficulty]
  alphabet = sort_alphabet if for_sort else alphabet
  return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), size=length))


def reverse(rng: np.random.Generator, difficulty: int) -> dict:
  """{"prompt": "rev abc=", "answer": "cba"}."""
  symbols = _symbols(rng, difficulty)
  return {"prompt": f"rev {symbols}=", "answer": symbols[::-1]}


def sort(rng: np.random.Generator, difficulty: int) -> dict:
  """{"prompt": "sort 3142=", "answer": "1234"} (byte order)."""
  symbols = _symbols(rng, difficulty, for_sort=True)
  return {"prompt": f"sort {symbols}=", "answer": "".join(sorted(symbols))}


def copy(rng: np.random.Generator, difficulty: int) -> dict:
  """{"prompt": "copy abc=", "answer": "abc"}."""
  symbols = _symbols(rng, difficulty)
  return {"prompt": f"copy {symbols}=", "answer": symbols}
