"""RL from a real (tiny, random) Qwen3-MoE folder: import, 3 GRPO steps with its tokenizer, export,
reload in transformers: its logits equal meshrl's."""

import importlib.util
import os

import jax
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.rl.step import driver as loop
from meshrl.train.init_from import initial_model

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_RUN = ["model.dtype=float32", "model.remat=none", "attention.impl=reference", "rl.num_steps=3",
             "rl.prompts_per_step=4", "rl.group_size=2", "rl.num_minibatches=1", "rl.max_prompt_len=64",
             "rl.max_new_tokens=8", "rl.dynamic_sampling=false", "rl.overlong_buffer=0",
             "optim.learning_rate=1e-3", "optim.warmup_steps=0", "data.difficulty=1",
             "checkpoint.every=1", "checkpoint.async_save=false", "log.tensorboard=false",
             "log.plot=false", "log.progress_bar=false"]
TOKENS = np.random.RandomState(2).randint(0, 300, (2, 12))


def _export_main(argv):
  spec = importlib.util.spec_from_file_location("export_hf", os.path.join(REPO, "scripts", "export_hf.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main(argv)


def _params(model):
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_rl_from_hf_folder_then_export_matches_transformers(tiny_qwen3_moe, hf_fixtures, tmp_path, devices):
  del devices
  folder, workdir, out = tiny_qwen3_moe.path, str(tmp_path / "run"), str(tmp_path / "hf")
  cfg = configs.load(f"configs/hf_qwen3_moe.py:{folder}", SMALL_RUN)
  records = loop.run(cfg, workdir)
  assert [r["step"] for r in records] == [1, 2, 3]

  assert _export_main([f"--config=configs/hf_qwen3_moe.py:{folder}", *[f"--config.{o}" for o in SMALL_RUN],
                       f"--checkpoint={workdir}", f"--out={out}"]) == 0
  with cfg.unlocked():
    cfg.model.init_from = workdir
  final = initial_model(cfg, None)  # the run's last checkpoint, as meshrl reads it
  graphdef, state = nnx.split(final)
  logits = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits)(state, TOKENS))
  diff = np.abs(hf_fixtures.hf_logits(out, TOKENS) - logits).max()
  print(f"after 3 RL steps: max |transformers(exported) - meshrl| = {diff:.2e}")
  assert diff <= 1e-4

  with cfg.unlocked():
    cfg.model.init_from = folder
  start, end = _params(initial_model(cfg, None)), _params(final)
  moved = max(np.abs(end[p] - start[p]).max() for p in start)
  print(f"largest parameter change over 3 steps: {moved:.2e}")
  assert 0 < moved < 0.05  # trained, starting from the folder's weights (random init differs by ~0.2)
