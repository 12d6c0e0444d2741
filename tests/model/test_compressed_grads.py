"""optim.grad_collective_dtype on a sharded model (sharding/compress.py through model/layers.py Dense,
model/moe_local.py and model/expert_parallel.py): the gradients equal the partitioner's within the wire
format's rounding, and the compiled program's gradient collectives are int8 and move fewer bytes."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig
from meshrl.sharding import traffic
from meshrl.sharding import make_mesh
from meshrl.train.sft import sft_loss

MODEL = ["model.num_layers=2", "moe.first_k_dense=1", "model.embed_dim=64", "model.num_heads=4",
         "model.num_kv_heads=2", "model.head_dim=16", "model.mlp_dim=128", "moe.num_experts=4",
         "moe.expert_mlp_dim=64", "model.max_seq_len=16", "moe.dispatch=dropless"]


def _batch():
  rng = np.random.RandomState(0)
  tokens = rng.randint(3, 259, (16, 12)).astype(np.int32)
  return {"tokens": tokens, "positions": np.tile(np.arange(12, dtype=np.int32), (16, 1)),
          "segment_ids": np.ones((16, 12), np.int32), "targets": np.roll(tokens, -1, 1),
          "weights": np.ones((16, 12), np.float32)}


def _grads_and_traffic(dtype: str, *mesh):
  cfg = configs.load("configs/tiny.py", MODEL + list(mesh) + [f"optim.grad_collective_dtype={dtype}"])
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  graphdef, params, extra = nnx.split(model, nnx.Param, ...)
  loss = functools.partial(sft_loss, graphdef=graphdef, moe_cfg=cfg.moe)
  grad_fn = jax.jit(jax.grad(lambda p, e, b: loss(p, e, batch=b)[0]))
  hlo = grad_fn.lower(params, extra, _batch()).compile().as_text()
  return jax.device_get(grad_fn(params, extra, _batch())), traffic.traffic(hlo), hlo


@pytest.mark.parametrize("mesh,ratio", [
    (("mesh.fsdp=4", "mesh.expert=2"), 1.8),
    # tensor parallelism's activation-gradient all-reduces (uncompressed) count among the backward's
    pytest.param(("mesh.fsdp=2", "mesh.data=2", "mesh.tensor=2"), 1.3, marks=pytest.mark.slow),
    # through the pipeline's stages: the reductions run inside the stage shard_map, once per microbatch
    pytest.param(("model.num_layers=4", "moe.first_k_dense=2", "mesh.stage=2", "mesh.fsdp=2", "mesh.expert=2",
                  "mesh.microbatches=2"), 1.8, marks=pytest.mark.slow)])
def test_compressed_gradients_match_and_int8_moves_fewer_bytes(devices, mesh, ratio):
  """fsdp=4 x expert=2 (and data x tensor, and pipeline stages): every gradient within 1% (bfloat16) /
  3% (int8) of its largest entry of the partitioner's float32 reduction (a reduction over the wrong axes,
  a chunk summed on the wrong device or a scale on the wrong block misses by whole values); the int8
  program sends its gradients as s8 all-to-alls, and its explicit reductions (sharding/compress.py's, the
  ones the option sets the wire format of) move at least 1.8x fewer bytes than the bfloat16 program's
  (1.3x with tensor parallelism, whose backward all-reduces of activations count too); the gradient
  reductions left to the partitioner (embedding, norms, router, head) are the same bytes in both, and
  they dominate this tiny model's total (two [259, 64] tables against 2 blocks of width 64), so the
  total is only asserted to drop. On CPU XLA widens bfloat16 collectives to float32, so the
  bfloat16 program's explicit bytes here are float32's; the TPU figure is docs/pods-and-aot.md's."""
  exact, _, _ = _grads_and_traffic("float32", *mesh)
  bf16, bf16_traffic, _ = _grads_and_traffic("bfloat16", *mesh)
  int8, int8_traffic, hlo = _grads_and_traffic("int8", *mesh)
  for got, bound in ((bf16, 0.01), (int8, 0.03)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(exact)):
      assert np.max(np.abs(a - b)) <= bound * np.max(np.abs(b)) + 1e-7
  assert any("s8[" in line and "all-to-all" in line and traffic.GRAD_SCOPE in line for line in hlo.splitlines())
  assert int8_traffic.explicit * ratio <= bf16_traffic.explicit, (int8_traffic.explicit, bf16_traffic.explicit)
  assert int8_traffic.grad - int8_traffic.explicit == bf16_traffic.grad - bf16_traffic.explicit
  assert int8_traffic.grad < bf16_traffic.grad


def test_a_dtype_the_backend_cannot_reduce_is_refused(devices):
  cfg = configs.load("configs/tiny.py", MODEL + ["optim.grad_collective_dtype=float8_e5m2"])
  with pytest.raises(ValueError, match=r"optim.grad_collective_dtype='float8_e5m2'.*cannot reduce"):
    ModelConfig.from_config(cfg)
