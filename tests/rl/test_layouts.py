"""rl/batches/layouts.py: the update batch's layout (zigzag, packed) to one contiguous row per sample and back,
on the mesh, equal to the host transforms, split like the batch; and an RL step's `prepare` pulls
nothing to the host."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.model.ring_attention import zigzag
from meshrl.rl.batches import packing
from meshrl.rl.batches.layouts import sample_layout
from meshrl.sharding import hosts

B, S = 8, 16


def _mesh():
  return Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "sequence"))


def test_zigzag_layout_equals_the_host_zigzag(devices):  # pylint: disable=unused-argument
  mesh = _mesh()
  sharding = NamedSharding(mesh, PartitionSpec("fsdp", "sequence"))
  layout = sample_layout(zigzag_shards=4, mesh=mesh, batch_sharding=sharding)
  x = np.random.RandomState(0).randn(B, S).astype(np.float32)
  samples = layout.to_samples(jax.device_put(zigzag(x, 4), sharding))
  np.testing.assert_array_equal(np.asarray(samples), x)
  back = layout.from_samples(jax.device_put(x, sharding))
  np.testing.assert_array_equal(np.asarray(back), zigzag(x, 4))
  for out in (samples, back):
    assert out.sharding.is_equivalent_to(sharding, 2)
  assert layout.to_samples(None) is None
  with pytest.raises(ValueError, match=r"zigzag over 2 shards needs the mesh's 'sequence' axis of that size"):
    sample_layout(zigzag_shards=2, mesh=mesh, batch_sharding=sharding)


@pytest.mark.parametrize("zigzag_shards", [1, 4])
def test_packed_layout_equals_the_plan(devices, zigzag_shards):  # pylint: disable=unused-argument
  """Packed [R, W] <-> [B, S] equals PackPlan.unpack / pack (bool masks too), padding 0 / False."""
  mesh = _mesh()
  lengths = np.array([3, 8, 5, 2, 16, 4, 0, 0])
  segment_ids = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
  plan = packing.plan_packing(segment_ids, lengths > 0,
                              packing.PackingSpec(rows=4, row_len=16, zigzag_shards=zigzag_shards))
  packed_sharding = NamedSharding(mesh, PartitionSpec("fsdp", "sequence"))
  samples_sharding = NamedSharding(mesh, PartitionSpec("fsdp", "sequence"))
  layout = sample_layout(plan=plan, mesh=mesh, batch_sharding=packed_sharding,
                         samples_sharding=samples_sharding)
  rng = np.random.RandomState(1)
  for x in (rng.randn(B, S).astype(np.float32), rng.rand(B, S) > 0.5):
    packed = plan.pack(x, 0)
    got = layout.from_samples(jax.device_put(x, samples_sharding))
    np.testing.assert_array_equal(np.asarray(got), packed)
    assert got.dtype == x.dtype and got.sharding.is_equivalent_to(packed_sharding, 2)
    back = layout.to_samples(jax.device_put(packed, packed_sharding))
    np.testing.assert_array_equal(np.asarray(back), plan.unpack(packed, 0))
    assert back.sharding.is_equivalent_to(samples_sharding, 2)


def test_prepare_pulls_nothing_to_the_host(devices, monkeypatch):  # pylint: disable=unused-argument
  """A ring-attention run's prepare (zigzag batch, reference log-probs for the KL, GAE on a critic's
  values: all three go to the samples' layout) moves no array through the host, and its advantages
  are the contiguous run's, zigzagged."""
  # pylint: disable=import-outside-toplevel
  from meshrl import configs
  from meshrl.model.init import build_model
  from meshrl.model.tokenizer import ByteTokenizer
  from meshrl.model.transformer import ModelConfig
  from meshrl.rl.batches.handover import ScoredBatch
  from meshrl.rl.step.program import _rollout_arrays, build_run, prepare
  from meshrl.sharding import make_mesh
  # pylint: enable=import-outside-toplevel
  tok = ByteTokenizer()
  small = ["model.num_layers=1", "model.embed_dim=32", "model.head_dim=8", "model.mlp_dim=32",
           "moe.num_experts=0", "rl.max_prompt_len=8", "rl.max_new_tokens=8", "model.max_seq_len=16",
           "rl.prompts_per_step=4", "rl.group_size=2", "mesh.sequence=2", "mesh.fsdp=4",
           "attention.block_q=4", "attention.block_kv=4", "rl.dynamic_sampling=false", "rl.advantage=gae",
           "model.value_head=true", "rl.kl_coef=0.1", "rl.kl_in_reward=true"]
  runs = {}
  for impl in ("ring", "reference"):
    cfg = configs.load("configs/tiny.py", small + [f"attention.impl={impl}"])
    mesh = make_mesh(cfg.mesh)
    runs[impl] = build_run(cfg, mesh, build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0), tok)
  plain = runs["reference"]
  tokens, mask = tok.encode_batch(["1+2=", "3+4=", "5+6=", "7+8="], length=8)
  out = plain.rollout(plain.state.params, plain.state.extra, tokens, mask, jax.random.key(0))
  rewards = np.random.RandomState(0).rand(8).astype(np.float32)
  scored = ScoredBatch(arrays=_rollout_arrays(out), rewards=rewards, correct=rewards,
                       sample_valid=np.ones(8, bool), domains=[""] * 8, texts=[""] * 8)
  pulled = []
  to_host = hosts.to_host
  monkeypatch.setattr(hosts, "to_host", lambda x: (pulled.append(np.shape(x)), to_host(x))[1])
  ring_batch, _ = prepare(runs["ring"], scored)
  assert not pulled, pulled
  plain_batch, _ = prepare(plain, scored)
  assert runs["ring"].zigzag_shards == 2
  assert ring_batch.advantages.sharding.is_equivalent_to(runs["ring"].batch_sharding, 2)
  for name in ("advantages", "returns"):
    want = np.asarray(getattr(plain_batch, name))
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(np.asarray(getattr(ring_batch, name)), zigzag(want, 2), atol=1e-5,
                               err_msg=name)
