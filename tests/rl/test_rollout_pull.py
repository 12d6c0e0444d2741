"""What a rollout sends through the hosts (rl/step/program.py `_rollout_arrays`, issue 14). A step keeps the
per-token fields on the devices (rl/batches/rows.DeviceRows, equal to the batch pulled whole) and pulls only
their response columns, for scoring and the staleness metric, for both rollout engines, the
asynchronous queue and partial rollouts (the ended groups' rows of the pool's batch)."""

import itertools

import jax
import numpy as np
import pytest

from meshrl import configs
from meshrl.rl.step import driver as loop
from meshrl.rl.step import program as step_lib
from meshrl.rl.batches.rows import PER_TOKEN_FIELDS
from meshrl.rl.batches.rows import DeviceRows
from meshrl.sharding import hosts

PROMPT, NEW = 12, 4
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", f"rl.max_prompt_len={PROMPT}", f"rl.max_new_tokens={NEW}",
         "model.max_seq_len=16", "rl.prompts_per_step=4", "rl.group_size=2", "rl.sft_steps=0",
         "rl.dynamic_sampling=false", "mesh.fsdp=4", "mesh.tensor=2"]


@pytest.mark.parametrize("engine, staleness", [("static", 0), ("continuous", 1)])
def test_a_step_keeps_the_tokens_on_the_devices_and_pulls_response_columns(devices, monkeypatch, engine,
                                                                           staleness):
  """Prompts of different lengths (left padding differs per group). The fields kept on the devices
  equal the whole batch pulled from them, field by field; during `collect` and `prepare` (the plain
  rollout, or the oldest rollout in flight with rl.max_staleness=1) no array of more than NEW columns
  goes through `hosts.to_host` (the whole [B, PROMPT + NEW] batch did before issue 14's part on the
  devices, and the update batch was then built from it on every host)."""
  cfg = configs.load("configs/tiny.py", SMALL + [f"rl.engine={engine}", f"rl.max_staleness={staleness}",
                                                   "rl.tis_level=" + ("token" if staleness else "none")])
  run, _ = loop.setup(cfg)
  texts = ["1+2=", "rev abcdef=", "7+5=", "rev xy="]
  tokens, mask = run.tokenizer.encode_batch(texts, length=PROMPT, padding="left")
  assert len(set(mask.sum(axis=1).tolist())) > 1
  out = run.rollout(run.state.params, run.state.extra, tokens, mask, jax.random.key(0), None, 3)
  whole = step_lib._rollout_arrays(out)  # pylint: disable=protected-access
  kept = step_lib._rollout_arrays(out, keep_on_devices=True)  # pylint: disable=protected-access
  assert whole["response_mask"][:, PROMPT:].any() and (whole["policy_version"] == 3).any()
  assert set(kept) == set(whole)
  for name in whole:
    if name == "routing":
      np.testing.assert_array_equal(kept[name].to_host(), whole[name].to_host())
      continue
    assert isinstance(kept[name], DeviceRows) == (name in PER_TOKEN_FIELDS), name
    host = kept[name].to_host() if name in PER_TOKEN_FIELDS else kept[name]
    assert host.dtype == whole[name].dtype, name
    np.testing.assert_array_equal(host, whole[name], err_msg=name)

  pulled, to_host = [], hosts.to_host

  def recording(x):
    if x is not None:
      pulled.append(tuple(x.shape))
    return to_host(x)
  monkeypatch.setattr(hosts, "to_host", recording)
  examples = itertools.cycle([{"prompt": t, "answer": "3", "domain": "arith"} for t in texts])
  batch, _ = step_lib.collect(run, examples, jax.random.key(1))
  update_batch, _ = step_lib.prepare(run, batch)
  run.close()
  assert batch.arrays["tokens"].shape == (8, PROMPT + NEW) and update_batch.tokens.shape == (8, PROMPT + NEW)
  per_token = [shape for shape in pulled if len(shape) == 2]
  assert per_token and all(shape[1] == NEW for shape in per_token), pulled


def test_partial_rollouts_keep_the_ended_rows_on_the_devices(devices, monkeypatch):
  """rl.rollout_token_budget: over 2 steps (groups carried from the first, so ended groups' prompts come
  from earlier steps) every step's arrays equal the ended rows of the devices' batch field by field,
  the per-token fields kept there as rows of that batch; only [B] vectors go through `hosts.to_host`,
  of one shape (no program per count of ended groups)."""
  cfg = configs.load("configs/tiny.py", SMALL + ["rl.engine=continuous", "rl.decode_slots=4",
                                                 "rl.rollout_token_budget=8", "rl.max_resample_rounds=0"])
  run, _ = loop.setup(cfg)
  partial, captured = run.partial, {}
  decode = partial._decode  # pylint: disable=protected-access

  def capturing(*args):
    captured["live"] = partial.live.copy()  # after the new groups are admitted
    captured["pool"], captured["batch"], metrics = decode(*args)
    return captured["pool"], captured["batch"], metrics
  partial._decode = capturing  # pylint: disable=protected-access
  texts = ["1+2=", "rev abcdef=", "7+5=", "rev xy=", "3+3=", "rev klmno="]
  stream = itertools.cycle(texts)

  def draw(count):
    chosen = [next(stream) for _ in range(count)]
    tokens, mask = run.tokenizer.encode_batch(chosen, length=PROMPT, padding="left")
    return chosen, tokens, mask

  pulled, to_host = [], hosts.to_host
  monkeypatch.setattr(hosts, "to_host", lambda x: (pulled.append(tuple(np.shape(x))), to_host(x))[1])
  carried = 0
  for version in range(2):
    pulled.clear()
    arrays, examples, info = partial.step(run.state.params, run.state.extra, draw, jax.random.key(version),
                                          version)
    carried += info["groups_carried"]
    group = cfg.rl.group_size
    done = np.asarray(captured["pool"].done).reshape(-1, group).all(axis=1)
    rows = (np.flatnonzero(done & captured["live"])[:, None] * group + np.arange(group)).reshape(-1)
    assert len(examples) * group == rows.size == arrays["tokens"].shape[0]
    assert pulled and all(shape == (cfg.rl.prompts_per_step * group,) for shape in pulled), pulled
    for name in PER_TOKEN_FIELDS + ("lengths", "truncated"):
      value = arrays[name]
      if name in PER_TOKEN_FIELDS:
        assert isinstance(value, DeviceRows) and value.sources[0] is getattr(captured["batch"], name), name
        value = value.to_host()
      np.testing.assert_array_equal(value, np.asarray(getattr(captured["batch"], name))[rows], err_msg=name)
  assert carried > 0
  run.close()
