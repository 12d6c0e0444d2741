"""The files_copy family in the real sandbox (rl/envs/file_sandbox.py, rl.env_backend = "sandbox"):
the oracle solves it and a wrong answer does not, the in-memory and sandbox backends agree on the
reward of scripted episodes, the session persists between turns, and the config field reaches the
environments a run builds (rollouts, held-out evaluation, warm start)."""

import pytest

from meshrl import configs
from meshrl.configs import checks
from meshrl.rl.envs.file_sandbox import FileSandboxEnv, file_env
from meshrl.rl.envs.file_tasks import FileTaskEnv, TaskPool, oracle_turns
from meshrl.rl.step import driver
from meshrl.rl.step.episode_collect import Demonstrations, held_out
from meshrl.rl.step.episodes import default_env, episode_pools

EXAMPLES = [TaskPool(difficulty=level, seed=3)[i] for level in (1, 2) for i in range(3)]


def _play(env, example: dict, turns: list[str]) -> tuple[float, int, bool]:
  """(reward, turns the env took, whether it ended) of a scripted episode; `<done>` is sent at the
  end as the episode runner does when its turn budget runs out."""
  env.reset(example)
  try:
    for count, turn in enumerate(turns, 1):
      result = env.step(turn)
      if result.done:
        return result.reward, count, True
    return env.step("<done>").reward, len(turns) + 1, False
  finally:
    close = getattr(env, "close", None)
    if close:
      close()


def _scripts(example: dict) -> dict[str, list[str]]:
  src, dst, word = next(iter(example["files"])), example["target"], example["answer"]
  return {
      "oracle": oracle_turns(example),
      "wrong_word": [f"<cmd>cat {src}</cmd>", f"<cmd>echo {word}x > {dst}</cmd>", "<done>"],
      "wrong_file": [f"<cmd>echo {word} > {src}.bak</cmd>", "<done>"],
      "twice": [f"<cmd>echo {word} > {dst}</cmd>", f"<cmd>echo {word} >> {dst}</cmd>", "<done>"],
      "blank_line": [f"<cmd>echo {word} > {dst}</cmd>", f"<cmd>echo >> {dst}</cmd>", "<done>"],
      "two_words": [f"<cmd>echo {word} {word} > {dst}</cmd>", "<done>"],
      "append_once": [f"<cmd>echo {word} >> {dst}</cmd>", "<done>"],
      "malformed": [f"<cmd>echo {word} > {dst}", "<done>"],  # no </cmd>: an error observation
      "malformed_then_right": ["cat it please", f"<cmd>echo {word} > {dst}</cmd>", "<done>"],
      "nothing": ["<done>"],
      # the turn limit (4): checked after the 4th command, right or wrong
      "limit_right": [f"<cmd>ls</cmd>", f"<cmd>cat {src}</cmd>", "<cmd>ls</cmd>", f"<cmd>echo {word} > {dst}</cmd>"],
      "limit_wrong": [f"<cmd>echo {word} > {dst}</cmd>", "<cmd>ls</cmd>", "<cmd>ls</cmd>", f"<cmd>echo no > {dst}</cmd>"],
      "overwrite_late": [f"<cmd>echo {word} > {dst}</cmd>", "<cmd>ls</cmd>", "<cmd>ls</cmd>", "<cmd>ls</cmd>",
                         f"<cmd>echo no > {dst}</cmd>"],  # past the limit: never run
  }


@pytest.mark.needs_sandbox
def test_the_oracle_is_solved_in_the_sandbox_and_a_wrong_answer_is_not():
  """Bugs: a check that passes whatever the file holds (or that the policy's exit status decides),
  setup files not written (cat fails, the oracle's word comes from nowhere)."""
  example = EXAMPLES[0]
  env = FileSandboxEnv()
  env.reset(example)
  first = env.step(oracle_turns(example)[0])
  assert first.observation.startswith(example["answer"] + "\n"), first.observation  # read by the real shell
  assert first.observation.endswith("[exit 0]")
  env.close()
  assert _play(FileSandboxEnv(), example, oracle_turns(example))[0] == 1.0
  assert _play(FileSandboxEnv(), example, _scripts(example)["wrong_word"])[0] == 0.0
  # the policy's last exit status is not the verdict
  assert _play(FileSandboxEnv(), example, [f"<cmd>echo no > {example['target']}; true</cmd>", "<done>"])[0] == 0.0


@pytest.mark.needs_sandbox
def test_memory_and_sandbox_backends_give_the_same_rewards():
  """Every scripted episode (right, wrong, malformed, turn limit) gets the same reward and ends at the
  same turn in both backends; the scripts solve some and fail others, so a backend stuck at one
  reward, a check stricter or looser than the in-memory verdict (trailing newline, appended copies,
  extra words), or a different turn limit fails here."""
  rewards = {}
  for i, example in enumerate(EXAMPLES):
    for name, turns in _scripts(example).items():
      memory = _play(FileTaskEnv(), example, turns)
      sandbox = _play(FileSandboxEnv(), example, turns)
      assert sandbox == memory, (name, example["prompt"], memory, sandbox)
      rewards[name, i] = memory[0]
  for name in ("oracle", "limit_right", "append_once", "malformed_then_right", "overwrite_late"):
    assert all(rewards[name, i] == 1.0 for i in range(len(EXAMPLES))), name
  for name in ("wrong_word", "wrong_file", "twice", "blank_line", "two_words", "malformed", "nothing", "limit_wrong"):
    assert all(rewards[name, i] == 0.0 for i in range(len(EXAMPLES))), name


@pytest.mark.needs_sandbox
def test_the_session_persists_between_turns():
  """A variable, the working directory and a background process made in turn 1 are there in turn 2:
  one session per episode, not a fresh sandbox per command (then $W is empty and the file is wrong)."""
  example = EXAMPLES[0]
  src, dst = next(iter(example["files"])), example["target"]
  env = FileSandboxEnv()
  env.reset(example)
  try:
    env.step(f"<cmd>read W < {src}; mkdir -p sub; cd sub; sleep 30 & echo started</cmd>")
    alive = env.step("<cmd>kill -0 $! && echo alive; pwd</cmd>").observation
    assert alive.startswith("alive\n/") and "/sub\n" in alive, alive
    env.step(f"<cmd>cd ..; echo $W > {dst}</cmd>")
    result = env.step("<done>")
  finally:
    env.close()
  assert result.reward == 1.0, result


def _agent_cfg(*overrides):
  return configs.load("configs/tiny_agent.py:sandbox", ["eval.num_prompts=4", *overrides])


@pytest.mark.needs_sandbox
def test_the_config_field_reaches_the_envs_a_run_builds():
  """rl.env_backend=sandbox: the run's training examples, its held-out examples and its warm-start
  demonstrations all run in FileSandboxEnv (the demonstrations show the real shell's observations);
  the default builds FileTaskEnv. Bug: the field read nowhere, or only by one of the three."""
  cfg = _agent_cfg()
  checks.check_sections(cfg, "rl", "data")
  train = driver.train_source(cfg)
  example = train[0]
  assert isinstance(default_env(example), FileSandboxEnv)
  evaluated = held_out(cfg)
  assert evaluated and all(isinstance(default_env(e), FileSandboxEnv) for e in evaluated)
  rows = [Demonstrations(train)[i] for i in range(1, 3)]  # cut after one and after two oracle turns
  assert all("[exit 0]" in row["prompt"] for row in rows), rows
  memory = configs.load("configs/tiny_agent.py", ["eval.num_prompts=4"])
  assert isinstance(default_env(driver.train_source(memory)[0]), FileTaskEnv)
  assert all(isinstance(default_env(e), FileTaskEnv) for e in held_out(memory))
  assert all("[exit" not in Demonstrations(driver.train_source(memory))[i]["prompt"] for i in range(1, 3))
  assert sorted(episode_pools(cfg)) == ["files_copy"]


def test_a_bad_backend_is_named():
  with pytest.raises(ValueError, match=r"^rl\.env_backend='docker' is not one of 'memory'.*'sandbox'"):
    checks.check_sections(configs.load("configs/tiny_agent.py", ["rl.env_backend=docker"]), "data")
  with pytest.raises(ValueError, match=r"backend='bwrap' is not one of"):
    file_env({**EXAMPLES[0], "backend": "bwrap"})


def test_a_sandbox_backend_without_bubblewrap_is_refused_before_the_run(monkeypatch):
  """rl.env_backend=sandbox where bubblewrap cannot run (a fresh machine): check_config refuses it in
  one line naming the field, rather than every episode failing its environment."""
  from meshrl.rl.sandbox import bwrap  # pylint: disable=import-outside-toplevel
  bwrap.check_bwrap.cache_clear()  # the probe's verdict is cached per process: probe again here
  monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
  with pytest.raises(ValueError) as raised:
    driver.check_config(configs.load("configs/tiny_agent.py:sandbox"), 8)
  message = str(raised.value)
  assert message.startswith("rl.env_backend='sandbox' cannot run here: bubblewrap") and "\n" not in message
  driver.check_config(configs.load("configs/tiny_agent.py"), 8)  # the in-memory backend needs none
  bwrap.check_bwrap.cache_clear()  # later tests probe the real bwrap again


def test_the_warm_start_shows_observations_cut_as_rollouts_cut_them(tmp_path, monkeypatch):
  """The run's warm start (driver -> run_sft) gets demonstrations whose observations are cut to
  rl.max_obs_tokens exactly as a rollout feeds them (episodes.observation_ids), head and closing tag:
  fails if the driver drops the tokenizer or the limit, or the demonstrations render whole outputs."""
  from meshrl.rl.step.episodes import OBS_CLOSE, observation_ids  # pylint: disable=import-outside-toplevel
  from meshrl.train import sft  # pylint: disable=import-outside-toplevel
  seen = {}

  def fake_run_sft(cfg, workdir, *, source, tokenizer, **kw):
    seen["source"], seen["tokenizer"] = source, tokenizer
    return sft.SFTResult(model=None, state=None, graphdef=None, history=[], preempted=True)
  monkeypatch.setattr(sft, "run_sft", fake_run_sft)
  cfg = configs.load("configs/tiny_agent.py", ["rl.max_obs_tokens=13", "eval.every=0", f"workdir={tmp_path}"])
  assert driver.run(cfg, str(tmp_path)) == []
  source, tok = seen["source"], seen["tokenizer"]
  row = next(source[i] for i in range(1, 9) if "</out>" in source[i]["prompt"])  # after one oracle turn
  shown = row["prompt"][row["prompt"].index("<out>"):row["prompt"].index(OBS_CLOSE) + len(OBS_CLOSE)]
  assert len(tok.encode(shown, add_bos=False)) <= 13 and shown.endswith(OBS_CLOSE)
  word = row["files"][next(iter(row["files"]))].strip()
  assert shown == tok.decode(observation_ids(tok, word + "\n", 13))  # "<out>ow</out>": the rollout's cut
  assert word not in shown  # the three-letter word does not fit in 13 tokens with the tags
