"""rl.rm_binarize: the reward model read as a learned verifier, 1 above the threshold calibrated on
its held-out pairs (train/rm_calibration.py), else 0.

Claims and the bugs they catch:
- the threshold is the cut that classifies the most held-out sides right (a brute-force numpy count
  over every cut agrees: an off-by-one in the cumulative counts, chosen and rejected swapped);
- the run's reward-model scorer applies it: its rewards are exactly raw score > threshold, and the
  option off leaves the raw scores (the option dropped between config and scorer);
- a reward model without calibration.json is refused in one line naming the file.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from meshrl import configs
from meshrl.train.checkpoint import Checkpointer
from meshrl.train.rm_calibration import FILE, best_threshold, read_threshold, write_calibration
from meshrl.rl.rewards.rm_job import reward_model_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=32",
         "data.seq_len=32", "model.init_std=0.5", "checkpoint.async_save=false", "rl.rm_binarize=false"]


def _brute(chosen, rejected):
  scores = np.sort(np.concatenate([chosen, rejected]))
  cuts = np.concatenate([[scores[0] - 1.0], (scores[1:] + scores[:-1]) / 2, [scores[-1] + 1.0]])
  counts = [np.sum(chosen > t) + np.sum(rejected <= t) for t in cuts]
  return max(counts) / (2 * len(chosen))


@pytest.mark.parametrize("seed", range(5))
def test_the_threshold_classifies_the_most_held_out_sides(seed):
  rng = np.random.default_rng(seed)
  chosen, rejected = rng.normal(1.0, 1.0, 40), rng.normal(-0.5, 1.0, 40)
  threshold, accuracy = best_threshold(chosen, rejected)
  assert accuracy == pytest.approx(_brute(chosen, rejected))
  assert accuracy == pytest.approx((np.sum(chosen > threshold) + np.sum(rejected <= threshold)) / 80)
  assert best_threshold(np.array([3.0, 4.0]), np.array([0.0, 1.0])) == (2.0, 1.0)


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
  """A random reward model of the small shape, saved as the RM job saves one."""
  # pylint: disable=import-outside-toplevel
  from flax import nnx
  from meshrl.model.init import build_model
  from meshrl.model.transformer import ModelConfig
  from meshrl.train.state import TrainState
  folder = str(tmp_path_factory.mktemp("rm") / "rm")
  rm_cfg = reward_model_config(configs.load(os.path.join(REPO, "configs/tiny_rm.py"), SMALL))
  os.makedirs(folder)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(rm_cfg.to_dict(), f)
  _, params, extra = nnx.split(build_model(ModelConfig.from_config(rm_cfg), None, seed=1), nnx.Param, ...)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state={}, extra=extra)
  with Checkpointer(os.path.join(folder, "checkpoints"), async_save=False) as ckpt:
    ckpt.save(3, state, config=rm_cfg, force=True)
  return folder


def test_the_scorer_rewards_one_above_the_threshold_and_zero_below(rm_folder):
  # pylint: disable=import-outside-toplevel
  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.envs.mixture import TaskMixture
  from meshrl.rl.rewards.sources import reward_model_scorer
  cfg = lambda *o: configs.load(os.path.join(REPO, "configs/tiny_rm.py"), SMALL + [  # noqa: E731
      f"rl.reward_model_checkpoint={rm_folder}", *o])
  tokenizer = tokenizer_from_config(cfg())
  examples = TaskMixture("reverse:1.0", seed=5).take(16)
  completions = [e["answer"] if i % 2 else e["answer"][::-1] + "q" for i, e in enumerate(examples)]
  raw, _ = reward_model_scorer(cfg(), None, tokenizer)(completions, examples)
  assert len(set(np.round(raw, 4))) > 4  # scores that differ
  with pytest.raises(ValueError, match=rf"^rl.rm_binarize=true reads the reward model's threshold from {rm_folder}/{FILE}, which does not exist"):
    reward_model_scorer(cfg("rl.rm_binarize=true"), None, tokenizer)
  threshold = float(np.median(raw))
  with open(os.path.join(rm_folder, FILE), "w") as f:
    json.dump({"threshold": threshold}, f)
  assert read_threshold(rm_folder) == threshold
  binary, _ = reward_model_scorer(cfg("rl.rm_binarize=true"), None, tokenizer)(completions, examples)
  np.testing.assert_array_equal(binary, (raw > threshold).astype(np.float32))
  assert 0 < binary.sum() < len(binary)
  write_calibration(rm_folder, raw[:8], raw[8:])  # what the job writes: readable back
  assert read_threshold(rm_folder) == best_threshold(raw[:8], raw[8:])[0]
