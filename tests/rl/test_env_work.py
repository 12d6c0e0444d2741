"""The environment work of training (rl/envs/env_work.py) and its use by multi-turn episodes
(rl/step/episodes.py): infrastructure failures are retried with backoff, a wrong answer never is, a
task that keeps failing is quarantined while the run goes on, the quarantine is kept in the checkpoint
and restored on resume, and the config's curriculum draws flagged tasks less, never below the floor."""

import json

import jax
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
  """driver.carried_state saves the episodes' EnvWork state and restore_carried_state puts it back, so a
  resumed run keeps quarantining the tasks the interrupted one did (a driver that dropped it fails)."""
  import types  # pylint: disable=import-outside-toplevel
  work = EnvWork(quarantine=Quarantine(threshold=1))
  work.record({"task_id": "t7"}, "sandbox lost")
  run = types.SimpleNamespace(in_flight=[], partial=None, multiturn=types.SimpleNamespace(env_work=work),
                              bootstrap=None, replay=None)
  state = json.loads(json.dumps(loop.carried_state(run)))  # JSON, as the checkpoint keeps it
  resumed = types.SimpleNamespace(in_flight=[], partial=None,
                                  multiturn=types.SimpleNamespace(env_work=EnvWork(quarantine=Quarantine(threshold=1))),
                                  bootstrap=None, replay=None)
  loop.restore_carried_state(resumed, state)
  assert "t7" in resumed.multiturn.env_work.quarantine.ids
