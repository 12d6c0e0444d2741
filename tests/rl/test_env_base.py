"""rl/envs/base.py and rl/envs/episode.py: the tool-call format, single-turn tasks as one-step
episodes, and the episode driver's budgets and failure handling (no sandbox needed)."""

import pytest

from meshrl.rl.envs.base import DONE, SingleTurnEnv, StepResult, as_text, parse_action
from meshrl.rl.envs.episode import Budget, run_episode
from meshrl.rl.rewards import answer_reward


@pytest.mark.parametrize("text, kind, detail", [
    ("ls <cmd> cat a.txt </cmd> trailing", "cmd", "cat a.txt"),
    ("all good <done>", "done", ""),
    ("just talking", "error", "no tool call"),
    ("<cmd>ls", "error", "found 1 <cmd> and 0 </cmd>"),
    ("<cmd>ls</cmd><cmd>pwd</cmd>", "error", "one command per turn"),
    ("</cmd>ls<cmd>", "error", "comes before"),
    ("<cmd>   </cmd>", "error", "empty"),
    ("<cmd>a\0b</cmd>", "error", "NUL"),
])
def test_parse_action(text, kind, detail):
  action = parse_action(text)
  assert action.kind == kind
  assert detail in (action.command if kind == "cmd" else action.error)


def test_non_utf8_is_replaced_not_raised():
  assert as_text(b"ok") == ("ok", True)
  text, valid = as_text(b"<cmd>ls \xff</cmd>")
  assert not valid and "\ufffd" in text and parse_action(text).kind == "cmd"


def test_single_turn_env_is_the_one_step_case():
  env = SingleTurnEnv(answer_reward)
  task = {"prompt": "2+3=", "answer": "5", "verifier": "numeric"}
  assert env.reset(task) == "2+3="
  assert env.step("5") == StepResult("", 1.0, True, {})
  env.reset(task)
  assert env.step("6").reward == 0.0
  broken = SingleTurnEnv(lambda c, e: 1 / 0)
  broken.reset(task)
  result = broken.step("5")
  assert result.done and result.reward == 0.0 and "ZeroDivisionError" in result.info["env_failure"]


class CountingEnv:
  """Done after `<done>` or `limit` commands; reward = number of well-formed commands seen."""

  def __init__(self, limit=100, fail_on=None):
    self.limit, self.fail_on, self.actions = limit, fail_on, []

  def reset(self, task):
    self.actions, self.good = [], 0
    return f"task {task}"

  def step(self, text):
    self.actions.append(text)
    action = parse_action(text)
    if action.kind == "done" or len(self.actions) > self.limit:
      return StepResult("", float(self.good), True, {})
    if action.kind == "error":
      return StepResult(f"error: {action.error}", 0.0, False, {"error": action.error})
    if action.command == self.fail_on:
      return StepResult("", 0.0, True, {"env_failure": "checker crashed"})
    self.good += 1
    return StepResult(f"ran {action.command}", 0.0, False, {})


def test_episode_conversation_grows_append_only():
  seen = []

  def policy(conversation):
    seen.append([dict(m) for m in conversation])
    return ["<cmd>a</cmd>", "oops", "<cmd>b</cmd>", DONE][len(seen) - 1]

  episode = run_episode(CountingEnv(), 1, policy)
  assert episode.end == "done" and episode.reward == 2.0 and episode.malformed_calls == 1
  assert [m["role"] for m in episode.messages] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
  for before, after in zip(seen, seen[1:]):  # each call extends the last by reply + observation
    assert after[:len(before)] == before and len(after) == len(before) + 2
  assert seen[2][-1]["content"].startswith("error: no tool call")


def test_budgets_end_the_episode_and_still_grade():
  always = lambda conversation: "<cmd>x</cmd>"
  episode = run_episode(CountingEnv(), 0, always, Budget(max_turns=3))
  assert (episode.end, episode.turns, episode.reward) == ("max_turns", 3, 3.0)
  episode = run_episode(CountingEnv(), 0, always, Budget(max_episode_tokens=30))
  assert episode.end == "token_budget" and episode.tokens <= 30 and episode.reward == 2.0
  long_turn = lambda conversation: "<cmd>" + "y" * 50 + "</cmd>"
  episode = run_episode(CountingEnv(), 0, long_turn, Budget(max_turns=1, max_turn_tokens=20))
  assert len(episode.messages[1]["content"].encode()) == 20 and episode.malformed_calls == 1
  clock = iter(range(0, 1000, 10))
  episode = run_episode(CountingEnv(), 0, always, Budget(call_timeout_s=5), clock=lambda: next(clock))
  assert episode.end == "call_timeout" and episode.turns == 0


def test_policy_and_env_failures_are_recorded_not_raised():
  def crashing(conversation):
    raise RuntimeError("engine died")
  episode = run_episode(CountingEnv(), 0, crashing)
  assert episode.end == "policy_error" and "engine died" in episode.info["policy_error"]
  reported = []
  episode = run_episode(CountingEnv(fail_on="bad"), "t7", lambda c: "<cmd>bad</cmd>",
                        on_env_failure=lambda task, reason: reported.append((task, reason)))
  assert episode.end == "env_failure" and not episode.solved
  assert reported == [("t7", "checker crashed")]
  episode = run_episode(CountingEnv(), 0, lambda c: b"<cmd>\xff</cmd>" if len(c) < 3 else DONE)
  assert episode.invalid_utf8_turns == 1 and episode.reward == 1.0


def test_budget_rejects_bad_values():
  with pytest.raises(ValueError, match="max_turns"):
    Budget(max_turns=0)
  with pytest.raises(ValueError, match="call_timeout_s"):
    Budget(call_timeout_s=0)


class _Holding:
  """An environment holding a resource: counts close() calls."""

  def __init__(self, fail_reset=False):
    self.closed, self.fail_reset = 0, fail_reset

  def reset(self, task):
    if self.fail_reset:
      raise ValueError("refused")
    return "go"

  def step(self, action_text):
    return StepResult("", 0.0, True, {}) if action_text == "<done>" else StepResult("out", 0.0, False, {})

  def close(self):
    self.closed += 1


@pytest.mark.parametrize("ending", ["done", "max_turns", "policy_error", "refused"])
def test_run_episode_closes_an_environment_that_holds_resources(ending):
  """A session-holding env (TerminalEnv) is closed however the episode ends, even when reset raises."""
  env = _Holding(fail_reset=ending == "refused")

  def generate(conversation):
    if ending == "policy_error":
      raise RuntimeError("boom")
    return "<done>" if ending == "done" else "<cmd>ls</cmd>"

  if ending == "refused":
    with pytest.raises(ValueError, match="refused"):
      run_episode(env, {}, generate, Budget(max_turns=2))
  else:
    assert run_episode(env, {}, generate, Budget(max_turns=2)).end == ending
  assert env.closed == 1
