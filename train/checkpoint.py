"""Checkpoints with orbax: the train state, the data iterator's state and the resolved config.

  ckpt = Checkpointer(f"{workdir}/checkpoints", every=50, max_to_keep=2, async_save=True)
  restored = ckpt.restore(state)          # None on a fresh work directory
  ...
  if ckpt.should_save(step):
    ckpt.save(step, state, data_state=data_iter.get_state(), config=cfg)
  ckpt.close()                            # waits for the last background write

Layout of one checkpoint `checkpoints/<step>/`: `state/` (orbax PyTree, OCDBT), `data/` (JSON: the
data iterator's state) and `config/` (JSON: the resolved config).

Restore takes a *target*: a state (or its `abstract_state`) built on the current mesh. Every array is
read straight into the target's sharding, so a run saved on `fsdp=8` resumes on `fsdp=2, tensor=4`
(or on another device count) with no gather onto one host.

Crash safety: orbax writes each checkpoint into a temporary `<step>.orbax-checkpoint-tmp-*` folder
and renames it (on GCS: writes a commit marker) only when every file is down. A crash mid-save
leaves the previous checkpoint untouched and the half-written one invisible to `restore`; with
`async_save` the device-to-host copy still happens inside `save`, so the caller may donate or
overwrite the state as soon as `save` returns. `max_to_keep` deletes old checkpoints only after the
new one is committed.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from meshrl.train.state import abstract_state


class Restored(NamedTuple):
  step: int  # the checkpoint's step
  state: Any  # the state, laid out like the target (shardings of the current mesh)
  data_state: dict  # what `save` got as data_state ({} if none)
  config: dict  # the resolved config saved with it ({} if none)


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def to_nested_dict(tree: Any) -> dict:
  """Any pytree (TrainState, nnx.State, optax states) as nested dicts keyed by its key paths.

  Orbax stores plain dicts portably; custom pytree nodes need not be registered with it.
  """
  nested: dict = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    node = nested
    names = [_key_name(k) for k in path]
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = leaf
  return nested


def from_nested_dict(nested: dict, like: Any) -> Any:
  """Inverse of `to_nested_dict`: the leaves of `nested` put into the structure of `like`."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(like)
  leaves = []
  for path, _ in paths:
    node = nested
    for key in path:
      node = node[_key_name(key)]
    leaves.append(node)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _config_dict(config: Any) -> dict:
  if config is None:
    return {}
  return config.to_dict() if hasattr(config, "to_dict") else dict(config)


class Checkpointer:
  """An orbax CheckpointManager over one folder, for one kind of train state.

  Args:
    directory: where the step folders go (created if missing); local path or gs://.
    every: checkpoint.every, steps between saves (`should_save`).
    max_to_keep: checkpoint.max_to_keep; older checkpoints are deleted after a new one commits.
    async_save: checkpoint.async_save; write files in a background thread.
  """

  def __init__(self, directory: str, *, every: int = 1, max_to_keep: int | None = 2,
               async_save: bool = True):
    if every < 1:
      raise ValueError(f"checkpoint.every={every} must be at least 1.")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"checkpoint.max_to_keep={max_to_keep} must be at least 1.")
    self.directory = os.path.abspath(directory) if "://" not in directory else directory
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=every, max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "data", "config"))

  def latest_step(self) -> int | None:
    """The newest committed step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    """True when `step` is a multiple of `every` and not saved yet."""
    return self._manager.should_save(step)

  def save(self, step: int, state: Any, *, data_state: dict | None = None, config: Any = None,
           force: bool = False) -> bool:
    """Saves `state` (any pytree of jax arrays), the data iterator state and the config.

    Args:
      step: the step number naming the checkpoint.
      state: e.g. a TrainState; arrays may be sharded over any mesh.
      data_state: JSON-serialisable iterator state (grain `get_state()`), restored as is.
      config: the resolved ConfigDict (or a dict), stored as JSON.
      force: save even when `step` is not a multiple of `every`.

    Returns:
      Whether a save was started (async: it may still be writing; `wait()` to be sure).
    """
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(to_nested_dict(state)),
        data=ocp.args.JsonSave(dict(data_state or {})),
        config=ocp.args.JsonSave(_config_dict(config)))
    return self._manager.save(step, args=args, force=force)

  def restore(self, target: Any, *, step: int | None = None) -> Restored | None:
    """Reads a checkpoint into the layout and shardings of `target`.

    Args:
      target: a state of the saved structure, concrete or abstract (`jax.ShapeDtypeStruct`s with
        `sharding=`), laid out on the current mesh. Its shardings decide where arrays land.
      step: the step to read; None = the latest.

    Returns:
      `Restored(step, state, data_state, config)`, or None when there is no checkpoint.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    abstract = to_nested_dict(abstract_state(target))
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(),
                              config=ocp.args.JsonRestore())
    out = self._manager.restore(step, args=args)
    return Restored(step=step, state=from_nested_dict(out["state"], target),
                    data_state=dict(out["data"] or {}), config=dict(out["config"] or {}))

  def wait(self) -> None:
    """Blocks until background writes are committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending writes and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
