"""The "code" reward: run the completion's program against the example's unit tests in the sandbox.

`code_reward(completion, example)` extracts the program (the last ```python block, else the whole
text), runs code_harness.py with it in a sandbox through a shared `SandboxPool`, and returns 1.0
when every test passes (all-or-nothing) or, for `code_partial`, the fraction passed. The example
carries "tests": a list of {"call": "f(2)", "expected": <JSON value>} (compared strictly, by the
harness's parent process, which the candidate cannot read) or assert-statement strings (passed
when they run without raising; these trust the candidate's process). See rl/envs/code_tasks.py.

Thread-safe and blocking: the RL loop calls rewards from its own threads; each call waits for its
own sandbox run, bounded by `Limits.timeout_s` (plus the host's grace), so a slow or hostile sample
delays only itself. A harness that reports nothing scores 0 with the reason in `CodeScore.reason`.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pathlib
import re
import secrets
import threading
from typing import Sequence

import numpy as np

from meshrl.rl.sandbox import Limits, SandboxPool, SandboxResult
from meshrl.rl.sandbox.result import SANDBOX_ERROR, EnvFailure

HARNESS = (pathlib.Path(__file__).parent / "code_harness.py").read_text()
DEFAULT_LIMITS = Limits(timeout_s=6.0, cpu_s=6.0, memory_mb=512, max_processes=16, disk_mb=32,
                        max_output_bytes=64 * 1024)
_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_POOL: SandboxPool | None = None
_POOL_LOCK = threading.Lock()


def shared_pool() -> SandboxPool:
  """The process-wide pool the code reward scores through (created on first use)."""
  global _POOL  # pylint: disable=global-statement
  with _POOL_LOCK:
    if _POOL is None:
      _POOL = SandboxPool(max(2, os.cpu_count() or 2), limits=DEFAULT_LIMITS)
      # Before concurrent.futures joins the worker threads at exit (see SandboxPool.close).
      getattr(threading, "_register_atexit", atexit.register)(_POOL.close)
    return _POOL


def extract_code(completion: str) -> str:
  """The last fenced code block (```python, ```py or bare ```), else the whole completion."""
  blocks = _FENCED.findall(completion)
  return blocks[-1] if blocks else completion


def check_tests(example: dict) -> list:
  """The example's "tests", checked; ValueError naming what is wrong."""
  if not isinstance(example, dict) or "tests" not in example:
    raise ValueError("example has no 'tests': the code reward needs a list of unit tests "
                     "({'call', 'expected'} dicts or assert strings).")
  tests = example["tests"]
  if not isinstance(tests, list) or not tests:
    raise ValueError(f"example 'tests' must be a non-empty list, got {tests!r:.80}.")
  for index, test in enumerate(tests):
    structured = isinstance(test, dict) and isinstance(test.get("call"), str) and "expected" in test
    if not (structured or isinstance(test, str)):
      raise ValueError(f"example tests[{index}]={test!r:.80} must be an assert string or a "
                       f"{{'call': str, 'expected': value}} dict.")
  try:
    json.dumps(tests)
  except (TypeError, ValueError) as error:
    raise ValueError(f"example 'tests' must be JSON values: {error}") from None
  return tests


@dataclasses.dataclass(frozen=True)
class CodeScore:
  """passed of total tests; `reason` is set when the harness did not report (then passed=0)."""
  passed: int
  total: int
  reason: str | None
  errors: tuple[str, ...]
  result: SandboxResult | None

  def reward(self, partial: bool) -> float:
    if partial:
      return self.passed / self.total
    return float(self.passed == self.total)


def _summary(result: SandboxResult, nonce: str) -> dict | None:
  for line in reversed(result.stdout_text.splitlines()):
    if line.startswith(nonce + " "):
      try:
        summary = json.loads(line[len(nonce) + 1:])
      except ValueError:
        return None
      return summary if isinstance(summary, dict) else None
  return None


def _request(completion: str, tests: list, limits: Limits) -> tuple[dict, str]:
  nonce = secrets.token_hex(16)
  spec = {"nonce": nonce, "tests": tests, "budget_s": max(limits.timeout_s - 1.0,
                                                         limits.timeout_s / 2)}
  return {"solution.py": extract_code(completion), "tests.json": json.dumps(spec)}, nonce


def _score(result: SandboxResult, nonce: str, total: int) -> CodeScore:
  """The tests' outcome; EnvFailure when the sandbox itself failed (it could not start, or its
  supervisor broke), which is no verdict on the code: RewardPool retries it, then leaves the sample
  out of the update and counts it against its task."""
  if (result.killed_reason or "").startswith(SANDBOX_ERROR):
    raise EnvFailure(result.killed_reason)
  summary = _summary(result, nonce)
  if summary is None or not isinstance(summary.get("passed"), int):
    reason = result.killed_reason or (f"harness reported nothing (exit {result.exit_code}): "
                                      f"{result.stderr_text[-300:].strip()}")
    return CodeScore(0, total, reason, (), result)
  passed = min(max(summary["passed"], 0), total)
  errors = tuple(str(e) for e in summary.get("errors", []))[:3]
  return CodeScore(passed, total, None, errors, result)


def _scored(result: SandboxResult, nonce: str, total: int) -> CodeScore | EnvFailure:
  try:
    return _score(result, nonce, total)
  except EnvFailure as failure:
    return failure


@dataclasses.dataclass(frozen=True)
class CodeReward:
  """Reward `(completion, example) -> float` from the example's unit tests, run in the sandbox.

  partial: fraction of tests passed instead of all-or-nothing.
  limits: the sandbox limits of one run (the whole test file shares them).
  pool: the SandboxPool to run through (default: `shared_pool()`).
  """
  partial: bool = False
  limits: Limits = DEFAULT_LIMITS
  pool: SandboxPool | None = dataclasses.field(default=None, compare=False, repr=False)

  def _pool(self) -> SandboxPool:
    return self.pool or shared_pool()

  def score(self, completion: str, example: dict) -> CodeScore:
    """Runs one completion; ValueError when the example's tests are missing or malformed."""
    tests = check_tests(example)
    files, nonce = _request(str(completion), tests, self.limits)
    result = self._pool().submit(HARNESS, files=files, limits=self.limits).result()
    return _score(result, nonce, len(tests))

  def score_many(self, completions: Sequence[str], examples: Sequence[dict]
                 ) -> list[CodeScore | ValueError | EnvFailure]:
    """Scores a batch concurrently through the pool; bad examples come back as their ValueError, a
    sandbox that failed as its EnvFailure."""
    pending = []
    for completion, example in zip(completions, examples, strict=True):
      try:
        tests = check_tests(example)
      except ValueError as error:
        pending.append(error)
        continue
      files, nonce = _request(str(completion), tests, self.limits)
      future = self._pool().submit(HARNESS, files=files, limits=self.limits)
      pending.append((future, nonce, len(tests)))
    return [item if isinstance(item, ValueError) else _scored(item[0].result(), *item[1:])
            for item in pending]

  def rewards(self, completions: Sequence[str], examples: Sequence[dict]) -> np.ndarray:
    """[N] float32 rewards for a batch (a bad example, or a failed sandbox, scores 0)."""
    scores = self.score_many(completions, examples)
    return np.array([0.0 if isinstance(s, Exception) else s.reward(self.partial)
                     for s in scores], np.float32)

  def __call__(self, completion: str, example: dict) -> float:
    return self.score(completion, example).reward(self.partial)


code_reward = CodeReward(partial=False)
code_partial_reward = CodeReward(partial=True)
CODE_REWARDS = {"code": code_reward, "code_partial": code_partial_reward}
