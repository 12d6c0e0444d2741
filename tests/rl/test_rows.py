"""rl/batches/rows.py: a rollout's per-token fields stay on the devices. DeviceRows moves samples like a host
[B, S] array (slices, index arrays, concatenation with blank samples of its fill), pulls chosen columns,
and gathers its rows on the mesh; `prepare` then builds the update batch there, equal to the batch it
builds from host arrays, padded, packed and zigzag, with nothing of the batch's size on the host."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.batches import rows
from meshrl.rl.step.groups import select_groups
from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.batches.rows import DeviceRows
from meshrl.rl.step.program import _rollout_arrays, build_run, fetch_metrics, prepare
from meshrl.sharding import hosts, make_mesh

TOK = ByteTokenizer()


def test_device_rows_move_samples_like_a_host_array(devices):
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "sequence"))
  split = NamedSharding(mesh, PartitionSpec("fsdp", "sequence"))
  rng = np.random.default_rng(0)
  host_a, host_b = (rng.integers(0, 99, (n, 8)).astype(np.int32) for n in (4, 6))
  a, b = (DeviceRows.of(jax.device_put(h, split), fill=-1) for h in (host_a, host_b))
  assert a.shape == (4, 8) and a.dtype == np.int32 and len(b[[5, 1, 3]]) == 3
  np.testing.assert_array_equal(b[np.array([5, 1, 3])].to_host(), host_b[[5, 1, 3]])
  np.testing.assert_array_equal(a[1:3].to_host(columns=slice(-3, None)), host_a[1:3, -3:])
  np.testing.assert_array_equal(b[4], host_b[4])
  # Rows of both (one source twice, kept once) and 2 blank samples of the fill.
  joined = rows.concatenate([a[1:3], b[[1, 3]], a[:2]], blank=2)
  assert len(joined.sources) == 2 and joined.fill == -1
  want = np.concatenate([host_a[1:3], host_b[[1, 3]], host_a[:2], np.full((2, 8), -1, np.int32)])
  np.testing.assert_array_equal(joined.to_host(), want)
  gathered = joined.gather(split)
  np.testing.assert_array_equal(np.asarray(gathered), want)
  assert gathered.sharding.is_equivalent_to(split, 2)
  with pytest.raises(ValueError, match="rows must be a"):
    DeviceRows((host_a,), np.array([4]))


def test_fields_that_share_rows_are_gathered_in_one_call_per_source(devices, monkeypatch):
  """gather_many: the per-field gathers' arrays, with one take program call per source for fields
  whose samples lie alike (a batch's per-token fields), and a field of other rows gathered apart."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "sequence"))
  split = NamedSharding(mesh, PartitionSpec("fsdp", "sequence"))
  rng = np.random.default_rng(1)
  rounds = [{"tokens": rng.integers(0, 99, (n, 8)).astype(np.int32),
             "logprobs": rng.normal(size=(n, 8)).astype(np.float32),
             "mask": rng.random((n, 8)) > 0.5} for n in (4, 8)]
  fills = {"tokens": -1, "logprobs": 0.0, "mask": False}
  picked = np.array([5, 0, 2, 11, 7, 1])
  fields = {name: rows.concatenate([DeviceRows.of(jax.device_put(r[name], split), fill=fill) for r in rounds],
                                   blank=2)[np.r_[picked, 12, 13]] for name, fill in fills.items()}
  fields["other"] = fields["tokens"][::-1]  # the same sources, other rows
  calls = []
  take = rows._take_program  # pylint: disable=protected-access

  def counted(*args):
    program = take(*args)
    return lambda outs, sources, local: (calls.append(len(outs)), program(outs, sources, local))[1]
  monkeypatch.setattr(rows, "_take_program", counted)
  gathered = rows.gather_many(fields, split)
  assert sorted(calls) == [1, 1, 3, 3]  # 3 alike fields: one call per source; `other`: its own
  for name, field in fields.items():
    want = np.concatenate([r[name if name != "other" else "tokens"] for r in rounds])
    want = np.concatenate([want, np.full((1, 8), fills.get(name, -1), want.dtype)])
    rows_of = np.where(np.asarray(field.rows) < 0, len(want) - 1, np.asarray(field.rows))
    np.testing.assert_array_equal(np.asarray(gathered[name]), want[rows_of])
    assert gathered[name].sharding.is_equivalent_to(split, 2)


def test_staleness_of_rows_on_the_devices_is_reduced_there(devices, monkeypatch):
  """groups.staleness of DeviceRows: the host arithmetic's mean and max of versions behind, as jax
  scalars computed on the devices (nothing [B, S] pulled to the host); 0 without generated tokens."""
  from meshrl.rl.step import groups  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(2)
  versions = rng.integers(0, 5, (6, 8)).astype(np.int32)
  mask = rng.random((6, 8)) > 0.6
  host = groups.staleness({"policy_version": versions, "response_mask": mask}, 7)
  behind = 7 - versions[mask]
  assert host == {"staleness_mean": pytest.approx(behind.mean()), "staleness_max": float(behind.max())}
  on_devices = {"policy_version": DeviceRows.of(jax.numpy.asarray(versions), fill=-1),
                "response_mask": DeviceRows.of(jax.numpy.asarray(mask))}
  monkeypatch.setattr(hosts, "to_host", lambda x: pytest.fail("a [B, S] field went to the host"))
  device = groups.staleness(on_devices, 7)
  assert all(isinstance(v, jax.Array) for v in device.values())
  assert {k: float(v) for k, v in device.items()} == pytest.approx(host)
  none = {"policy_version": DeviceRows.of(jax.numpy.asarray(versions[:2])),
          "response_mask": DeviceRows.of(jax.numpy.zeros((2, 8), bool))}
  assert {k: float(v) for k, v in groups.staleness(none, 7).items()} == {"staleness_mean": 0.0, "staleness_max": 0.0}


SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "moe.first_k_dense=0", "rl.max_prompt_len=8", "rl.max_new_tokens=8",
         "model.max_seq_len=32", "rl.prompts_per_step=4", "rl.group_size=2", "rl.dynamic_sampling=true",
         "rl.sft_steps=0", "attention.block_q=4", "attention.block_kv=4", "rl.kl_coef=0.01"]
LAYOUTS = {
    "padded": ["mesh.fsdp=4", "mesh.tensor=2"],
    "packed": ["mesh.fsdp=4", "mesh.tensor=2", "rl.pack_updates=true", "rl.packed_rows=4",
               "rl.packed_row_len=32"],
    "zigzag": ["mesh.fsdp=4", "mesh.sequence=2", "attention.impl=ring"],
    "replay": ["mesh.fsdp=4", "mesh.tensor=2", "rl.replay_routing=true"],
}


def _first_groups(scored: ScoredBatch, count: int) -> ScoredBatch:
  """The first `count` samples of a ScoredBatch (as partial rollouts return only the ended groups)."""
  return ScoredBatch(arrays={k: v[:count] for k, v in scored.arrays.items()}, rewards=scored.rewards[:count],
                     correct=scored.correct[:count], sample_valid=scored.sample_valid[:count],
                     domains=scored.domains[:count], texts=scored.texts[:count])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prepare_builds_the_same_update_batch_from_rows_on_the_devices(devices, monkeypatch, layout):
  """Two rollout rounds, dynamic sampling keeping groups of both (and one uninformative group, which
  gets no gradient), and a batch of two groups padded with two blank ones (partial rollouts): the
  update batch `prepare` builds from the rows on the devices equals, field by field, the one it builds
  from the same samples on the host; on the device path no array of more than one axis goes through
  `hosts.to_host`, and no metric is fetched (rl_step fetches them after dispatching the update)."""
  cfg = configs.load("configs/tiny.py", SMALL + LAYOUTS[layout])
  mesh = make_mesh(cfg.mesh)
  run = build_run(cfg, mesh, build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0), TOK)
  rounds = {"host": [], "devices": []}
  for r, texts in enumerate((["1+2=", "rev abc=", "7+5=", "rev xy="], ["3+4=", "rev q=", "9+9=", "rev mn="])):
    tokens, mask = TOK.encode_batch(texts, length=cfg.rl.max_prompt_len, padding="left")
    out = run.rollout(run.state.params, run.state.extra, tokens, mask, jax.random.key(r))
    rewards = np.array([[1, 0, 0, 0, 1, 1, 0, 1], [0, 0, 1, 0, 1, 1, 1, 1]][r], np.float32)
    for where, keep in (("host", False), ("devices", True)):
      rounds[where].append(ScoredBatch(arrays=_rollout_arrays(out, keep_on_devices=keep), rewards=rewards,
                                       correct=rewards, sample_valid=np.ones(8, bool), domains=[""] * 8,
                                       texts=[""] * 8))
  selections = {
      "dynamic": lambda scored: select_groups(scored, num_groups=4, group_size=2, dynamic=True),
      "blank": lambda scored: select_groups([_first_groups(scored[1], 4)], num_groups=4, group_size=2,
                                            dynamic=False)}
  for selection, select in selections.items():
    batches = {where: select(scored) for where, scored in rounds.items()}
    assert isinstance(batches["devices"].arrays["tokens"], DeviceRows)
    assert not batches["host"].sample_valid.all()  # an uninformative group; blank groups
    pulled, to_host = [], hosts.to_host

    def recording(x, to_host=to_host, pulled=pulled):
      pulled.append(np.shape(x))
      return to_host(x)
    want, want_metrics = prepare(run, batches["host"])
    monkeypatch.setattr(hosts, "to_host", recording)
    fetched, device_get = [], jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: (fetched.append(x), device_get(x))[1])
    got, got_metrics = prepare(run, batches["devices"])
    monkeypatch.undo()
    assert all(len(shape) <= 1 for shape in pulled), pulled
    assert not fetched, "prepare waited for metrics rl_step fetches after the update is dispatched"
    assert fetch_metrics(got_metrics) == fetch_metrics(want_metrics), selection
    if layout == "packed":
      assert got.sequence_ids is not None and got.tokens.shape == (4, 32)
    for name in ("tokens", "positions", "segment_ids", "targets", "loss_mask", "old_logprobs", "advantages",
                 "ref_logprobs", "routing", "sequence_ids"):
      if getattr(want, name) is None:
        assert getattr(got, name) is None, name
        continue
      np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                    err_msg=f"{selection}: {name}")
      assert getattr(got, name).sharding.is_equivalent_to(getattr(want, name).sharding, np.ndim(getattr(want, name)))
  # A round restored from a checkpoint (host arrays) among rounds on the devices: moved to the host.
  mixed = select_groups([rounds["host"][0], rounds["devices"][1]], num_groups=4, group_size=2, dynamic=True)
  assert not isinstance(mixed.arrays["tokens"], DeviceRows)
  np.testing.assert_array_equal(np.asarray(prepare(run, mixed)[0].loss_mask),
                                np.asarray(prepare(run, selections["dynamic"](rounds["host"]))[0].loss_mask))
  run.close()
