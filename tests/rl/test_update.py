"""The jitted update: lowers the RL loss on a fixed batch, keeps parameter shardings, checks input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.rollout import make_rollout
from meshrl.rl.update import make_update, rl_loss
from meshrl.sharding import make_mesh
from meshrl.train.optim import make_optimizer
from meshrl.train.state import create_train_state

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
         "rl.prompts_per_step=4", "rl.group_size=4", "optim.learning_rate=3e-3"]


def _batch(cfg, mesh, state):
  rollout = make_rollout(cfg, mesh, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
  tokens, mask = TOK.encode_batch(["1+2=", "3+4=", "5+6=", "7+8="], length=8)
  out = rollout(state.params, state.extra, tokens, mask, jax.random.key(0))
  rewards = np.random.RandomState(0).rand(16).astype(np.float32)
  advantages = (rewards - rewards.mean()) / rewards.std()
  return {"tokens": out.tokens, "positions": out.positions, "segment_ids": out.segment_ids,
          "response_mask": out.response_mask, "old_logprobs": out.logprobs,
          "advantages": jnp.asarray(advantages), "routing": jnp.swapaxes(out.routing, 0, 1)}


@pytest.mark.parametrize("extra", [[], ["rl.num_minibatches=2", "rl.epochs=2", "rl.policy_loss=gspo"]])
def test_update_lowers_loss_and_keeps_shardings(devices, extra):
  cfg = configs.load("configs/tiny.py", SMALL + ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"] + extra)
  mesh = make_mesh(cfg.mesh)
  tx = make_optimizer(cfg.optim)
  graphdef, state = create_train_state(build_model(ModelConfig.from_config(cfg, mesh), mesh), tx, mesh)
  batch = _batch(cfg, mesh, state)
  shardings = [x.sharding for x in jax.tree.leaves(state.params)]

  def loss_of(s):
    return float(rl_loss(s.params, s.extra, graphdef, batch, cfg.rl, cfg.moe)[0])
  before = loss_of(state)
  update = make_update(cfg, graphdef, tx)
  for i in range(5):
    state, metrics = update(state, batch, jax.random.key(i))
  after = loss_of(state)
  assert after < before - 0.05, (before, after)
  assert np.isfinite(float(metrics["grad_norm"]))
  for want, x in zip(shardings, jax.tree.leaves(state.params)):
    assert x.sharding.is_equivalent_to(want, x.ndim)  # the next rollout takes them in place


def test_minibatches_must_divide_batch():
  cfg = configs.load("configs/tiny.py", SMALL + ["rl.num_minibatches=3"])
  with pytest.raises(ValueError, match="rl.num_minibatches=3 must divide the batch of 16"):
    make_update(cfg, None, make_optimizer(cfg.optim))
