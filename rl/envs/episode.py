"""The host-side episode driver: a policy `generate(conversation) -> action_text` against an environment.

  episode = run_episode(env, task, generate, Budget(max_turns=4))

The conversation handed to `generate` is a list of {"role", "content"} messages: "user" (the task),
"assistant" (the policy's own turns, the only ones a loss may train on) and "tool" (observations).
Every call's conversation extends the previous call's by exactly the policy's last reply and one
observation, never rewriting earlier messages: an engine can keep the KV cache of the prefix and
prefill only the new observation (the multi-turn rollout of issue 11 plugs in here, as a stateful
`generate`).

Budgets: turns, tokens per turn and per episode (counted by `count_tokens`, default UTF-8 bytes, the
byte-level tokenizer's count), and seconds per `generate` call. When a budget runs out the driver sends
the environment `<done>`, so the episode is still graded. What the policy does wrong (a malformed tool
call, bytes that are not UTF-8, a call that raises or runs too long) is recorded, never raised; an
environment failure (info["env_failure"]: a sandbox that cannot start, a checker that crashes) ends
the episode, is reported to `on_env_failure(task, reason)` (the quarantine's hook, rl/envs/quality.py),
and is kept apart from a wrong answer. However the episode ends, an environment with a `close()`
(a TerminalEnv holds a sandbox session) is closed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from meshrl.rl.envs.base import DONE, Environment, as_text

Generate = Callable[[Sequence[dict]], "str | bytes"]


@dataclasses.dataclass(frozen=True)
class Budget:
  """Limits of one episode."""
  max_turns: int = 8  # policy turns (the environment's own max_turns may be lower)
  max_turn_tokens: int = 512  # tokens of one policy turn; longer turns are cut there
  max_episode_tokens: int = 4096  # tokens of all policy turns together
  call_timeout_s: float = 60.0  # seconds one generate() call may take

  def __post_init__(self):
    for name in ("max_turns", "max_turn_tokens", "max_episode_tokens"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Budget.{name}={value!r} must be an integer >= 1.")
    if not self.call_timeout_s > 0:
      raise ValueError(f"Budget.call_timeout_s={self.call_timeout_s!r} must be positive.")


@dataclasses.dataclass
class Episode:
  """What happened. `end` is one of: done (the policy finished), max_turns, token_budget,
  call_timeout, policy_error (generate raised), env_failure."""
  messages: list[dict]
  reward: float = 0.0
  end: str = ""
  turns: int = 0
  tokens: int = 0
  malformed_calls: int = 0  # turns whose tool call did not parse
  invalid_utf8_turns: int = 0
  env_failure: str | None = None
  info: dict = dataclasses.field(default_factory=dict)  # the environment's last info

  @property
  def solved(self) -> bool:
    return self.env_failure is None and self.reward > 0


def _cut(text: str, limit: int, count_tokens: Callable[[str], int]) -> str:
  """The longest prefix of `text` with at most `limit` tokens (binary search over characters)."""
  low, high = 0, len(text)
  while low < high:
    middle = (low + high + 1) // 2
    if count_tokens(text[:middle]) <= limit:
      low = middle
    else:
      high = middle - 1
  return text[:low]


def _byte_count(text: str) -> int:
  return len(text.encode("utf-8"))


def run_episode(env: Environment, task, generate: Generate, budget: Budget = Budget(), *,
                count_tokens: Callable[[str], int] = _byte_count,
                on_env_failure: Callable[[object, str], None] | None = None,
                clock: Callable[[], float] = time.monotonic) -> Episode:
  """Runs one episode of `task` in `env` with the policy `generate` under `budget` (never raises for
  what the policy or the environment does; ValueError only for a task the environment refuses).
  An environment that holds resources (a sandbox session) is closed at the end (`env.close()`)."""
  try:
    return _episode(env, task, generate, budget, count_tokens, on_env_failure, clock)
  finally:
    close = getattr(env, "close", None)
    if close is not None:
      close()


def _episode(env, task, generate, budget, count_tokens, on_env_failure, clock) -> Episode:
  observation = env.reset(task)
  episode = Episode(messages=[{"role": "user", "content": observation}])

  def finish(result, end: str) -> Episode:
    episode.reward, episode.end = float(result.reward), end
    episode.info.update(result.info)
    if result.info.get("env_failure"):
      episode.env_failure, episode.end = str(result.info["env_failure"]), "env_failure"
      if on_env_failure is not None:
        on_env_failure(task, episode.env_failure)
    return episode

  while True:
    started = clock()
    try:
      raw = generate(list(episode.messages))
    except Exception as error:  # pylint: disable=broad-except  (the policy's failure, recorded)
      episode.info["policy_error"] = f"{type(error).__name__}: {error}"
      return finish(env.step(DONE), "policy_error")
    if clock() - started > budget.call_timeout_s:
      return finish(env.step(DONE), "call_timeout")
    text, valid = as_text(raw)
    episode.invalid_utf8_turns += not valid
    room = min(budget.max_turn_tokens, budget.max_episode_tokens - episode.tokens)
    if count_tokens(text) > room:
      text = _cut(text, room, count_tokens)
    episode.tokens += count_tokens(text)
    episode.turns += 1
    episode.messages.append({"role": "assistant", "content": text})
    result = env.step(text)
    episode.malformed_calls += "error" in result.info
    if result.done:
      return finish(result, "done")
    if result.info.get("env_failure"):
      return finish(result, "env_failure")
    episode.messages.append({"role": "tool", "content": result.observation})
    if episode.turns >= budget.max_turns:
      return finish(env.step(DONE), "max_turns")
    if episode.tokens >= budget.max_episode_tokens:
      return finish(env.step(DONE), "token_budget")
