"""attention.zigzag on a sequence-sharded mesh: RL update batches and SFT rows are laid out zigzag for
ring attention, and the loss equals the contiguous layout's with plain attention."""

import jax
import numpy as np

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.envs import TaskMixture
from meshrl.rl.step.program import _rollout_arrays, build_run, prepare
from meshrl.rl.algo.update import rl_loss
from meshrl.sharding import make_mesh
from meshrl.train.data import make_sft_data
from meshrl.train.sft import model_rows, sft_loss, zigzag_shards
from meshrl.train.state import split_model

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "moe.first_k_dense=0", "rl.max_prompt_len=8", "rl.max_new_tokens=8",
         "model.max_seq_len=32", "rl.prompts_per_step=4", "rl.group_size=2", "mesh.sequence=2",
         "mesh.fsdp=4", "attention.block_q=4", "attention.block_kv=4", "rl.dynamic_sampling=false",
         "data.seq_len=32", "rl.sft_batch_size=4"]


def _run(impl):
  cfg = configs.load("configs/tiny.py", SMALL + [f"attention.impl={impl}"])
  mesh = make_mesh(cfg.mesh)
  return build_run(cfg, mesh, build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0), TOK)


def test_zigzag_update_batch_has_the_contiguous_loss(devices):
  ring, plain = _run("ring"), _run("reference")
  assert ring.zigzag_shards == 2 and plain.zigzag_shards == 1
  tokens, mask = TOK.encode_batch(["1+2=", "3+4=", "5+6=", "7+8="], length=8)
  out = plain.rollout(plain.state.params, plain.state.extra, tokens, mask, jax.random.key(0))
  rewards = np.random.RandomState(0).rand(8).astype(np.float32)
  scored = ScoredBatch(arrays=_rollout_arrays(out), rewards=rewards, correct=rewards,
                       sample_valid=np.ones(8, bool), domains=[""] * 8, texts=[""] * 8)
  ring_batch, _ = prepare(ring, scored)
  plain_batch, _ = prepare(plain, scored)
  assert not np.array_equal(np.asarray(ring_batch.tokens), np.asarray(plain_batch.tokens))  # laid out zigzag
  ring_loss, ring_metrics = rl_loss(ring.state.params, ring.state.extra, ring.graphdef, ring_batch, ring.spec)
  plain_loss, plain_metrics = rl_loss(plain.state.params, plain.state.extra, plain.graphdef, plain_batch,
                                      plain.spec)
  np.testing.assert_allclose(float(ring_loss), float(plain_loss), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(ring_metrics["entropy"]), float(plain_metrics["entropy"]), rtol=1e-5)


def test_zigzag_sft_rows_have_the_contiguous_loss(devices):
  losses = {}
  for impl in ("ring", "reference"):
    cfg = configs.load("configs/tiny.py", SMALL + [f"attention.impl={impl}"])
    mesh = make_mesh(cfg.mesh)
    graphdef, params, extra = split_model(build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0))
    host = next(make_sft_data(cfg, source=TaskMixture("arithmetic:1.0,reverse:1.0", seed=0)))
    rows = model_rows(host, zigzag_shards(cfg, mesh))
    losses[impl] = float(sft_loss(params, extra, graphdef, rows, moe_cfg=cfg.moe)[0])
    if impl == "ring":
      assert zigzag_shards(cfg, mesh) == 2
      assert not np.array_equal(rows["tokens"], host["tokens"])
  np.testing.assert_allclose(losses["ring"], losses["reference"], rtol=1e-5)
