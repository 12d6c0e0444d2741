"""Code: write a small Python function; graded by running unit tests in the sandbox.

Generated offline from the seed: a template (what the function does) with random constants, its
reference solution (the "answer", Python source) and unit tests. Each test is {"call": "f(3)",
"expected": 7}: the "code" reward (rl/rewards/code.py) evaluates the call in the sandbox and
compares the value strictly (same JSON type and value), so an object that claims to equal anything
does not pass. Expected values come from a separate Python implementation in this file, never from
running the reference source, so the two check each other (tests/rl/test_code_reward.py).
Levels: 1 one-line arithmetic/string functions; 2 loops over a list or a string; 3 small
algorithms (run-length encoding, FizzBuzz variants, Collatz steps, digit powers, second largest).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

LEVELS = 3
VERIFIER = "code"
_FENCE = "```"


@dataclasses.dataclass(frozen=True)
class _Template:
  """One family: name(params) of its function, a description, its source and its semantics."""
  name: str
  args: str  # the parameter list, e.g. "xs"
  params: Callable[[np.random.Generator], dict]
  describe: Callable[[dict], str]
  source: Callable[[dict], str]  # reference solution (body after the def line)
  expected: Callable[[dict, tuple], Any]  # independent implementation
  inputs: Callable[[np.random.Generator, dict], list[tuple]]


def _ints(rng, count, low, high):
  return [int(v) for v in rng.integers(low, high + 1, size=count)]


def _word(rng, alphabet="abcde", low=1, high=8):
  return "".join(alphabet[int(i)] for i in rng.integers(0, len(alphabet), rng.integers(low, high + 1)))


def _lists(rng, count, low=-20, high=20):
  return [(_ints(rng, int(rng.integers(0, 9)), low, high),) for _ in range(count)]


def _rle_expected(s):
  out, i = [], 0
  while i < len(s):
    j = i
    while j < len(s) and s[j] == s[i]:
      j += 1
    out.append(f"{s[i]}{j - i}")
    i = j
  return "".join(out)


def _collatz_expected(p, n):
  for steps in range(p["cap"]):
    if n == 1:
      return steps
    n = 3 * n + 1 if n % 2 else n // 2
  return p["cap"]


def _second_largest_expected(xs):
  distinct = sorted(set(xs))
  return distinct[-2] if len(distinct) >= 2 else None


_LEVEL_1 = (
    _Template(
        "scale_add", "x", lambda r: {"a": int(r.integers(2, 10)), "b": int(r.integers(-9, 10))},
        lambda p: f"returns x times {p['a']} plus {p['b']}",
        lambda p: f"return x * {p['a']} + ({p['b']})",
        lambda p, a: a[0] * p["a"] + p["b"], lambda r, p: [(v,) for v in _ints(r, 4, -50, 50)]),
    _Template(
        "clamp", "x", lambda r: {"lo": int(r.integers(-10, 0)), "hi": int(r.integers(1, 11))},
        lambda p: f"returns x limited to the range {p['lo']}..{p['hi']} (inclusive)",
        lambda p: f"return max({p['lo']}, min({p['hi']}, x))",
        lambda p, a: sorted([p["lo"], a[0], p["hi"]])[1],
        lambda r, p: [(p["lo"] - 3,), (p["hi"] + 2,), (0,), (p["hi"],)]),
    _Template(
        "is_multiple", "n", lambda r: {"k": int(r.integers(2, 10))},
        lambda p: f"returns True when n is divisible by {p['k']}, else False",
        lambda p: f"return n % {p['k']} == 0",
        lambda p, a: not a[0] % p["k"], lambda r, p: [(p["k"] * 3,), (p["k"] + 1,), (0,), (-p["k"],)]),
    _Template(
        "repeat_word", "s", lambda r: {"k": int(r.integers(2, 5)), "sep": str(r.choice(["-", "+", " "]))},
        lambda p: f"returns s repeated {p['k']} times, joined by {p['sep']!r}",
        lambda p: f"return {p['sep']!r}.join([s] * {p['k']})",
        lambda p, a: p["sep"].join(a[0] for _ in range(p["k"])),
        lambda r, p: [(_word(r),), (_word(r),), ("",), (_word(r),)]),
)

_LEVEL_2 = (
    _Template(
        "count_above", "xs", lambda r: {"t": int(r.integers(-5, 6))},
        lambda p: f"returns how many numbers in the list xs are greater than {p['t']}",
        lambda p: f"return sum(1 for x in xs if x > {p['t']})",
        lambda p, a: len([x for x in a[0] if x > p["t"]]), lambda r, p: _lists(r, 5)),
    _Template(
        "sum_multiples", "xs", lambda r: {"k": int(r.integers(2, 6))},
        lambda p: f"returns the sum of the numbers in the list xs that are divisible by {p['k']}",
        lambda p: f"return sum(x for x in xs if x % {p['k']} == 0)",
        lambda p, a: sum(filter(lambda x: x % p["k"] == 0, a[0])),
        lambda r, p: _lists(r, 5)),
    _Template(
        "count_char", "s", lambda r: {"c": str(r.choice(list("abcde")))},
        lambda p: f"returns how many times the letter {p['c']!r} occurs in s, ignoring case",
        lambda p: f"return s.lower().count({p['c']!r})",
        lambda p, a: sum(ch in (p["c"], p["c"].upper()) for ch in a[0]),
        lambda r, p: [(_word(r, "abcdeABCDE", 0, 12),) for _ in range(5)]),
    _Template(
        "shift_letters", "s", lambda r: {"k": int(r.integers(1, 26))},
        lambda p: (f"returns s with every lowercase letter a-z shifted {p['k']} places forward in "
                   f"the alphabet (wrapping z to a); other characters unchanged"),
        lambda p: ("return ''.join(chr((ord(c) - 97 + %d) %% 26 + 97) if 'a' <= c <= 'z' else c "
                   "for c in s)" % p["k"]),
        lambda p, a: a[0].translate(str.maketrans(
            "abcdefghijklmnopqrstuvwxyz",
            "abcdefghijklmnopqrstuvwxyz"[p["k"]:] + "abcdefghijklmnopqrstuvwxyz"[:p["k"]])),
        lambda r, p: [(_word(r, "abxyz -!", 0, 10),) for _ in range(5)]),
    _Template(
        "running_max", "xs", lambda r: {},
        lambda p: "returns a list whose i-th item is the largest of xs[0..i]",
        lambda p: ("out = []\n    for x in xs:\n        out.append(x if not out else max(out[-1], x))"
                   "\n    return out"),
        lambda p, a: [max(a[0][:i + 1]) for i in range(len(a[0]))], lambda r, p: _lists(r, 5)),
)

_LEVEL_3 = (
    _Template(
        "fizz", "n", lambda r: {"a": int(r.integers(2, 5)), "b": int(r.integers(5, 8))},
        lambda p: (f"returns a list for i = 1..n: 'FizzBuzz' if i is divisible by both {p['a']} "
                   f"and {p['b']}, 'Fizz' if only by {p['a']}, 'Buzz' if only by {p['b']}, "
                   f"else str(i)"),
        lambda p: ("out = []\n    for i in range(1, n + 1):\n"
                   f"        word = ('Fizz' if i % {p['a']} == 0 else '') + "
                   f"('Buzz' if i % {p['b']} == 0 else '')\n"
                   "        out.append(word or str(i))\n    return out"),
        lambda p, a: [{(True, True): "FizzBuzz", (True, False): "Fizz", (False, True): "Buzz",
                       (False, False): str(i)}[(i % p["a"] == 0, i % p["b"] == 0)]
                      for i in range(1, a[0] + 1)],
        lambda r, p: [(0,), (1,), (p["a"] * p["b"],)] + [(v,) for v in _ints(r, 3, 2, 40)]),
    _Template(
        "rle", "s", lambda r: {},
        lambda p: ("returns the run-length encoding of s: each run of one repeated character as "
                   "the character followed by the run's length, e.g. 'aaab' -> 'a3b1'"),
        lambda p: ("out = ''\n    i = 0\n    while i < len(s):\n        j = i\n"
                   "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
                   "        out += s[i] + str(j - i)\n        i = j\n    return out"),
        lambda p, a: _rle_expected(a[0]),
        lambda r, p: [("",)] + [(_word(r, "aab", 1, 14),) for _ in range(5)]),
    _Template(
        "collatz_steps", "n", lambda r: {"cap": int(r.choice([20, 50, 100]))},
        lambda p: (f"returns how many steps take n to 1, where a step maps even n to n // 2 and "
                   f"odd n to 3 * n + 1; stop after {p['cap']} steps and return {p['cap']}"),
        lambda p: (f"steps = 0\n    while n != 1 and steps < {p['cap']}:\n"
                   "        n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
                   "        steps += 1\n    return steps"),
        lambda p, a: _collatz_expected(p, a[0]),
        lambda r, p: [(1,), (2,), (8,)] + [(v,) for v in _ints(r, 3, 3, 60)]),
    _Template(
        "digit_power_sum", "n", lambda r: {"e": int(r.integers(2, 5))},
        lambda p: f"returns the sum of each decimal digit of the non-negative integer n raised to the power {p['e']}",
        lambda p: f"return sum(int(d) ** {p['e']} for d in str(n))",
        lambda p, a: sum((a[0] // 10 ** i % 10) ** p["e"] for i in range(len(str(a[0])))),
        lambda r, p: [(0,), (7,)] + [(v,) for v in _ints(r, 4, 10, 99_999)]),
    _Template(
        "second_largest", "xs", lambda r: {},
        lambda p: "returns the second largest distinct value in the list xs, or None if there is none",
        lambda p: "distinct = sorted(set(xs))\n    return distinct[-2] if len(distinct) > 1 else None",
        lambda p, a: _second_largest_expected(a[0]),
        lambda r, p: [([],), ([4, 4],)] + _lists(r, 4, -9, 9)),
)

TEMPLATES = {1: _LEVEL_1, 2: _LEVEL_2, 3: _LEVEL_3}


def _call(name: str, args: tuple) -> str:
  return f"{name}({', '.join(repr(a) for a in args)})"


def code_task(rng: np.random.Generator, difficulty: int) -> dict:
  """One example: "prompt", "answer" (the reference solution's source), "tests" (list of
  {"call", "expected"}), "entry_point" (the function's name)."""
  templates = TEMPLATES[difficulty]
  template = templates[int(rng.integers(len(templates)))]
  params = template.params(rng)
  inputs = template.inputs(rng, params)
  tests = [{"call": _call(template.name, args), "expected": template.expected(params, args)}
           for args in inputs]
  signature = f"{template.name}({template.args})"
  answer = f"def {signature}:\n    {template.source(params)}\n"
  example_call = tests[-1]
  prompt = (f"Write a Python function `{signature}` that {template.describe(params)}. "
            f"For example, {example_call['call']} == {example_call['expected']!r}. "
            f"Answer with the code in a {_FENCE}python block.\n")
  return {"prompt": prompt, "answer": answer, "tests": tests, "entry_point": template.name}
