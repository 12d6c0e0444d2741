"""Asynchronous RL (rl.max_staleness): rollouts are dispatched before the host scores the previous
batch, staleness never exceeds the bound, and bad settings are refused by name. The whole loop with
max_staleness=1, resumed from a checkpoint, is in tests/rl/test_step.py (resume, "async")."""

import itertools
import types

import jax
import numpy as np
import pytest

from meshrl import configs
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl.step import driver as loop
from meshrl.rl.rewards.pool import RewardPool
from meshrl.rl.step.program import RLRun, collect

SMALL = ["rl.max_prompt_len=8", "rl.max_new_tokens=4", "model.max_seq_len=16", "rl.prompts_per_step=2",
         "rl.group_size=2", "rl.sft_steps=0", "rl.dynamic_sampling=false"]


def _cfg(*extra):
  return configs.load("configs/tiny.py", SMALL + list(extra))


class _Rollout:
  """Stands in for the jitted rollout: records each dispatch and returns host arrays whose
  generated tokens carry the version it was called with."""

  def __init__(self, cfg):
    self.cfg, self.calls = cfg.rl, []

  def __call__(self, params, extra, tokens, mask, key, max_lengths, version):
    del params, extra, mask, max_lengths
    rl = self.cfg
    rows, prompt_len, budget = tokens.shape[0] * rl.group_size, rl.max_prompt_len, rl.max_new_tokens
    self.calls.append((version, tuple(np.asarray(jax.random.key_data(key)).tolist())))
    response = np.zeros((rows, prompt_len + budget), bool)
    response[:, prompt_len:prompt_len + 2] = True
    return {"tokens": np.full((rows, prompt_len + budget), 97, np.int32),
            "positions": np.zeros((rows, prompt_len + budget), np.int32),
            "segment_ids": np.ones((rows, prompt_len + budget), np.int32),
            "prompt_mask": np.zeros((rows, prompt_len + budget), bool), "response_mask": response,
            "logprobs": np.zeros((rows, prompt_len + budget), np.float32),
            "lengths": np.full((rows,), 2, np.int32), "truncated": np.zeros((rows,), bool),
            "policy_version": np.where(response, version, -1).astype(np.int32)}


def test_staleness_is_bounded_and_next_rollouts_are_dispatched_before_scoring():
  """max_staleness=2: step k trains on a rollout of version max(0, k - 3) (staleness 0, 1, 2, 2, ...),
  and while the host waits for a batch's scores the next two rollouts are already dispatched (a driver
  that scored first, or dispatched late, fails here); each dispatch has its own key."""
  cfg = _cfg("rl.max_staleness=2", "rl.tis_level=token")
  rollout = _Rollout(cfg)
  run = RLRun(cfg=cfg, mesh=None, graphdef=None, state=types.SimpleNamespace(params=None, extra=None),
              ref_params=None, spec=None, estimator=None, rollout=rollout, update=None, logprob_fn=None,
              advantages_fn=None, tokenizer=ByteTokenizer(), pool=None, batch_sharding=None,
              zigzag_shards=1)
  events = []
  run.pool = _RecordingPool(lambda completion, example: 1.0, events, run, num_workers=1)
  examples = itertools.cycle([{"prompt": "rev abc=", "answer": "cba", "domain": "reverse"}])
  staleness = []
  for step in range(5):
    batch, metrics = collect(run, examples, jax.random.key(step))
    assert batch.arrays["tokens"].shape == (4, 12)
    staleness.append(metrics["staleness_max"])
    run.version += 1  # the update
  run.close()
  assert staleness == [0.0, 1.0, 2.0, 2.0, 2.0]
  assert [version for version, _ in rollout.calls] == [0, 0, 0, 1, 2, 3, 4]
  assert len({key for _, key in rollout.calls}) == len(rollout.calls)
  assert [queued for name, queued in events if name == "collect"] == [2] * 5


class _RecordingPool(RewardPool):
  """A RewardPool that logs when a batch's scoring starts (`submit`) and when the step waits for it
  (`collect`), with the rollouts queued at that moment."""

  def __init__(self, reward, events, run, **kw):
    super().__init__(reward, **kw)
    self.events, self.run = events, run

  def submit(self, completions, examples):
    self.events.append(("submit", len(self.run.in_flight)))
    return super().submit(completions, examples)

  def collect(self, pending):
    self.events.append(("collect", len(self.run.in_flight)))
    return super().collect(pending)


class _PlantedModel:
  """A model source (rl/rewards/sources.BatchScorer) that logs its dispatch and its read."""

  def __init__(self, events):
    self.events = events

  def dispatch(self, completions, examples):
    del examples
    self.events.append(("model_dispatch", None))
    return list(completions)

  def finish(self, completions):
    self.events.append(("model_finish", None))
    return np.full(len(completions), 0.5, np.float32), {"errors": 0, "first_errors": []}


def test_a_batch_is_scored_on_the_devices_before_the_next_rollout_is_dispatched():
  """Asynchronous RL with a reward model: each step pops batch k, starts its scoring (the verifier's
  samples queued, the reward model's calls dispatched to the devices), and only then dispatches batch
  k + 1's rollout; it waits for the scores after. Devices run programs in dispatch order, so a
  step that dispatched the rollout first would leave the reward model waiting for the whole rollout."""
  from meshrl.rl.rewards.sources import SourcedRewards, parse_sources  # pylint: disable=import-outside-toplevel
  cfg = _cfg("rl.max_staleness=1", "rl.tis_level=token")
  events = []

  class Rollout(_Rollout):
    def __call__(self, *args):
      events.append(("rollout", args[-1]))
      return super().__call__(*args)

  run = RLRun(cfg=cfg, mesh=None, graphdef=None, state=types.SimpleNamespace(params=None, extra=None),
              ref_params=None, spec=None, estimator=None, rollout=Rollout(cfg), update=None, logprob_fn=None,
              advantages_fn=None, tokenizer=ByteTokenizer(), pool=None, batch_sharding=None, zigzag_shards=1)
  pool = _RecordingPool(lambda completion, example: 1.0, events, run, num_workers=1)
  run.pool = SourcedRewards(pool, parse_sources("chat=reward_model;*=verifier"), {"reward_model": _PlantedModel(events)})
  examples = itertools.cycle([{"prompt": "rev abc=", "answer": "cba", "domain": "reverse"},
                              {"prompt": "say hi", "answer": "hi", "domain": "chat"}])
  rewards = []
  for step in range(3):
    batch, _ = collect(run, examples, jax.random.key(step))
    rewards.append(batch.rewards.tolist())
    run.version += 1
  run.close()
  names = [name if name != "rollout" else f"rollout{version}" for name, version in events]
  assert names == (["rollout0", "submit", "model_dispatch", "rollout0", "model_finish", "collect"]
                   + ["submit", "model_dispatch", "rollout1", "model_finish", "collect"]
                   + ["submit", "model_dispatch", "rollout2", "model_finish", "collect"]), names
  assert rewards == [[1.0, 1.0, 0.5, 0.5]] * 3  # the verifier's domain and the reward model's, each its own


@pytest.mark.parametrize("overrides, message", [
    (["rl.max_staleness=-1"], "rl.max_staleness=-1 must be >= 0"),
    (["rl.max_staleness=1"], "rl.max_staleness=1 trains on samples of older policies: set rl.tis_level"),
])
def test_bad_async_settings_are_refused_by_name(overrides, message):
  with pytest.raises(ValueError, match=message):
    loop.check_config(_cfg(*overrides))


def test_the_step_reports_the_speculative_rollouts_acceptance():
  """With rl.speculative on, each step's metrics carry the acceptance rate and tokens per target
  forward of that step's rollout (the speculative rollout's `.metrics`)."""
  from meshrl.rl.generation.output import RolloutBatch  # pylint: disable=import-outside-toplevel
  cfg = _cfg("rl.speculative=ngram")
  stub = _Rollout(cfg)

  class Speculative:
    metrics = None

    def __call__(self, *args):
      rate = 0.25 * (1 + len(stub.calls))  # differs per call: the step must read the latest
      self.metrics = {"acceptance_rate": np.float32(rate), "tokens_per_forward": np.float32(1 + 4 * rate)}
      return RolloutBatch(**stub(*args), routing=None)

  rollout = Speculative()
  run = RLRun(cfg=cfg, mesh=None, graphdef=None, state=types.SimpleNamespace(params=None, extra=None),
              ref_params=None, spec=None, estimator=None, rollout=rollout, update=None, logprob_fn=None,
              advantages_fn=None, tokenizer=ByteTokenizer(), pool=RewardPool(lambda c, e: 1.0, num_workers=1),
              batch_sharding=None, zigzag_shards=1)
  examples = itertools.cycle([{"prompt": "rev abc=", "answer": "cba", "domain": "reverse"}])
  rates = [collect(run, examples, jax.random.key(step))[1] for step in range(2)]
  run.close()
  assert [m["spec_acceptance_rate"] for m in rates] == [0.25, 0.5]
  assert [m["spec_tokens_per_forward"] for m in rates] == [2.0, 3.0]
