"""RewardPool: concurrent scoring, per-sample timeouts, errors counted, results by sample index."""

import threading
import time

import numpy as np
import pytest

from meshrl.rl.rewards import compose
from meshrl.rl.rewards.pool import RewardPool


def test_scores_equal_serial_scoring_in_sample_order():
  reward = compose("answer:1.0,format:0.5")
  examples = [{"prompt": f"{i}+1=", "answer": str(i + 1), "domain": "a" if i % 2 else "b"} for i in range(40)]
  completions = [str(i + 1) if i % 3 else "wrong" for i in range(40)]
  pool = RewardPool(reward, num_workers=4)
  got, info = pool.score(completions, examples)
  want = np.asarray([reward(c, e) for c, e in zip(completions, examples)], np.float32)
  np.testing.assert_allclose(got, want)
  assert info["reward_errors"] == 0 and info["reward_timeouts"] == 0
  np.testing.assert_allclose(info["by_domain"]["a"], want[1::2].mean(), rtol=1e-6)
  pool.close()


def test_a_hung_reward_scores_zero_is_counted_and_delays_only_itself():
  release = threading.Event()

  def reward(completion, example):
    if completion == "hang":
      release.wait(30)  # hangs far past the timeout
    if completion == "boom":
      raise RuntimeError("reward code crashed")
    if completion == "nan":
      return float("nan")
    return 1.0
  pool = RewardPool(reward, num_workers=2, timeout_s=0.5)
  completions = ["ok", "hang", "ok", "boom", "nan", "hang", "ok", "ok"]
  start = time.monotonic()
  scores, info = pool.score(completions, [{}] * len(completions))
  elapsed = time.monotonic() - start
  np.testing.assert_array_equal(scores, [1, 0, 1, 0, 0, 0, 1, 1])
  assert info["reward_timeouts"] == 2 and info["reward_errors"] == 2
  assert elapsed < 6.0, elapsed  # two hung samples, each written off after 0.5 s (not 30 s)
  # The pool still has its workers: the next batch scores normally.
  scores, info = pool.score(["ok"] * 6, [{}] * 6)
  np.testing.assert_array_equal(scores, np.ones(6))
  assert info["reward_timeouts"] == 0
  release.set()
  pool.close()


def test_bad_pool_settings_name_the_field():
  with pytest.raises(ValueError, match="rl.reward_workers=0"):
    RewardPool(lambda c, e: 1.0, num_workers=0)
  with pytest.raises(ValueError, match="rl.reward_timeout_s=0"):
    RewardPool(lambda c, e: 1.0, timeout_s=0)
