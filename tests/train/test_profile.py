"""train/profile.py: the traced steps' window, the time per compiled program, and bad settings.

The loops' own use (SFT, reward model, RL) is checked in their run tests: tests/train/test_sft.py,
tests/train/test_reward_model.py, tests/rl/test_loop.py."""

import json

import jax
import jax.numpy as jnp
import pytest

from meshrl.configs import load
from meshrl.configs.checks import check_log
from meshrl.train import workdir
from meshrl.train.profile import StepProfiler


@jax.jit
def heavy(x):
  for _ in range(4):
    x = jnp.tanh(x @ x)
  return x


@jax.jit
def light(x):
  return x + 1.0


@jax.jit
def outside(x):
  return x * 2.0


@jax.jit
def slow(x):
  return jax.lax.fori_loop(0, 60, lambda _, y: jnp.tanh(y @ y), x)


def test_work_dispatched_before_the_window_is_not_traced(tmp_path):
  """A program dispatched before the first traced step and not waited for (a loop that waited on one
  device's scalar leaves the previous step running on the others) finishes before the trace starts:
  it is not counted in the traced steps."""
  x = jnp.ones((512, 512)) / 512
  jax.block_until_ready(slow(x))  # compiled
  profiler = StepProfiler(str(tmp_path / "profile"), start=1, steps=1, name="test")
  pending = slow(x)  # still running when the window opens
  with profiler.step(1):
    jax.block_until_ready(light(x))
  jax.block_until_ready(pending)
  by_name = {p["program"]: p for p in profiler.summary["programs"]}
  assert by_name["jit_light"]["calls"] == 1
  assert "jit_slow" not in by_name

def test_the_window_is_traced_and_each_program_timed(tmp_path):
  """Steps 2 and 3 of 1..4 are traced: the programs they ran are in the summary with their calls,
  the longer one first; what steps 1 and 4 ran is not."""
  x = jnp.ones((384, 384)) / 384
  profiler = StepProfiler(str(tmp_path / "profile"), start=2, steps=2, name="test")
  for step in range(1, 5):
    with profiler.step(step):
      if step in (2, 3):
        jax.block_until_ready(heavy(x))
      if step == 2:
        jax.block_until_ready(light(x))
      if step in (1, 4):
        jax.block_until_ready(outside(x))
    assert profiler.active == (step == 2)
  profiler.close()
  summary = profiler.summary
  assert summary["steps"] == [2, 3]
  assert json.loads((tmp_path / "profile" / "summary.json").read_text()) == summary
  by_name = {p["program"]: p for p in summary["programs"]}
  assert "jit_outside" not in by_name
  assert by_name["jit_heavy"]["calls"] == 2 and by_name["jit_light"]["calls"] == 1
  assert summary["programs"][0]["program"] == "jit_heavy"
  assert by_name["jit_heavy"]["ms"] > 5 * by_name["jit_light"]["ms"] > 0
  assert sum(p["share"] for p in summary["programs"]) == pytest.approx(1.0)
  assert by_name["jit_heavy"]["top_ops"] and all(ms > 0 for _, ms, _ in by_name["jit_heavy"]["top_ops"])
  # A run's output: a folder holding it holds a run, and --overwrite clears it (train/workdir.py).
  assert workdir.run_outputs(str(tmp_path)) == ["profile"]
  workdir.clear_outputs(str(tmp_path), ["profile"])
  assert not (tmp_path / "profile").exists()


def test_a_step_that_raises_ends_the_trace_and_a_loop_cut_short_is_summarized(tmp_path):
  """An error inside a traced step stops the trace (the next one can start) and is what the caller
  sees; a loop that stops inside the window is summarized by close(); a run resumed inside the
  window traces from the step it resumed at."""
  profiler = StepProfiler(str(tmp_path / "a"), start=1, steps=3)
  with pytest.raises(RuntimeError, match="boom"):
    with profiler.step(1):
      raise RuntimeError("boom")
  assert not profiler.active and profiler.summary is None
  cut, x = StepProfiler(str(tmp_path / "b"), start=1, steps=3), jnp.ones((384, 384))
  with cut.step(1):
    jax.block_until_ready(light(x))
  cut.close()  # the loop ended after step 1 (a preemption)
  assert cut.summary["steps"] == [1, None]
  assert [p["program"] for p in cut.summary["programs"]] == ["jit_light"]
  resumed = StepProfiler(str(tmp_path / "c"), start=1, steps=3)  # a run resumed at step 2
  for step in (2, 3):
    with resumed.step(step):
      jax.block_until_ready(light(x))
  assert resumed.summary["steps"] == [2, 3]
  assert {p["program"]: p["calls"] for p in resumed.summary["programs"]} == {"jit_light": 2}


def test_bad_profile_settings_are_refused_in_one_line(tmp_path):
  for overrides, message in ((["log.profile_start=-1"], "log.profile_start=-1 must be at least 0"),
                             (["log.profile_start=2", "log.profile_steps=0"],
                              "log.profile_steps=0 must be at least 1")):
    with pytest.raises(ValueError, match=message):
      check_log(load("configs/tiny.py", overrides))
  with pytest.raises(ValueError, match="log.profile_steps=0 >= 1"):
    StepProfiler(str(tmp_path), start=3, steps=0)
  off = StepProfiler(str(tmp_path / "off"), start=0, steps=3)
  with off.step(1):
    pass
  off.close()
  assert off.summary is None and not (tmp_path / "off").exists()


def test_a_trace_that_cannot_be_summarized_leaves_the_loop_running(tmp_path, monkeypatch, capsys):
  """The summary is read from the trace jax wrote; when that fails the run goes on, says so in one
  line, and keeps the trace folder."""
  from meshrl.train import profile  # pylint: disable=import-outside-toplevel

  def unreadable(folder):
    raise OSError(f"no .xplane.pb trace under {folder}/plugins/profile")
  monkeypatch.setattr(profile, "program_times", unreadable)
  profiler = StepProfiler(str(tmp_path / "p"), start=1, steps=1, name="rl")
  with profiler.step(1):
    jax.block_until_ready(light(jnp.ones((384, 384))))
  assert profiler.summary is None and not profiler.active
  assert "profile of rl: the trace in" in capsys.readouterr().out
  assert (tmp_path / "p" / "plugins").is_dir() and not (tmp_path / "p" / "summary.json").exists()
