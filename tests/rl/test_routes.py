"""rl/batches/routes.py: MoE routes for routing replay stay on the devices. RoutingRows moves samples like a
host [B, L, S, K] array would (slices, index arrays, concatenation with blank samples), `assemble`
builds the padded (zigzag) and packed update layouts on the mesh equal to the host layouts, and an RL
step never brings the routes to the host."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.ring_attention import zigzag
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.batches import packing, routes, rows
from meshrl.rl.batches.routes import RoutingRows
from meshrl.sharding import hosts, make_mesh

L, S, K, E = 2, 8, 2, 8


def _sources(mesh):
  """Two rollouts' routes [L, N, S, K] (N = 4 and 6) split over the mesh, and their host copies."""
  rng = np.random.default_rng(0)
  host = [rng.integers(0, E, (L, n, S, K)).astype(np.int32) for n in (4, 6)]
  sharding = NamedSharding(mesh, PartitionSpec(None, "fsdp", "sequence", None))
  return [jax.device_put(h, sharding) for h in host], [np.swapaxes(h, 0, 1) for h in host]  # [N, L, S, K]


def test_routing_rows_move_samples_like_a_host_array(devices):
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "sequence"))
  (a, b), (host_a, host_b) = _sources(mesh)
  first, second = RoutingRows.of_rollout(a), RoutingRows.of_rollout(b, rows=[5, 1, 3])
  assert first.shape == (4, L, S, K) and len(second) == 3
  np.testing.assert_array_equal(second.to_host(), host_b[[5, 1, 3]])
  picked = first[1:3]
  np.testing.assert_array_equal(picked.to_host(), host_a[1:3])
  np.testing.assert_array_equal(second[np.array([2, 0])].to_host(), host_b[[3, 5]])
  # Rows of both rollouts (one of them twice, its source kept once) and 2 blank samples.
  joined = rows.concatenate([picked, second[1:], first[:1]], blank=2)
  assert len(joined.sources) == 2 and len(joined) == 2 + 2 + 1 + 2
  want = np.concatenate([host_a[1:3], host_b[[1, 3]], host_a[:1], np.zeros((2, L, S, K), np.int32)])
  np.testing.assert_array_equal(joined.to_host(), want)
  np.testing.assert_array_equal(RoutingRows.from_host(want).to_host(), want)  # a checkpoint's JSON round trip


def test_assemble_builds_the_update_layouts_on_the_mesh(devices):
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "sequence"))
  (a, b), (host_a, host_b) = _sources(mesh)
  joined = rows.concatenate([RoutingRows.of_rollout(b, rows=[4, 0, 2]), RoutingRows.of_rollout(a)[1:4]],
                            blank=2)  # 8 samples, the last 2 blank
  want = np.concatenate([host_b[[4, 0, 2]], host_a[1:4], np.zeros((2, L, S, K), np.int32)])
  batch_sharding = NamedSharding(mesh, PartitionSpec("fsdp", "sequence"))
  padded = routes.assemble(joined, batch_sharding, zigzag_shards=4)
  np.testing.assert_array_equal(np.asarray(padded), zigzag(want, 4, axis=2))
  assert padded.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("fsdp", None, "sequence", None)), 4)
  # Packed: the samples' real tokens packed into rows (rl/batches/packing.py), routes moved cell by cell.
  lengths = np.array([3, 8, 5, 2, 6, 4, 0, 0])
  segment_ids = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
  spec = packing.PackingSpec(rows=6, row_len=S, zigzag_shards=2)  # the plan lays its columns zigzag
  plan = packing.plan_packing(segment_ids, lengths > 0, spec)
  packed = routes.assemble(joined, batch_sharding, plan=plan)
  host_packed = np.moveaxis(plan.pack(np.moveaxis(want, 1, 2), 0), 2, 1)  # pack_batch's host layout
  np.testing.assert_array_equal(np.asarray(packed), host_packed)


def test_assemble_takes_a_round_that_ended_no_group():
  """A restored round with no samples (a partial step that ended no group, from a checkpoint's JSON)
  beside blank samples: assemble gives zeros for the blanks (it used to index the empty source)."""
  empty = RoutingRows.from_host(np.zeros((0, L, S, K), np.int32))
  joined = rows.concatenate([empty], blank=4)
  np.testing.assert_array_equal(np.asarray(routes.assemble(joined, None)), np.zeros((4, L, S, K), np.int32))


def test_an_rl_step_keeps_the_routes_on_the_devices(devices, monkeypatch):
  """collect + prepare with routing replay, two rollout rounds of dynamic sampling: nothing of routes'
  size reaches the host (hosts.to_host), and the update batch gets them split like its tokens."""
  from meshrl.rl.step.program import build_run, collect, prepare  # pylint: disable=import-outside-toplevel
  tok = ByteTokenizer()
  cfg = configs.load("configs/tiny.py", [
      "model.num_layers=2", "model.embed_dim=32", "model.head_dim=8", "model.mlp_dim=32",
      "moe.expert_mlp_dim=16", "moe.first_k_dense=0", "rl.max_prompt_len=8", "rl.max_new_tokens=8",
      "model.max_seq_len=16", "rl.prompts_per_step=4", "rl.group_size=2", "mesh.fsdp=8",
      "rl.max_resample_rounds=1"])  # the zigzag of the routes: test_assemble_... and tests/rl/test_zigzag.py
  mesh = make_mesh(cfg.mesh)
  run = build_run(cfg, mesh, build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0), tok)
  pulled = []
  to_host = hosts.to_host
  monkeypatch.setattr(hosts, "to_host", lambda x: (pulled.append(np.shape(x)), to_host(x))[1])
  examples = iter([{"prompt": f"rev {w}=", "answer": w[::-1]} for w in ["abc", "dog", "sun", "map"] * 4])
  scored, metrics = collect(run, examples, jax.random.key(0))
  batch, _ = prepare(run, scored)
  assert isinstance(scored.arrays["routing"], RoutingRows)
  assert pulled and all(len(shape) <= 2 for shape in pulled), pulled  # tokens, masks: [B, S] at most
  assert isinstance(batch.routing, jax.Array) and batch.routing.shape == (8, 2, 16, 2)
  assert batch.routing.sharding.is_equivalent_to(routes.routes_sharding(run.batch_sharding), 4)
  # The routes are the rollout's: every batch row's routes come from one of the rounds' rows.
  host = np.asarray(jnp.asarray(batch.routing))
  sources = np.concatenate([np.swapaxes(np.asarray(s), 0, 1) for s in scored.arrays["routing"].sources])
  for b, row in enumerate(scored.arrays["routing"].rows):
    np.testing.assert_array_equal(host[b], sources[row])
  assert metrics["rollout_rounds"] == 2  # no group informative at init: a second round was drawn
