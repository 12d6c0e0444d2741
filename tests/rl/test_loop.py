"""The RL driver: bad input is refused or counted, and a short warm start + GRPO run learns."""

import json
import os

import numpy as np
import pytest

from meshrl import configs
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl.step import driver as loop
from meshrl.rl.step.groups import next_prompts, score_rollout, select_groups
from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.rewards.pool import RewardPool
from meshrl.train.metrics import read_tensorboard

TOK = ByteTokenizer()


def test_group_size_one_rejected_for_grpo():
  cfg = configs.load("configs/tiny.py", ["rl.group_size=1"])
  with pytest.raises(ValueError, match="needs rl.group_size >= 2, got 1"):
    loop.check_config(cfg)


def test_batch_must_divide_data_parallel_axes():
  cfg = configs.load("configs/tiny.py", ["rl.prompts_per_step=3", "rl.group_size=2", "mesh.fsdp=4",
                                         "rl.num_minibatches=1",
                                         "mesh.tensor=2"])
  with pytest.raises(ValueError, match="6 sequences.*data\\*fsdp\\*expert = 4"):
    loop.check_config(cfg, 8)


def test_long_prompts_truncated_or_rejected_and_counted():
  examples = iter([{"prompt": "x" * 30, "answer": "1"}, {"prompt": "1+1=", "answer": "2"},
                   {"prompt": "2+2=", "answer": "4"}] * 3)
  batch = next_prompts(examples, TOK, count=2, max_len=8, overflow="reject")
  assert batch.rejected == 1 and [e["prompt"] for e in batch.examples] == ["1+1=", "2+2="]
  batch = next_prompts(iter([{"prompt": "y" * 30, "answer": "1"}] * 2), TOK, count=2, max_len=8,
                       overflow="truncate")
  assert batch.truncated == 2 and batch.tokens.shape == (2, 8) and batch.mask.all()
  with pytest.raises(ValueError, match="every prompt is longer than rl.max_prompt_len=8"):
    next_prompts(iter([{"prompt": "z" * 30, "answer": "1"}] * 1000), TOK, count=2, max_len=8,
                 overflow="reject")


def _arrays(texts, prompt_len=4, budget=4):
  rows = []
  for text in texts:
    ids = TOK.encode(text, add_bos=False, add_eos=True)[:budget]
    rows.append([TOK.pad_id] * prompt_len + ids + [TOK.pad_id] * (budget - len(ids)))
  tokens = np.asarray(rows, np.int32)
  mask = np.zeros_like(tokens, bool)
  mask[:, prompt_len:] = tokens[:, prompt_len:] != TOK.pad_id
  return {"tokens": tokens, "response_mask": mask, "lengths": mask.sum(1)}


def test_raising_reward_and_empty_completions_are_counted_not_fatal():
  def flaky(completion, example):
    if completion == "boom":
      raise RuntimeError("reward code crashed")
    return float(completion == example["answer"])
  arrays = _arrays(["2", "boom", "", "3"])
  scored = score_rollout(arrays, [{"answer": "2"}, {"answer": "3"}], TOK, RewardPool(flaky), group_size=2,
                         max_new_tokens=4, overlong_buffer=0, overlong_penalty_value=1.0)
  np.testing.assert_array_equal(scored.rewards, [1, 0, 0, 1])
  assert scored.info["reward_errors"] == 1


def test_overlong_shaping_lowers_the_reward_of_long_answers():
  """DAPO overlong shaping, budget 12 and buffer 4: rewards [1, 1] at lengths [4, 12] become [1, 0]."""
  arrays = _arrays(["1", "1"], budget=12)
  arrays["lengths"] = np.array([4, 12])
  scored = score_rollout(arrays, [{"answer": "1"}], TOK, RewardPool(lambda c, e: 1.0), group_size=2,
                         max_new_tokens=12, overlong_buffer=4, overlong_penalty_value=1.0)
  np.testing.assert_allclose(scored.rewards, [1.0, 0.0])
  np.testing.assert_allclose(scored.correct, [1.0, 1.0])


def test_dynamic_sampling_keeps_informative_groups_first():
  def scored(rewards, offset=0):
    rewards = np.asarray(rewards, np.float32)
    ids = offset + np.arange(len(rewards))
    return ScoredBatch(arrays={"tokens": ids[:, None]}, rewards=rewards, correct=rewards,
                       sample_valid=np.ones(len(ids), bool), domains=["d"] * len(ids),
                       texts=[str(i) for i in ids])
  first, second = scored([1, 1, 0, 1]), scored([0, 0, 1, 0], offset=10)
  batch = select_groups([first, second], num_groups=2, group_size=2, dynamic=True)
  np.testing.assert_array_equal(batch.rewards, [0, 1, 1, 0])
  np.testing.assert_array_equal(batch.arrays["tokens"][:, 0], [2, 3, 12, 13])
  assert batch.texts == ["2", "3", "12", "13"]
  np.testing.assert_array_equal(batch.sample_valid, [True] * 4)
  batch = select_groups([scored([1, 1, 0, 0])], num_groups=2, group_size=2, dynamic=True)
  np.testing.assert_array_equal(batch.sample_valid, [False] * 4)


def test_jsonl_row_without_prompt_is_skipped(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2", "domain": "arithmetic"}\n{"answer": "3"}\nnot json\n')
  cfg = configs.load("configs/tiny.py", [f"data.jsonl={path}", "data.tasks=", "rl.sft_steps=0",
                                         "data.eval_fraction=0"])
  source = loop.train_source(cfg)
  assert [source[i]["prompt"] for i in range(3)] == ["1+1="] * 3


@pytest.mark.optimized
def test_short_run_raises_reward_and_held_out_accuracy(tmp_path):
  """The demo's recipe cut short (warm start + 30 GRPO steps): the sampled reward and the held-out
  greedy accuracy both rise, nothing recompiles, and the outputs are written."""
  cfg = configs.load("configs/tiny.py", ["rl.num_steps=30", "log.progress_bar=false", "eval.every=30",
                                         "eval.num_prompts=64", "checkpoint.every=30", "log.profile_start=30",
                                         "log.profile_steps=1"])
  records = loop.run(cfg, str(tmp_path))
  rewards = np.asarray([r["reward_mean"] for r in records])
  first, last = rewards[:10].mean(), rewards[-10:].mean()
  assert last >= first + 0.08, (first, last)
  evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
  assert [e["step"] for e in evals] == [0, 30]
  assert evals[1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.1, evals
  board = read_tensorboard(str(tmp_path / "tb"))  # the evaluation before RL too (the writer opens after it)
  assert {step: round(value, 5) for step, value in board["eval/accuracy"].items()} == {
      e["step"]: round(e["eval/accuracy"], 5) for e in evals}
  assert len({r["compiles"] for r in records[1:]}) == 1  # nothing compiles after the first step
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 30 and {"step", "reward_mean", "kl", "entropy", "clip_frac", "response_len_mean",
                               "tokens_per_s", "time_s", "reward_mean/reverse",
                               "response_len/reverse"} <= set(json.loads(lines[0]))
  assert os.path.exists(tmp_path / "reward_curve.png") and os.path.exists(tmp_path / "config.json")
  profile = json.loads((tmp_path / "profile" / "summary.json").read_text())  # log.profile_start: step 30
  calls = {p["program"]: p["calls"] for p in profile["programs"]}
  assert profile["steps"] == [30, 30] and calls["jit_update"] == 1, calls
  warm = json.loads((tmp_path / "sft" / "profile" / "summary.json").read_text())  # the warm start's step 30
  assert warm["steps"] == [30, 30] and {p["program"]: p["calls"] for p in warm["programs"]}["jit_sft_step"] == 1


# --- preemption and the order of record and checkpoint ----------------------------------------------


class _FakeRun:
  def __init__(self, cfg):
    self.cfg, self.state = cfg, {"step": 0}


def test_sigterm_checkpoints_the_current_step_and_stops(monkeypatch):
  """SIGTERM during step 2 of 6: step 2 finishes, its record is written first, then it is saved at
  once (stopping=True although checkpoint.every is large), and the loop returns after it."""
  import os  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel
  from meshrl.train.preemption import Preemption  # pylint: disable=import-outside-toplevel
  events = []

  def fake_step(run, prompts, key):
    step = len([e for e in events if e[0] == "step"]) + 1
    events.append(("step", step))
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag; the step completes
    return {"nonfinite_minibatches": 0.0, "reward_mean": float(step)}

  class Writer:
    def write(self, step, metrics):
      events.append(("write", step))
      return {"step": step, **metrics}

  monkeypatch.setattr(loop, "rl_step", fake_step)
  cfg = configs.load("configs/tiny.py", ["rl.num_steps=6"])
  save = lambda step, run, metrics: events.append(("save", step, metrics["stopping"]))  # noqa: E731
  with Preemption() as preemption:
    records = loop.train_steps(_FakeRun(cfg), iter(()), writer=Writer(), checkpoint=save,
                               preemption=preemption)
    assert preemption.signal_name == "SIGTERM"
  assert [r["step"] for r in records] == [1, 2]
  assert events == [("step", 1), ("write", 1), ("save", 1, False), ("step", 2), ("write", 2),
                    ("save", 2, True)]
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is removed after


def test_the_carried_state_is_built_only_for_the_steps_that_are_saved(tmp_path, monkeypatch):
  """The carried state waits for the rollouts in flight and copies them to the host: an asynchronous
  run that built it after every step (not only every checkpoint.every) ran each step's rollout to
  the end outside the step, and spent the host's time on JSON copies of it."""
  import time  # pylint: disable=import-outside-toplevel
  from meshrl.train.checkpoint import Checkpointer  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(loop, "rl_step", lambda run, prompts, key: {"nonfinite_minibatches": 0.0})
  built = []

  class Prompts:
    def get_state(self):
      return {"position": 0}

  cfg = configs.load("configs/tiny.py", ["rl.num_steps=7"])
  run = _FakeRun(cfg)
  run.state = {"w": np.zeros(2, np.float32)}
  with Checkpointer(str(tmp_path / "ckpt"), every=3, max_to_keep=None) as checkpointer:
    save = loop.checkpoint_hook(checkpointer, Prompts(),
                                extra_state=lambda: built.append(len(built)) or {"carried": len(built)})
    def save_slowly(step, run, metrics):
      time.sleep(0.2 if step == 1 else 0.0)
      save(step, run, metrics)

    records = loop.train_steps(run, Prompts(), checkpoint=save_slowly)
    checkpointer.wait()
    assert checkpointer.all_steps() == [1, 3, 6, 7]  # orbax's first save, every 3 steps, the last one
  assert len(built) == 4
  assert records[1]["step_wall_s"] >= 0.2 > records[2]["step_wall_s"]  # the wall counts the checkpoint before it


def test_host_cpu_s_counts_every_threads_cpu_time_in_the_step(monkeypatch):
  """host_cpu_s is the process's CPU time since the previous record, a worker thread's included (an
  asynchronous step's rollout runs in one): a step that waits while a thread spins 0.3 s counts it;
  a step that sleeps does not."""
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
      pass

  steps = []

  def fake_step(run, prompts, key):
    steps.append(key)
    if len(steps) == 1:  # the first step: a worker thread burns CPU while this one waits
      worker = threading.Thread(target=spin, args=(0.3,))
      worker.start()
      worker.join()
    else:
      time.sleep(0.3)
    return {"nonfinite_minibatches": 0.0}
  monkeypatch.setattr(loop, "rl_step", fake_step)
  cfg = configs.load("configs/tiny.py", ["rl.num_steps=2"])
  records = loop.train_steps(_FakeRun(cfg), None)
  assert records[0]["host_cpu_s"] >= 0.25 and records[0]["step_wall_s"] >= 0.25
  assert records[1]["host_cpu_s"] < 0.15 <= records[1]["step_wall_s"]


@pytest.mark.slow
def test_sigterm_to_the_script_saves_and_exits_zero(tmp_path):
  """scripts/rl.py in a subprocess gets SIGTERM mid-run: it exits 0 with a message, and its last
  checkpoint is the step of its last metrics record (checkpoint.every is far larger). 3 min here."""
  import signal  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  from meshrl.train.checkpoint import committed_steps  # pylint: disable=import-outside-toplevel
  workdir = tmp_path / "run"
  small = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
           "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
           "rl.prompts_per_step=4", "rl.group_size=4", "rl.sft_steps=0", "log.progress_bar=false",
           "log.tensorboard=false", "log.plot=false", "eval.every=0", "rl.num_steps=200",
           "checkpoint.every=1000"]
  proc = subprocess.Popen([sys.executable, "scripts/rl.py", "--config=configs/tiny.py",
                           f"--workdir={workdir}"] + [f"--config.{o}" for o in small],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 600
  while (not metrics.exists() or not metrics.read_text().count("\n")) and time.time() < deadline:
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  last = json.loads(metrics.read_text().splitlines()[-1])["step"]
  assert f"SIGTERM: stopped after RL step {last} of 200, saved in the checkpoint of step {last}" in out
  assert committed_steps(str(workdir / "checkpoints"))[-1] == last < 200
  record = json.loads(metrics.read_text().splitlines()[-1])  # per-phase throughput (loop.PhaseCost)
  assert record["gen_flops_per_s"] > 0 and record["update_flops_per_s"] > 0
  assert record["gen_tokens_per_s"] > 0 and record["update_tokens_per_s"] > 0


def test_phase_cost_divides_the_compiled_programs_flops_by_each_phase_time():
  """Generation FLOPs = fixed + per decode step x the longest response of each rollout (the loop
  stops early), update FLOPs from its program; each divided by its own phase time, MFU by the peak."""
  import collections  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  n = 16
  dot = 2 * n ** 3
  Out = collections.namedtuple("Out", "tokens lengths")

  @jax.jit
  def rollout(w, lengths):  # one dot outside the loop, one per iteration of an early-stopping loop
    h = jax.lax.while_loop(lambda s: s[1] < jnp.max(lengths), lambda s: (s[0] @ w, s[1] + 1), (w @ w, 0))[0]
    return Out(h, lengths)

  @jax.jit
  def update(w, key):  # a scan of 3 dots
    return jax.lax.scan(lambda c, _: (c @ w, None), w, None, length=3)[0], {}

  cfg = configs.load("configs/tiny.py", ["rl.epochs=2"])
  import types  # pylint: disable=import-outside-toplevel
  run = types.SimpleNamespace(cfg=cfg, mesh=None, rollout=rollout, update=update, run_spec=loop.build_spec(cfg))
  cost = loop.PhaseCost(run, peak=1e9)
  w = jnp.ones((n, n))
  run.rollout(w, jnp.array([2, 5]))  # longest response 5
  run.rollout(w, jnp.array([3, 1]))  # a second round (dynamic sampling): longest 3
  run.update(w, jax.random.key(0))
  out = cost({"rollout_s": 2.0, "update_s": 0.5, "generated_tokens": 11})
  assert cost.rollout_flops.fixed == dot and cost.rollout_flops.per_iteration == dot
  assert out["gen_flops_per_s"] == (dot + 5 * dot + dot + 3 * dot) / 2.0
  assert out["update_flops_per_s"] == 3 * dot / 0.5
  assert out["gen_tokens_per_s"] == 11 / 2.0
  rl = cfg.rl
  slots = rl.prompts_per_step * rl.group_size * (rl.max_prompt_len + rl.max_new_tokens) * 2
  assert out["update_tokens_per_s"] == slots / 0.5
  assert out["gen_mfu"] == out["gen_flops_per_s"] / 1e9
  assert out["update_mfu"] == out["update_flops_per_s"] / 1e9
  no_rollout = cost({"rollout_s": 1.0, "update_s": 1.0, "generated_tokens": 0})
  assert no_rollout["gen_flops_per_s"] == 0
  # rl.packed_row_buckets: a step's update takes `update_rows` of a ladder; the counted program's
  # FLOPs (its batch had 4 rows) scale to the step's rows, and so do the update's token slots.
  Batch = collections.namedtuple("Batch", "tokens")
  run = types.SimpleNamespace(cfg=cfg, mesh=None, rollout=rollout, update=jax.jit(lambda w, batch: (w @ w, {})),
                              run_spec=loop.build_spec(cfg))
  cost = loop.PhaseCost(run, peak=None)
  run.rollout(w, jnp.array([1]))
  run.update(w, Batch(jnp.zeros((4, 3))))
  full = cost({"rollout_s": 1.0, "update_s": 1.0, "generated_tokens": 1, "update_rows": 4})
  half = cost({"rollout_s": 1.0, "update_s": 1.0, "generated_tokens": 1, "update_rows": 2})
  assert full["update_flops_per_s"] == dot and half["update_flops_per_s"] == dot / 2
  assert half["update_tokens_per_s"] == full["update_tokens_per_s"] / 2


def test_a_preempted_warm_start_ends_the_run_before_rl(tmp_path, monkeypatch):
  """run() hands its SIGTERM flag to the warm start; a warm start that stopped early (saved) ends the
  job there: no RL step runs on a half-trained model."""
  import signal  # pylint: disable=import-outside-toplevel
  from meshrl.train import sft  # pylint: disable=import-outside-toplevel
  seen = {}

  def fake_run_sft(cfg, workdir, *, preemption, **kw):
    seen["preemption"] = preemption
    return sft.SFTResult(model=None, state=None, graphdef=None, history=[], preempted=True)

  monkeypatch.setattr(sft, "run_sft", fake_run_sft)
  monkeypatch.setattr(loop, "build_run", lambda *a, **k: pytest.fail("RL started after a preempted warm start"))
  cfg = configs.load("configs/tiny.py", ["rl.sft_steps=3", "eval.every=0", f"workdir={tmp_path}"])
  assert loop.run(cfg, str(tmp_path)) == []
  assert seen["preemption"] is not None  # the run's flag, installed for SIGTERM
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # and removed again
