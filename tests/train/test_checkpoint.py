"""Checkpoints: round trip, restore onto a different mesh, data-iterator state, max_to_keep."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from meshrl.configs import load
from meshrl.model.init import build_model
from meshrl.model.moe import RouterBias
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.sharding import make_mesh
from meshrl.train.checkpoint import Checkpointer, from_nested_dict, to_nested_dict
from meshrl.train.optim import make_optimizer
from meshrl.train.state import abstract_train_state, create_train_state


def _mesh(**sizes):
  axes = dict(data=1, fsdp=1, expert=1, sequence=1, tensor=1, num_slices=1)
  axes.update(sizes)
  return make_mesh(ml_collections.ConfigDict(axes))


def _state(cfg, mesh, seed):
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=seed)
  return create_train_state(model, make_optimizer(cfg.optim), mesh)[1]


@pytest.fixture(scope="module")
def cfg():
  return load("configs/tiny.py", ["model.embed_dim=64", "model.mlp_dim=128", "moe.expert_mlp_dim=64",
                                  "moe.aux_free_bias=true"])


def _assert_equal_trees(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_moments_sharded_like_params(state):
  adam = state.opt_state[1][0]  # chain(clip, adamw): ScaleByAdamState
  for moment in (adam.mu, adam.nu):
    for m, p in zip(jax.tree.leaves(moment), jax.tree.leaves(state.params), strict=True):
      assert m.sharding == p.sharding


class _Small(nnx.Module):
  def __init__(self):
    self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    self.router_bias = RouterBias(jnp.arange(4.0))


def test_nested_dict_round_trip(cfg):
  _, state = create_train_state(_Small(), make_optimizer(cfg.optim))
  nested = to_nested_dict(state)
  assert set(nested) == {"step", "params", "opt_state", "extra"}
  assert set(nested["params"]["linear"]) == {"kernel", "bias"}
  _assert_equal_trees(from_nested_dict(nested, state), state)


def test_restore_onto_a_different_mesh(cfg, tmp_path):
  saved = _state(cfg, _mesh(fsdp=8), seed=1)
  saved = saved.replace(step=saved.step + 7)
  with Checkpointer(str(tmp_path), every=1, async_save=True) as ckpt:
    assert ckpt.restore(saved) is None
    assert ckpt.save(7, saved, data_state={"next_index": 42, "skipped": 3}, config=cfg)

  other_mesh = _mesh(fsdp=2, tensor=4)
  mc = ModelConfig.from_config(cfg, other_mesh)
  _, target = abstract_train_state(lambda: Transformer(mc, rngs=nnx.Rngs(0)), make_optimizer(cfg.optim),
                                   other_mesh)
  for state in (saved, target):
    _assert_moments_sharded_like_params(state)
  with Checkpointer(str(tmp_path)) as ckpt:
    restored = ckpt.restore(target)
  assert restored.step == 7
  assert restored.data_state == {"next_index": 42, "skipped": 3}
  assert restored.config["model"]["embed_dim"] == 64
  _assert_equal_trees(restored.state, saved)
  for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(target), strict=True):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  assert any(not x.sharding.is_fully_replicated and "tensor" in str(x.sharding.spec)
             for x in jax.tree.leaves(restored.state.params))


def test_max_to_keep_and_every(tmp_path):
  state = {"w": jnp.arange(4.0)}
  with Checkpointer(str(tmp_path), every=2, max_to_keep=2, async_save=False) as ckpt:
    for step in range(1, 9):
      if ckpt.should_save(step):
        ckpt.save(step, {"w": state["w"] * step})
    assert ckpt.all_steps() == [6, 8]
    restored = ckpt.restore(state)
  assert restored.step == 8
  np.testing.assert_array_equal(restored.state["w"], np.arange(4.0) * 8)


# --- crash safety, extra state, bad input, restore anywhere ----------------------------------------

_KILL_DURING_SAVE = r"""
import os, signal, sys
from meshrl.configs.cli import simulate_cpu_devices
simulate_cpu_devices(2)
import jax, jax.numpy as jnp
from meshrl.train.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], every=1, async_save=True)
big = jnp.zeros((8, 1024, 1024), jnp.float32)  # 32 MB: the background write takes a while
ckpt.save(1, {"w": big + 1.0}, data_state={"next_example": 10}, extra_state={"quarantine": ["a"]})
ckpt.wait()
ckpt.save(2, {"w": big + 2.0}, data_state={"next_example": 20})  # returns while files are written
names = os.listdir(sys.argv[1])
print("writing:", any("orbax-checkpoint-tmp" in n for n in names), "committed:", sorted(names), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_during_async_save_leaves_the_previous_checkpoint(tmp_path):
  """SIGKILL while step 2 is being written: step 1 stays the latest, restorable and whole, and the
  next save after the restart commits (the torn temporary folder is cleaned up, never listed)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  folder = tmp_path / "ckpt"
  proc = subprocess.run([sys.executable, "-c", _KILL_DURING_SAVE, str(folder)], capture_output=True,
                        text=True, timeout=300, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == -9, proc.stderr[-2000:]
  assert "writing: True" in proc.stdout, proc.stdout  # the kill really fell inside the save
  with Checkpointer(str(folder), async_save=False) as ckpt:
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    restored = ckpt.restore({"w": jnp.zeros((8, 1024, 1024), jnp.float32)})
    assert restored.data_state == {"next_example": 10}
    assert restored.extra_state == {"quarantine": ["a"]}
    assert float(restored.state["w"].min()) == float(restored.state["w"].max()) == 1.0
    ckpt.save(2, {"w": jnp.full((2,), 3.0)})
  assert sorted(p.name for p in folder.iterdir()) == ["1", "2"]


def test_extra_state_and_arrays_in_it_round_trip(tmp_path):
  with Checkpointer(str(tmp_path), async_save=True) as ckpt:
    ckpt.save(3, {"w": jnp.arange(3.0)}, extra_state={"carried": np.arange(6).reshape(2, 3),
                                                      "quarantine": ["task-7"], "n": np.int32(4)})
  with Checkpointer(str(tmp_path)) as ckpt:
    restored = ckpt.restore({"w": jnp.zeros(3)})
  assert restored.extra_state == {"carried": [[0, 1, 2], [3, 4, 5]], "quarantine": ["task-7"], "n": 4}


def _tree_files(folder):
  return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def saved_sharded(cfg, tmp_path_factory):
  """(work directory, state): a TrainState-shaped pytree sharded over fsdp=4 x tensor=2, saved at
  step 5 with `cfg` (no model is built: restoring reads arrays, whatever they are)."""
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  mesh = _mesh(fsdp=4, tensor=2)
  rng = np.random.default_rng(0)

  def put(shape, *spec):
    return jax.device_put(rng.standard_normal(shape).astype(np.float32),
                          NamedSharding(mesh, PartitionSpec(*spec)))
  params = {"embed": {"embedding": put((256, 64), "tensor", "fsdp")},
            "blocks": {"mlp": {"kernel": put((2, 64, 128), None, "fsdp", "tensor")},
                       "norm": {"scale": put((2, 64), None, None)}}}
  state = {"step": jnp.int32(5), "params": params,
           "opt_state": {"mu": jax.tree.map(lambda x: x * 0.5, params)},
           "extra": {"router_bias": put((1, 4), None, None)}}
  workdir = tmp_path_factory.mktemp("saved_sharded")
  with Checkpointer(str(workdir / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(5, state, config=cfg)
  return workdir, state


def test_bad_checkpoints_are_named_and_left_untouched(cfg, saved_sharded, tmp_path):
  """Another model's checkpoint, a partial copy and damaged files: a CheckpointError naming the
  step folder (and the differing arrays or fields), and not a byte of the folder changed."""
  from meshrl.train.checkpoint import CheckpointError  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  workdir, saved = saved_sharded
  shutil.copytree(workdir / "checkpoints", tmp_path / "ok")
  before = _tree_files(tmp_path / "ok")
  wider = load("configs/tiny.py", ["model.embed_dim=96", "model.mlp_dim=128", "moe.expert_mlp_dim=64",
                                   "moe.aux_free_bias=true"])
  other = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), saved)
  other["params"]["embed"]["embedding"] = jax.ShapeDtypeStruct((256, 96), jnp.float32)
  with Checkpointer(str(tmp_path / "ok")) as ckpt:
    with pytest.raises(CheckpointError, match=r"ok/5 was saved by a run of another model: "
                       r"model.embed_dim=96 \(checkpoint: 64\)"):
      ckpt.check_config(wider)
    ckpt.check_config(cfg)  # the same model passes
    with pytest.raises(CheckpointError, match=r"ok/5 does not fit this run's state \(another model\?\): "
                       r"params/embed/embedding: saved \(256, 64\), this run \(256, 96\)"):
      ckpt.restore(other)
  assert _tree_files(tmp_path / "ok") == before

  shutil.copytree(tmp_path / "ok", tmp_path / "partial")
  shutil.rmtree(tmp_path / "partial" / "5" / "data")
  with Checkpointer(str(tmp_path / "partial")) as ckpt:
    with pytest.raises(CheckpointError, match=r"partial/5 is damaged \(it has no data/ \(a partial copy\?\)\); no earlier step"):
      ckpt.restore(saved)
  shutil.copytree(tmp_path / "ok", tmp_path / "damaged")
  for path in (tmp_path / "damaged" / "5" / "state").rglob("*"):
    if path.is_file() and "manifest" not in path.name and "METADATA" not in path.name.upper():
      path.write_bytes(b"\0" * 16)
  with Checkpointer(str(tmp_path / "damaged")) as ckpt:
    with pytest.raises(CheckpointError, match=r"damaged/5 is damaged \((its arrays cannot be read|it has no array metadata|its OCDBT index).*\); no earlier step"):
      ckpt.restore(saved)


def test_load_params_onto_one_cpu_device_equals_the_saved_values(saved_sharded):
  """A state sharded over 8 devices (fsdp=4, tensor=2) comes back on one CPU device, no mesh, no
  model code: every parameter equal to the saved one; only the parts asked for are read."""
  from meshrl.train.checkpoint import load_params  # pylint: disable=import-outside-toplevel
  workdir, saved = saved_sharded
  out = load_params(str(workdir))  # the work directory holding checkpoints/
  assert set(out) == {"params"}
  want = saved["params"]
  got_leaves, want_leaves = jax.tree.leaves(out["params"]), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves) == 3
  device = jax.local_devices(backend="cpu")[0]
  for got, w in zip(got_leaves, want_leaves, strict=True):
    assert got.sharding.device_set == {device}
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(saved["params"]))
  both = load_params(str(workdir / "checkpoints" / "5"), parts=("params", "extra"))
  _assert_equal_trees(both["extra"], saved["extra"])
  assert set(both) == {"params", "extra"}


def test_documented_restore_snippet_runs_in_a_fresh_process(saved_sharded, tmp_path):
  """docs/real-checkpoints.md's "Restore a checkpoint" code, run as written (only the path replaced)
  in a new process, reads exactly the saved parameters onto one CPU device."""
  import re  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  from pathlib import Path  # pylint: disable=import-outside-toplevel
  guide = (Path(__file__).resolve().parents[2] / "docs" / "real-checkpoints.md").read_text()
  section = guide[guide.index("## Restore a checkpoint"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  workdir, saved = saved_sharded
  state_dir = workdir / "checkpoints" / "5" / "state"
  code, count = re.subn(r'state_dir = "[^"]*"', f'state_dir = "{state_dir}"', code)
  assert count == 1
  out = tmp_path / "params.npz"
  code += ("import numpy as np\n"
           f"np.savez({str(out)!r}, **{{jax.tree_util.keystr(p): np.asarray(x) for p, x in "
           "jax.tree_util.tree_leaves_with_path(params)})\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  want = {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(saved["params"])}
  got = dict(np.load(out))
  assert f"{sum(x.size for x in want.values())} parameters" in proc.stdout
  assert got.keys() == want.keys()
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value)


@pytest.mark.parametrize("damage", ["emptied manifest", "emptied metadata", "zeroed arrays", "truncated arrays",
                                    "no data/"])
def test_a_damaged_latest_checkpoint_names_the_intact_step_before_it(tmp_path, damage, monkeypatch, caplog):
  """Step 2 of two is damaged (an emptied OCDBT manifest ended a resume in "Event loop is closed"):
  check_readable (metadata only) or restore raise one line naming step 2, what is wrong and the
  intact step 1 to resume from; not a byte changes; step 1 still restores. Nothing else is printed:
  orbax's concurrent reads, once one failed, reported ~60 "Event loop is closed" tracebacks and
  "Task exception was never retrieved" after the line (an emptied manifest, through orbax's
  metadata read) or each read's TensorStore spec (truncated arrays, through load_params)."""
  import gc  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  from meshrl.train.checkpoint import CheckpointError, check_readable, load_params  # pylint: disable=import-outside-toplevel
  reports = []  # what would reach stderr as "Exception ignored in: ..."
  monkeypatch.setattr(sys, "unraisablehook", reports.append)
  # Random (incompressible) arrays of 16 KiB: stored in OCDBT's data files, not inline in its nodes.
  layers = {f"layer{i}": jax.random.normal(jax.random.key(i), (64, 64)) for i in range(6)}
  state = {"params": {"w": jnp.arange(16.0).reshape(4, 4), **layers}, "step": jnp.zeros((), jnp.int32)}
  with Checkpointer(str(tmp_path / "ck"), async_save=False, max_to_keep=3) as ckpt:
    ckpt.save(1, state, config={"a": 1}, force=True)
    ckpt.save(2, jax.tree.map(lambda x: x + 1, state), config={"a": 1}, force=True)
  step_dir = tmp_path / "ck" / "2"
  data_files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  if damage == "emptied manifest":
    (step_dir / "state" / "manifest.ocdbt").write_bytes(b"")
  elif damage == "emptied metadata":
    (step_dir / "state" / "_METADATA").write_bytes(b"")
  elif damage == "zeroed arrays":
    for path in (step_dir / "state").rglob("*"):
      if path.is_file() and "manifest" not in path.name and "METADATA" not in path.name.upper():
        path.write_bytes(b"\0" * 16)
  elif damage == "truncated arrays":  # the metadata reads; the arrays' bytes end early
    biggest = max(data_files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:biggest.stat().st_size // 4])
  else:
    shutil.rmtree(step_dir / "data")
  before = _tree_files(tmp_path / "ck")
  with Checkpointer(str(tmp_path / "ck")) as ckpt:
    with pytest.raises(CheckpointError) as raised:
      check_readable(str(step_dir))
      ckpt.restore(state)  # zeroed arrays pass the metadata check; reading them fails
    message = str(raised.value)
    assert "\n" not in message and len(message) < 600, message
    assert f"checkpoint {step_dir} is damaged (" in message
    assert "step 1 before it is intact: move" in message and "to resume from step 1" in message
    assert ckpt.restore(state, step=1).state["params"]["w"][0, 1] == 1.0  # step 1 really is intact
  if damage != "no data/":
    with pytest.raises(CheckpointError, match=r"is damaged \((its arrays|its OCDBT index|it has no array)") as raised:
      load_params(str(step_dir))
    assert "\n" not in str(raised.value) and "pybind11" not in str(raised.value), raised.value
  del raised  # its traceback holds orbax's failed reads, which report when collected
  time.sleep(0.5)  # the other reads finish (their reports come after the error)
  gc.collect()
  assert not reports, [f"{type(r.exc_value).__name__}: {str(r.exc_value)[:80]}" for r in reports]
  assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text[:300]
  assert _tree_files(tmp_path / "ck") == before


def test_a_checkpoint_named_by_a_relative_path_is_readable(tmp_path, monkeypatch):
  """configs/tiny_rm.py names its reward model runs/tiny_rm/reward_model: orbax read no array
  metadata under a relative path, so check_readable called the intact checkpoint damaged."""
  from meshrl.train.checkpoint import check_readable, saved_shapes  # pylint: disable=import-outside-toplevel
  with Checkpointer(str(tmp_path / "runs" / "x" / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(3, {"params": {"w": jnp.ones((2, 3))}}, force=True)
  monkeypatch.chdir(tmp_path)
  check_readable("runs/x/checkpoints/3")
  assert (2, 3) in [shape for shape, _ in saved_shapes("runs/x/checkpoints/3/state").values()]


def test_a_model_restored_from_a_relative_path(tmp_path, monkeypatch):
  """orbax restores from absolute paths only: a reward model or model.init_from named relatively
  (runs/tiny_rm/reward_model) was refused as damaged when the RL job loaded it."""
  from meshrl.train.init_from import checkpoint_dir, restore_params  # pylint: disable=import-outside-toplevel
  cfg = load("configs/tiny.py")
  mc = ModelConfig.from_config(cfg)
  model = build_model(mc, None, seed=0)
  _, params, extra = nnx.split(model, nnx.Param, ...)
  with Checkpointer(str(tmp_path / "runs" / "m" / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(1, {"params": params, "extra": extra, "step": jnp.zeros((), jnp.int32), "opt_state": {}},
              config=cfg, force=True)
  monkeypatch.chdir(tmp_path)
  restored = restore_params(checkpoint_dir("runs/m"), mc, None)
  a, b = nnx.state(restored, nnx.Param).to_pure_dict(), params.to_pure_dict()
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
