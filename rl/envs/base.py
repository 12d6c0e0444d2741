"""The one environment interface, the tool-call format, and single-turn tasks as one-step episodes.

  env.reset(task) -> observation (str)
  env.step(action_text) -> StepResult(observation, reward, done, info)

Single-turn tasks (the generated families, JSONL rows, code tasks) are `SingleTurnEnv`: the prompt is
the observation, the first action is scored by the task's reward and ends the episode. Multi-turn
environments (rl/envs/terminal.py) run tool calls until `<done>`, a budget or the turn limit.

Tool-call format (`parse_action`): one command per turn, between `<cmd>` and `</cmd>`; `<done>` ends
the episode. Why this and not a fenced ```bash block: a tag pair has no language tag, no nesting and no
ambiguity with backticks inside shell commands, it is a few bytes that a tiny byte-level model learns
quickly, and `</cmd>` doubles as the stop string that ends a generated turn, so the engine can hand
the turn to the environment as soon as the call is complete. Anything else is malformed and becomes
an error observation (never an exception): no tag, an unclosed `<cmd>`, two commands, an empty one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

CMD_OPEN, CMD_CLOSE, DONE = "<cmd>", "</cmd>", "<done>"
STOP_STRINGS = (CMD_CLOSE, DONE)  # a turn is complete once one of these is generated


class StepResult(NamedTuple):
  observation: str  # what the policy sees next ("" when done)
  reward: float  # the episode's reward at its end, 0.0 before
  done: bool
  info: dict  # "error": why an action was refused, "env_failure": reason the env broke, ...


class Environment(Protocol):
  """What the episode driver (rl/envs/episode.py) needs."""

  def reset(self, task: dict) -> str: ...

  def step(self, action_text: str) -> StepResult: ...


@dataclasses.dataclass(frozen=True)
class Action:
  """A parsed turn: kind "cmd" (with `command`), "done", or "error" (with `error`)."""
  kind: str
  command: str = ""
  error: str = ""


def parse_action(text: str) -> Action:
  """The tool call in one generated turn (see the module docstring); never raises."""
  if not isinstance(text, str):
    return Action("error", error=f"the turn is a {type(text).__name__}, not text")
  opened, closed = text.count(CMD_OPEN), text.count(CMD_CLOSE)
  if opened == 0 and closed == 0:
    if DONE in text:
      return Action("done")
    return Action("error", error=f"no tool call: write {CMD_OPEN}command{CMD_CLOSE}, or {DONE} to finish")
  if opened != 1 or closed != 1:
    return Action("error", error=f"one command per turn: found {opened} {CMD_OPEN} and {closed} {CMD_CLOSE}")
  start, end = text.index(CMD_OPEN) + len(CMD_OPEN), text.index(CMD_CLOSE)
  if end < start:
    return Action("error", error=f"{CMD_CLOSE} comes before {CMD_OPEN}")
  command = text[start:end].strip()
  if not command:
    return Action("error", error="the command is empty")
  if "\0" in command:
    return Action("error", error="the command contains a NUL byte")
  return Action("cmd", command=command)


def as_text(raw: Any) -> tuple[str, bool]:
  """(text, was_valid_utf8): bytes that are not UTF-8 are decoded with U+FFFD replacements."""
  if isinstance(raw, str):
    return raw, True
  if isinstance(raw, (bytes, bytearray)):
    try:
      return bytes(raw).decode("utf-8"), True
    except UnicodeDecodeError:
      return bytes(raw).decode("utf-8", errors="replace"), False
  return str(raw), False


class SingleTurnEnv:
  """A task scored once: `reward_fn(completion, task) -> float` (e.g. rl.rewards.answer_reward).

  The one-step case of the interface: reset returns the prompt, the first step scores the action and
  ends the episode. A reward function that raises is an environment failure (info["env_failure"]),
  scored 0 and never taken for a wrong answer.
  """

  def __init__(self, reward_fn: Callable[[str, dict], float]):
    self.reward_fn = reward_fn
    self.task: dict | None = None

  def reset(self, task: dict) -> str:
    if not isinstance(task, dict) or not isinstance(task.get("prompt"), str):
      raise ValueError(f"a single-turn task is a dict with a 'prompt' string, got {task!r:.80}.")
    self.task = task
    return task["prompt"]

  def step(self, action_text: str) -> StepResult:
    if self.task is None:
      raise RuntimeError("step() before reset().")
    task, self.task = self.task, None
    try:
      reward = float(self.reward_fn(action_text, task))
    except Exception as error:  # pylint: disable=broad-except  (a broken reward is the env's fault)
      return StepResult("", 0.0, True, {"env_failure": f"reward: {type(error).__name__}: {error}"})
    return StepResult("", reward, True, {})
