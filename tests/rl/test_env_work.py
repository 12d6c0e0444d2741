"""The environment work of training (rl/envs/env_work.py) and its use by multi-turn episodes
(rl/step/episodes.py): infrastructure failures are retried with backoff, a wrong answer never is, a
task that keeps failing is quarantined while the run goes on, the quarantine is kept in the checkpoint
and restored on resume, and the config's curriculum draws flagged tasks less, never below the floor."""

import json

import jax
import numpy as np
import pytest

from meshrl import configs
from meshrl.configs.checks import check_env_work
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.envs.base import StepResult
from meshrl.rl.envs.env_work import EnvWork
from meshrl.rl.step import driver as loop
from meshrl.rl.envs.quality import Quarantine
from meshrl.rl.sandbox import SessionStartError
from meshrl.rl.step.spec import episode_runner
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.optim import make_optimizer
from meshrl.train.state import create_train_state

TOK = ByteTokenizer()
SMALL = ["model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=16", "model.mlp_dim=64", "moe.num_experts=0", "rl.max_prompt_len=16",
         "rl.max_new_tokens=24", "model.max_seq_len=48", "rl.max_obs_tokens=8", "model.init_std=0.3",
         "rl.multi_turn=true", "rl.max_turn_tokens=6", "rl.max_turns=2", "rl.group_size=2",
         "rl.prompts_per_step=4", "rl.env_workers=2"]


def test_infrastructure_failures_are_retried_wrong_answers_never():
  calls = {}

  def job(payload):
    calls[payload] = calls.get(payload, 0) + 1
    if payload == "flaky" and calls[payload] <= 2:
      raise SessionStartError("bwrap did not start")
    if payload == "broken":
      raise SessionStartError("no sandbox")
    return 0.0  # a wrong answer: a value, whatever the policy wrote

  work = EnvWork(quarantine=Quarantine(threshold=1), max_retries=2, backoff_s=0.01)
  results = work.run([("code", "flaky"), ("code", "broken"), ("math", "wrong")], job)
  assert calls == {"flaky": 3, "broken": 3, "wrong": 1}
  assert [r.failure is None for r in results] == [True, False, True]
  assert results[1].attempts == 3 and "no sandbox" in results[1].failure and results[2].attempts == 1
  assert work.metrics()["env_retries"] == 4 and work.metrics()["env_given_up"] == 1
  assert work.quarantine.ids == frozenset()  # payloads without a task_id name no task


class _Env:
  """An episode's environment; `kind` (the example's task_id) picks how it misbehaves."""

  resets: dict = {}

  def __init__(self, example):
    self.kind = example["task_id"]

  def reset(self, example):
    _Env.resets[self.kind] = _Env.resets.get(self.kind, 0) + 1
    if self.kind == "broken" or (self.kind == "flaky" and _Env.resets[self.kind] <= 2):
      raise SessionStartError(f"{self.kind}: the session did not start")
    return example["prompt"]

  def step(self, action):
    if self.kind == "crash":
      raise RuntimeError("check.sh crashed")
    return StepResult("", 0.0, True, {})  # wrong, whatever the policy did


def test_episodes_retry_quarantine_and_the_checkpoint_remembers(tmp_path):
  """Episodes whose sandbox fails to start at first are retried and run; one whose start always fails and
  one whose checker crashes mid-episode are quarantined (2 episodes each, threshold 2); a wrong
  answer is reset once per episode and kept; a resumed run's quarantine has them back."""
  cfg = configs.load("configs/tiny.py", SMALL)
  model = build_model(ModelConfig.from_config(cfg, None), None)
  _, state = create_train_state(model, make_optimizer(cfg.optim), None)
  runner = episode_runner(cfg, None, TOK, make_env=_Env)
  runner.env_work = EnvWork(quarantine=Quarantine(threshold=2), max_retries=2, backoff_s=0.01)
  examples = [{"task_id": kind, "prompt": f"{kind}:", "domain": "terminal"}
              for kind in ("flaky", "broken", "wrong", "crash")]
  _Env.resets = {}
  out = runner.rollout(state.params, state.extra, examples, jax.random.key(0))
  runner.close()
  ends = [e.end for e in out.episodes]
  assert _Env.resets == {"flaky": 4, "broken": 6, "wrong": 2, "crash": 2}
  assert ends[:2] == ["done", "done"] and ends[4:6] == ["done", "done"]  # flaky ran, wrong graded 0
  assert all(e.env_failure for e in out.episodes[2:4]) and all(e.env_failure for e in out.episodes[6:])
  quarantine = runner.env_work.quarantine
  assert quarantine.ids == {"broken", "crash"}
  assert "check.sh crashed" in quarantine.reasons["crash"]
  with Checkpointer(str(tmp_path / "ckpt"), every=1, async_save=False) as ckpt:
    ckpt.save(1, state, data_state={"step": 1}, config=cfg, extra_state={"env": runner.env_work.state()})
  with Checkpointer(str(tmp_path / "ckpt"), every=1, async_save=False) as ckpt:
    restored = ckpt.restore(state)
  resumed = EnvWork(quarantine=Quarantine(str(tmp_path / "q.jsonl"), threshold=2))
  resumed.restore(restored.extra_state["env"])
  assert resumed.quarantine.ids == {"broken", "crash"}
  assert {json.loads(line)["id"] for line in open(tmp_path / "q.jsonl")} == {"broken", "crash"}
  with pytest.raises(ValueError, match="environment state"):
    resumed.restore({"reasons": {}})


def _domains(tmp_path):
  rows = [{"id": f"r{i}", "prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]
  (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "domains.jsonl").write_text(json.dumps({"name": "rows", "source": "jsonl:rows.jsonl",
                                                      "reward": "numeric", "weight": 1}) + "\n")
  return str(tmp_path / "domains.jsonl")


def test_the_configs_curriculum_draws_flagged_tasks_less_with_a_floor_and_quarantine_is_shared(tmp_path):
  path = _domains(tmp_path)
  report = tmp_path / "qa.json"
  report.write_text(json.dumps({"curriculum": {"r0": "always_solved", "r1": "never_solved"}}))
  shares = {}
  for weight in (1.0, 0.1):
    overrides = [f"data.curriculum={report}", f"data.flagged_weight={weight}",
                 f"data.quarantine={tmp_path / f'q{weight}.jsonl'}", "data.eval_fraction=0.0"]
    cfg = configs.load("configs/tiny.py", overrides)
    check_env_work(cfg)
    mixture = loop.train_source(configs.load("configs/tiny.py", [f"data.domains={path}", *overrides]))
    drawn = [e["task_id"] for e in mixture.take(4000)]
    shares[weight] = {t: drawn.count(t) / len(drawn) for t in ("r0", "r1", "r2", "r3")}
    if weight < 1:  # a task quarantined through EnvWork leaves this mixture's draws
      work = loop.env_work_for(cfg, mixture)
      assert work.quarantine is mixture.quarantine
      work.record({"task_id": "r3"}, "sandbox lost")
      work.record({"task_id": "r3"}, "sandbox lost")
      assert "r3" not in {e["task_id"] for e in mixture.take(400)}
  assert all(abs(s - 0.25) < 0.03 for s in shares[1.0].values())
  flagged = (shares[0.1]["r0"] + shares[0.1]["r1"]) / 2
  assert abs(flagged - 0.1 / 2.2) < 0.015 and flagged > 0.02  # drawn less, not below the floor


@pytest.mark.parametrize("override, message", [
    ("rl.env_retries=-1", "rl.env_retries=-1 must be at least 0"),
    ("rl.env_backoff_s=-0.5", "rl.env_backoff_s=-0.5 must be at least 0"),
    ("data.quarantine_after=0", "data.quarantine_after=0 must be at least 1"),
    ("data.flagged_weight=0.0", "data.flagged_weight=0.0 must lie in"),
    ("data.flagged_weight=1.5", "data.flagged_weight=1.5 must lie in"),
    ("data.curriculum=/nonexistent/qa.json", "data.curriculum='/nonexistent/qa.json': no such file"),
])
def test_bad_env_work_config_is_named(override, message):
  cfg = configs.load("configs/tiny.py", [override])
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
    check_env_work(cfg)


def test_the_run_checkpoint_carries_the_quarantine():
  """driver.carried_state saves the run's EnvWork state and restore_carried_state puts it back, so a
  resumed run keeps quarantining the tasks the interrupted one did (a driver that dropped it fails)."""
  import types  # pylint: disable=import-outside-toplevel
  work = EnvWork(quarantine=Quarantine(threshold=1))
  work.record({"task_id": "t7"}, "sandbox lost")
  run = types.SimpleNamespace(in_flight=[], partial=None, env_work=work, bootstrap=None, replay=None)
  state = json.loads(json.dumps(loop.carried_state(run)))  # JSON, as the checkpoint keeps it
  resumed = types.SimpleNamespace(in_flight=[], partial=None, env_work=EnvWork(quarantine=Quarantine(threshold=1)),
                                  bootstrap=None, replay=None)
  loop.restore_carried_state(resumed, state)
  assert "t7" in resumed.env_work.quarantine.ids


def test_single_turn_rewards_retry_infrastructure_failures_and_leave_given_up_samples_out():
  """A verifier whose sandbox fails (EnvFailure, SessionStartError) is retried with backoff; a wrong
  answer and a reward's own bug are not; a sample still failing after the retries scores 0, is marked
  given up (so the step gives it no gradient) and is recorded against its task in the quarantine.
  Bugs caught: retrying wrong answers, scoring an infrastructure failure as a wrong answer (valid, 0),
  a dropped on_given_up."""
  from meshrl.rl.rewards.pool import RewardPool  # pylint: disable=import-outside-toplevel
  from meshrl.rl.sandbox.result import EnvFailure  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.groups import score_rollout  # pylint: disable=import-outside-toplevel
  calls = {}

  def verifier(completion, example):
    kind = example["task_id"]
    calls[kind] = calls.get(kind, 0) + 1
    if kind == "flaky" and calls[kind] < 3:
      raise EnvFailure("sandbox_error: the supervisor did not answer")
    if kind == "broken":
      raise SessionStartError("a sandbox session did not start")
    if kind == "buggy":
      raise KeyError("answer")
    return float(completion == "ok")

  quarantine = Quarantine(threshold=1)
  pool = RewardPool({"code": verifier}, num_workers=2, timeout_s=10, max_retries=2, backoff_s=0.01,
                    on_given_up=quarantine.record_failure)
  examples = [{"task_id": kind, "prompt": f"{kind}:", "domain": "code"} for kind in ("flaky", "broken", "wrong", "buggy")]
  rewards, info = pool.score(["ok", "ok", "no", "ok"], examples)
  pool.close()
  assert calls == {"flaky": 3, "broken": 3, "wrong": 1, "buggy": 1}
  assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
  assert info["given_up"].tolist() == [False, True, False, False]
  assert info["reward_env_retries"] == 4 and info["reward_env_given_up"] == 1 and info["reward_errors"] == 1
  assert quarantine.ids == {"broken"}

  class Scored:  # the pool's answer as score_rollout reads it: the given-up sample is not valid
    def submit(self, texts, per_sample):
      return texts

    def collect(self, texts):
      return np.zeros(len(texts), np.float32), {**info, "given_up": np.asarray([False, True]), "reward_errors": 0}

  arrays = {"tokens": np.full((2, 4), 65, np.int32), "response_mask": np.ones((2, 4), bool),
            "lengths": np.full(2, 4, np.int32)}
  scored = score_rollout(arrays, [examples[0], examples[1]], TOK, Scored(), group_size=1, max_new_tokens=4,
                         overlong_buffer=0, overlong_penalty_value=0.0)
  assert scored.sample_valid.tolist() == [True, False]


def test_a_failed_code_sandbox_is_an_infrastructure_failure_not_a_wrong_answer():
  """CodeReward raises EnvFailure for a run whose sandbox failed (RewardPool then retries it) and
  scores a failing program 0 as before; the batch API returns the failure in place."""
  from meshrl.rl.rewards.code import CodeReward  # pylint: disable=import-outside-toplevel
  from meshrl.rl.sandbox import result as res  # pylint: disable=import-outside-toplevel

  class Done:
    def __init__(self, value):
      self.value = value

    def result(self):
      return self.value

  class BrokenPool:
    def submit(self, *args, **kwargs):
      return Done(res.failed(f"{res.SANDBOX_ERROR}: no report from the supervisor"))

  reward = CodeReward(pool=BrokenPool())
  example = {"tests": ["assert f() == 1"]}
  with pytest.raises(res.EnvFailure, match="sandbox_error"):
    reward("def f(): return 1", example)
  assert isinstance(reward.score_many(["x"], [example])[0], res.EnvFailure)
  assert reward.rewards(["x"], [example]).tolist() == [0.0]


def test_single_turn_runs_give_their_verifiers_the_runs_quarantine_and_checkpoint_it():
  """build_run hands the run's EnvWork to the reward pool (its record) and keeps it on the run, whose
  carried state (the checkpoint) holds the quarantine for single-turn runs too."""
  from meshrl.rl.step.program import build_run  # pylint: disable=import-outside-toplevel
  from meshrl.train.init_from import initial_model  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", ["rl.prompts_per_step=2", "rl.group_size=2", "rl.num_minibatches=1"])
  spec = loop.check_config(cfg)
  work = EnvWork(quarantine=Quarantine(threshold=1))
  run = build_run(cfg, None, initial_model(cfg, None), spec.tokenizer, env_work=work, spec=spec)
  try:
    assert run.env_work is work
    run.pool.on_given_up({"task_id": "t1", "prompt": "p"}, "sandbox_error: gone")
    assert work.quarantine.ids == {"t1"}
    assert loop.carried_state(run)["env"] == work.state()
  finally:
    run.close()
