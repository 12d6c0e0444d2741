"""Generated terminal tasks in the directory format (rl/envs/terminal.py), and planted faults.

  write_tasks(out, per_family=12, seed=0)  -> task folder names  (scripts/make_terminal_tasks.py)
  write_planted_faults(out)                -> {folder: fault kind} (the quality gate's own test)

Families (the task's domain is "term_<family>"):
  create   create a file with given content
  edit     change one key of a settings file, keep the other lines
  pyfix    fix a one-token bug in a Python function so its (hidden) tests pass
  search   count the lines that contain a word across log files
  compute  compute a statistic of a numbers file with a tool (awk, bc, python3), write it out
  find     name the one file under data/ that contains a token

Every task's check.sh exits 0 when solved and 1 when not (never 126/127: those mean a broken check);
Python checks run hidden tests from the check script itself, so editing the visible test file does
not help. Each generated task passes the quality gate (tests/rl/test_env_quality.py).
"""

from __future__ import annotations

import json
import os
import shlex
from typing import Callable

import numpy as np

MAX_TURNS, TIMEOUT_S = 6, 10.0
_WORDS = ("alpha", "bravo", "delta", "ember", "fjord", "gamma", "harbor", "iris", "jade", "kilo",
          "lemon", "maple", "nova", "onyx", "pixel", "quartz", "raven", "sierra", "tango", "umber")


def _words(rng: np.random.Generator, count: int) -> list[str]:
  return [str(w) for w in rng.choice(_WORDS, size=count, replace=False)]


def _verdict(condition: str) -> str:
  """A check body that exits 0 when the shell `condition` holds, else 1."""
  return f"if {condition}; then exit 0; else exit 1; fi\n"


def _create(rng, index):
  name = f"{_words(rng, 1)[0]}_{index}.txt"
  text = " ".join(_words(rng, 3))
  return {"prompt": f"Create a file named {name} whose only line is: {text}",
          "setup": {}, "oracle": f"printf '%s\\n' {shlex.quote(text)} > {name}\n",
          "check": f"[ -f {name} ] || exit 1\n" + _verdict(f'[ "$(cat {name})" = {shlex.quote(text)} ]')}


def _edit(rng, index):
  keys = _words(rng, 4)
  values = [str(int(v)) for v in rng.integers(1, 100, size=4)]
  target, new = keys[int(rng.integers(4))], str(int(rng.integers(100, 1000)))
  lines = [f"{k}={v}" for k, v in zip(keys, values)]
  expected = "\n".join(f"{k}={new if k == target else v}" for k, v in zip(keys, values)) + "\n"
  return {"prompt": f"In settings_{index}.ini set {target} to {new}; leave the other lines as they are.",
          "setup": {f"settings_{index}.ini": "\n".join(lines) + "\n"},
          "oracle": f"sed -i 's/^{target}=.*/{target}={new}/' settings_{index}.ini\n",
          "check": f"[ -f settings_{index}.ini ] || exit 1\n"
                   f"expected={shlex.quote(expected)}\n"
                   + _verdict(f'[ "$(cat settings_{index}.ini)" = "$(printf "%s" "$expected")" ]')}


# (function source with the bug, the fixed source, test lines); {n} is a per-task constant.
_PY_BUGS = (
    ("def add_{n}(a, b):\n  return a - b\n", "def add_{n}(a, b):\n  return a + b\n",
     ["assert m.add_{n}(2, {n}) == {n} + 2", "assert m.add_{n}(-1, 1) == 0"]),
    ("def last_{n}(xs):\n  return xs[len(xs)]\n", "def last_{n}(xs):\n  return xs[-1]\n",
     ["assert m.last_{n}([1, {n}]) == {n}", "assert m.last_{n}(['a']) == 'a'"]),
    ("def is_even_{n}(k):\n  return k % 2 == 1\n", "def is_even_{n}(k):\n  return k % 2 == 0\n",
     ["assert m.is_even_{n}(2 * {n})", "assert not m.is_even_{n}(2 * {n} + 1)"]),
    ("def clamp_{n}(x, lo, hi):\n  return max(lo, min(x, lo))\n",
     "def clamp_{n}(x, lo, hi):\n  return max(lo, min(x, hi))\n",
     ["assert m.clamp_{n}({n}, 0, 1000) == {n}", "assert m.clamp_{n}(5000, 0, 1000) == 1000",
      "assert m.clamp_{n}(-3, 0, 9) == 0"]),
    ("def total_{n}(xs):\n  s = 0\n  for x in xs[1:]:\n    s += x\n  return s\n",
     "def total_{n}(xs):\n  s = 0\n  for x in xs:\n    s += x\n  return s\n",
     ["assert m.total_{n}([{n}, 1, 2]) == {n} + 3", "assert m.total_{n}([]) == 0"]),
    ("def fact_{n}(k):\n  r = 1\n  for i in range(1, k):\n    r *= i\n  return r\n",
     "def fact_{n}(k):\n  r = 1\n  for i in range(1, k + 1):\n    r *= i\n  return r\n",
     ["assert m.fact_{n}(5) == 120", "assert m.fact_{n}(1) == 1"]),
)


def _pyfix(rng, index):
  buggy, fixed, tests = _PY_BUGS[index % len(_PY_BUGS)]
  n = int(rng.integers(3, 90))
  module = f"calc{index}"
  buggy, fixed = buggy.format(n=n), fixed.format(n=n)
  test = f"import {module} as m\n" + "\n".join(t.format(n=n) for t in tests) + "\nprint('ok')\n"
  return {"prompt": f"{module}.py has a bug: fix it so that python3 test_{module}.py passes.",
          "setup": {f"{module}.py": buggy, f"test_{module}.py": test},
          "oracle": f"cat > {module}.py <<'EOF'\n{fixed}EOF\n",
          "check": f"python3 - <<'EOF' >/dev/null 2>&1 || exit 1\n{test}EOF\nexit 0\n"}


def _search(rng, index):
  word = _words(rng, 1)[0]
  files, count = {}, 0
  for f in range(3):
    lines = []
    for _ in range(int(rng.integers(4, 9))):
      has = bool(rng.random() < 0.4)
      count += has
      filler = [w for w in _words(rng, 3) if w != word]
      lines.append(" ".join(filler + ([word] if has else [])))
    files[f"logs/app{f}.log"] = "\n".join(lines) + "\n"
  return {"prompt": f"Count the lines that contain the word {word} in the .log files under logs/ "
                    f"and write the number to count_{index}.txt.",
          "setup": files, "oracle": f"cat logs/*.log | grep -c -w {word} > count_{index}.txt\n",
          "check": f"[ -f count_{index}.txt ] || exit 1\n"
                   + _verdict(f'[ "$(tr -d " \\n" < count_{index}.txt)" = "{count}" ]')}


def _compute(rng, index):
  numbers = [int(x) for x in rng.integers(1, 500, size=int(rng.integers(5, 12)))]
  kind = ("sum", "max", "product of the first three")[index % 3]
  value = {"sum": sum(numbers), "max": max(numbers),
           "product of the first three": numbers[0] * numbers[1] * numbers[2]}[kind]
  oracle = {"sum": "awk '{s += $1} END {print s}' numbers.txt",
            "max": "sort -n numbers.txt | tail -n 1",
            "product of the first three": "head -n 3 numbers.txt | paste -sd '*' | bc"}[kind]
  return {"prompt": f"Compute the {kind} of the numbers in numbers.txt (one per line) and write it "
                    f"to result_{index}.txt.",
          "setup": {"numbers.txt": "\n".join(map(str, numbers)) + "\n"},
          "oracle": f"{oracle} > result_{index}.txt\n",
          "check": f"[ -f result_{index}.txt ] || exit 1\n"
                   + _verdict(f'[ "$(tr -d " \\n" < result_{index}.txt)" = "{value}" ]')}


def _find(rng, index):
  token = f"key{int(rng.integers(10**5, 10**6))}"
  names = _words(rng, 5)
  hit = names[int(rng.integers(5))]
  files = {f"data/{n}.txt": " ".join(_words(rng, 4)) + (f" {token}" if n == hit else "") + "\n"
           for n in names}
  return {"prompt": f"Exactly one file under data/ contains {token}. Write its path (like "
                    f"data/x.txt) to found_{index}.txt.",
          "setup": files, "oracle": f"grep -l {token} data/*.txt > found_{index}.txt\n",
          "check": f"[ -f found_{index}.txt ] || exit 1\n"
                   + _verdict(f'[ "$(tr -d " \\n" < found_{index}.txt)" = "data/{hit}.txt" ]')}


FAMILIES: dict[str, Callable] = {"create": _create, "edit": _edit, "pyfix": _pyfix,
                                 "search": _search, "compute": _compute, "find": _find}


def write_task(directory: str, meta: dict, spec: dict) -> None:
  """Writes one task folder: task.json, setup/, check.sh, oracle.sh."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "task.json"), "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
  for name in ("check", "oracle"):
    with open(os.path.join(directory, f"{name}.sh"), "w", encoding="utf-8") as f:
      f.write("#!/bin/bash\n" + spec[name])
  for path, text in spec["setup"].items():
    full = os.path.join(directory, "setup", path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w", encoding="utf-8") as f:
      f.write(text)


def make_task(family: str, index: int, seed: int = 0) -> tuple[dict, dict]:
  """(task.json fields, {"prompt", "setup", "oracle", "check"}) of task `index` of `family`."""
  if family not in FAMILIES:
    raise ValueError(f"family={family!r} is unknown; choose one of {sorted(FAMILIES)}.")
  rng = np.random.default_rng([seed, sorted(FAMILIES).index(family), index])
  spec = FAMILIES[family](rng, index)
  meta = {"id": f"{family}-{seed}-{index:03d}", "domain": f"term_{family}", "prompt": spec["prompt"],
          "max_turns": MAX_TURNS, "timeout_s": TIMEOUT_S}
  return meta, spec


def write_tasks(out: str, *, per_family: int = 12, seed: int = 0,
                families: tuple[str, ...] = tuple(FAMILIES)) -> list[str]:
  """Writes per_family tasks of each family under `out`; returns their folder names."""
  if per_family < 1:
    raise ValueError(f"per_family={per_family} must be >= 1.")
  names = []
  for family in families:
    for index in range(per_family):
      meta, spec = make_task(family, index, seed)
      write_task(os.path.join(out, meta["id"]), meta, spec)
      names.append(meta["id"])
  return names


# --- planted faults: what the quality gate must catch ------------------------------------------


def _fault(out: str, folder: str, kind: str, **changes) -> None:
  """A sound `create` task under `folder`, then `changes`: meta updates, replaced scripts, raw files
  (name -> bytes, or None to delete)."""
  meta, spec = make_task("create", 900 + len(os.listdir(out)) if os.path.isdir(out) else 900, seed=7)
  meta["id"] = f"fault-{kind}"
  meta.update(changes.pop("meta", {}))
  for key in ("oracle", "check"):
    if key in changes:
      spec[key] = changes.pop(key)
  spec["oracle"] += changes.pop("oracle_suffix", "")
  directory = os.path.join(out, folder)
  write_task(directory, meta, spec)
  for name, data in changes.pop("files", {}).items():
    path = os.path.join(directory, name)
    if data is None:
      os.remove(path)
    elif data == "SYMLINK":
      os.makedirs(os.path.dirname(path), exist_ok=True)
      os.symlink("/etc/passwd", path)
    else:
      with open(path, "wb") as f:
        f.write(data)
  if changes:
    raise ValueError(f"unknown fault changes {sorted(changes)}")


FAULTS = {
    "invalid_json": dict(files={"task.json": b'{"id": "x", "prompt": '}),
    "missing_check": dict(files={"check.sh": None}),
    "missing_oracle": dict(files={"oracle.sh": None}),
    "missing_field": dict(files={"task.json": b'{"id": "fault-missing_field", "domain": "d", '
                                              b'"max_turns": 3, "timeout_s": 5}'}),
    "bad_type": dict(meta={"max_turns": "3"}),
    "unknown_field": dict(meta={"difficulty": 2}),
    "not_utf8": dict(files={"check.sh": b"#!/bin/bash\n# \xff\xfe\nexit 0\n"}),
    "setup_symlink": dict(files={"setup/link": "SYMLINK"}),
    "wrong_oracle": dict(oracle="echo wrong > nothing.txt\n"),
    "oracle_error": dict(oracle_suffix="exit 3\n"),  # solves the task, then fails
    "empty_passes": dict(check="exit 0\n"),
    # passes or fails by the parity of its process id: repeated checks disagree (not by chance)
    "flaky_check": dict(check="exit $(( $$ % 2 ))\n"),
    "stateful_check": dict(check="[ -e .checked ] && exit 1\ntouch .checked\nexit 0\n"),
    "oracle_timeout": dict(oracle="sleep 600\n", meta={"timeout_s": 1.0}),
    "check_timeout": dict(check="sleep 600\n", meta={"timeout_s": 1.0}),
    "check_crash": dict(check="no_such_checker_tool --verify\n"),
    "bad_timeout": dict(meta={"timeout_s": -1}),
    "duplicate_id": dict(meta={"id": "fault-wrong_oracle"}),
}


def write_planted_faults(out: str) -> dict[str, str]:
  """Writes one broken task per kind of FAULTS under `out` (folder "fault_<kind>"); returns
  {folder: kind}. Every one must be quarantined by the quality gate."""
  os.makedirs(out, exist_ok=True)
  written = {}
  for kind, changes in FAULTS.items():
    folder = f"fault_{kind}" if kind != "duplicate_id" else "zz_fault_duplicate_id"
    _fault(out, folder, kind, **{k: (dict(v) if isinstance(v, dict) else v) for k, v in changes.items()})
    written[folder] = kind
  return written
