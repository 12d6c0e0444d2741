"""Checkpoints with orbax: the train state, the data iterator's state, the resolved config and any
extra run state (carried rollouts, a quarantine list).

  ckpt = Checkpointer(f"{workdir}/checkpoints", every=50, max_to_keep=2, async_save=True)
  restored = ckpt.restore(state)          # None on a fresh work directory
  ...
  if ckpt.should_save(step):
    ckpt.save(step, state, data_state=data_iter.get_state(), config=cfg, extra_state={...})
  ckpt.close()                            # waits for the last background write

  params = load_params("runs/tiny/checkpoints")   # the weights alone, onto one CPU device, no mesh

Layout of one checkpoint `checkpoints/<step>/`: `state/` (orbax PyTree, OCDBT), `data/` (JSON: the
data iterator's state), `config/` (JSON: the resolved config) and `extra/` (JSON: `extra_state`;
absent in checkpoints written before it existed).

Bad input is a `CheckpointError` (a ValueError) naming the folder: a step folder without its parts
(a partial copy), arrays whose shapes differ from the run's (another model), files orbax cannot
read. Restoring only reads; nothing saved is changed by a failed restore.

Restore takes a *target*: a state (or its `abstract_state`) built on the current mesh. Every array is
read straight into the target's sharding, so a run saved on `fsdp=8` resumes on `fsdp=2, tensor=4`
(or on another device count) with no gather onto one host.

Crash safety: orbax writes each checkpoint into a temporary `<step>.orbax-checkpoint-tmp-*` folder
and renames it (on GCS: writes a commit marker) only when every file is down. A crash mid-save
leaves the previous checkpoint untouched and the half-written one invisible to `restore`; with
`async_save` the device-to-host copy still happens inside `save`, so the caller may donate or
overwrite the state as soon as `save` returns. `max_to_keep` deletes old checkpoints only after the
new one is committed (a kill during that deletion can leave an older step folder half-deleted, without
its `_CHECKPOINT_METADATA`: never the latest, so never restored, and removed by a later save).
tests/train/test_checkpoint.py kills a process (SIGKILL) during an async save
and scripts/resume_check.py kills whole runs, many times, during saves and between them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.sharding import SingleDeviceSharding

from meshrl.train.state import abstract_state


class Restored(NamedTuple):
  step: int  # the checkpoint's step
  state: Any  # the state, laid out like the target (shardings of the current mesh)
  data_state: dict  # what `save` got as data_state ({} if none)
  config: dict  # the resolved config saved with it ({} if none)
  extra_state: dict  # what `save` got as extra_state ({} if none)


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored here; the message names its folder and what is wrong."""


_ITEMS = ("state", "data", "config")  # the parts every checkpoint has; "extra" is optional


def committed_steps(folder: str) -> list[int]:
  """The committed steps in `folder`: orbax names a step's folder by its number once the step is
  finalized (an unfinished save is a `<step>.orbax-checkpoint-tmp-*` folder, never listed)."""
  if not os.path.isdir(folder):
    return []
  return sorted(int(name) for name in os.listdir(folder) if name.isdigit()
                and os.path.isdir(os.path.join(folder, name)))


def one_line(error: Exception, limit: int = 200) -> str:
  """An exception as one short line: its type and the first line of its message."""
  text = str(error).strip().splitlines()
  first = text[0] if text else ""
  return f"{type(error).__name__}: {first[:limit]}{'...' if len(first) > limit else ''}"


def _root_cause(error: BaseException) -> BaseException:
  """The innermost exception `error` was raised from: orbax wraps TensorStore's error (which names
  the file and what is wrong with it) in one that prints a bound method's repr instead."""
  seen = {id(error)}
  while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
    seen.add(id(inner))
    error = inner
  return error


def _orphaned_read_error(error: BaseException | None) -> bool:
  """An error orbax's other reads raise after one failed: their loop closed, or their own failure."""
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return True
  return error is not None and any(word in str(error) for word in ("tensorstore_spec", "TensorStore", "OCDBT"))


class _OrphanedReadReports(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" for orbax's failed reads (`unreadable`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (record.getMessage().startswith("Task exception was never retrieved") and _orphaned_read_error(error))


_ORPHANED_READ_REPORTS = _OrphanedReadReports()


def _quiet_orphaned_reads() -> None:
  """Orbax reads a checkpoint's arrays as concurrent TensorStore reads on an event loop of its own.
  When one read fails, orbax closes that loop while TensorStore finishes the others; each of those
  then reports "RuntimeError: Event loop is closed" on stderr (about 60 tracebacks for a small
  model), each failed read "Task exception was never retrieved" or "Exception ignored in: <coroutine
  ...>" with its TensorStore spec (80 lines each), after the one-line error. They say nothing that
  line does not, so from the first failed read on, this process drops them (every other unraisable
  exception and log record still goes where it went)."""
  asyncio_log = logging.getLogger("asyncio")
  if _ORPHANED_READ_REPORTS not in asyncio_log.filters:
    asyncio_log.addFilter(_ORPHANED_READ_REPORTS)
  previous = sys.unraisablehook
  if getattr(previous, "drops_orphaned_reads", False):
    return

  def hook(unraisable):
    if not _orphaned_read_error(unraisable.exc_value):
      previous(unraisable)
  hook.drops_orphaned_reads = True
  sys.unraisablehook = hook


def _within(step_dir: str, text: str) -> str:
  """TensorStore's message with the step folder's path (which the error names already) cut off the
  paths of the files in it: 'local file "state/manifest.ocdbt"'."""
  return text.replace(os.path.abspath(step_dir) + os.sep, "")


def unreadable(step_dir: str, error: Exception) -> CheckpointError:
  """The one-line error for a checkpoint whose arrays orbax failed to read (`damaged`), naming the
  innermost cause; orbax's reports of its other reads are dropped (`_quiet_orphaned_reads`)."""
  _quiet_orphaned_reads()
  return damaged(step_dir, f"its arrays cannot be read: {_within(step_dir, one_line(_root_cause(error), 300))}")


def _check_index(state_dir: str) -> None:
  """Reads the OCDBT manifest of `state_dir` and the root of its key index (not its arrays) in one
  synchronous TensorStore call: a damaged index raises here, once, before orbax's concurrent reads
  would each fail on it (`_quiet_orphaned_reads`). A state/ folder without a manifest (not OCDBT) is
  left to orbax."""
  local = "://" not in state_dir
  if local and not os.path.exists(os.path.join(state_dir, "manifest.ocdbt")):
    return
  base = "file://" + os.path.abspath(state_dir) if local else state_dir
  try:
    store = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    store.list(ts.KvStore.KeyRange(inclusive_min=b"", exclusive_max=b"\x01")).result()  # manifest, index root
  except Exception as e:  # pylint: disable=broad-except  (TensorStore raises ValueError and others)
    step_dir = os.path.dirname(os.path.normpath(state_dir)) if local else state_dir
    raise CheckpointError(f"its OCDBT index cannot be read: {_within(step_dir, one_line(e, 300))}") from None


def _previous_intact(step_dir: str) -> int | None:
  """The newest step before `step_dir`'s in its folder whose parts are all there and whose array
  metadata reads (cheap: no array is read), or None."""
  folder, name = os.path.split(os.path.normpath(step_dir))
  if not name.isdigit():
    return None
  for step in reversed([s for s in committed_steps(folder) if s < int(name)]):
    try:
      _check_parts(os.path.join(folder, str(step)))
      _read_shapes(os.path.join(folder, str(step), "state"))
    except CheckpointError:
      continue
    return step
  return None


def damaged(step_dir: str, reason: str) -> CheckpointError:
  """The one-line error for a checkpoint that cannot be read: what is wrong, the intact step before
  it (if any) and what to do; nothing on disk is changed."""
  previous = _previous_intact(step_dir)
  if previous is not None:
    todo = (f"step {previous} before it is intact: move {step_dir} aside (e.g. to {step_dir}.damaged) "
            f"to resume from step {previous}")
  else:
    todo = "no earlier step of its folder is intact: start afresh in another work directory"
  return CheckpointError(f"checkpoint {step_dir} is damaged ({reason}); {todo}. Nothing was changed.")


def _check_parts(step_dir: str) -> None:
  if not os.path.isdir(step_dir):
    raise CheckpointError(f"checkpoint {step_dir} does not exist.")
  missing = [name for name in _ITEMS if not os.path.isdir(os.path.join(step_dir, name))]
  if missing:
    raise CheckpointError(f"it has no {', '.join(m + '/' for m in missing)} (a partial copy?)")


def check_complete(step_dir: str) -> None:
  """CheckpointError unless `step_dir` holds every part of a checkpoint (state/, data/, config/)."""
  try:
    _check_parts(step_dir)
  except CheckpointError as error:
    if not os.path.isdir(step_dir):
      raise
    raise damaged(step_dir, str(error)) from None


def check_readable(step_dir: str) -> None:
  """CheckpointError (naming the intact step before it) unless `step_dir` is complete and its array
  metadata and JSON parts read; reads no array. Call it before a run that resumes writes anything."""
  check_complete(step_dir)
  saved_shapes(os.path.join(step_dir, "state"))
  for item in ("data", "config", "extra"):
    try:
      _read_json(os.path.join(step_dir, item))
    except (OSError, ValueError) as error:
      raise damaged(step_dir, f"{item}/metadata: {one_line(error)}") from None


@contextlib.contextmanager
def _quiet_absl():
  """Orbax logs a warning per missing optional metadata file while it reads; the caller reports."""
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _read_shapes(state_dir: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  if "://" not in state_dir:  # orbax reads no item metadata under a relative path (runs/x/checkpoints/3/state)
    state_dir = os.path.abspath(state_dir)
  _check_index(state_dir)
  try:
    with _quiet_absl():
      meta = ocp.PyTreeCheckpointer().metadata(state_dir)
  except Exception as e:  # pylint: disable=broad-except  (orbax raises many kinds)
    raise CheckpointError(f"its array metadata cannot be read: {one_line(e)}") from None
  tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
  if tree is None:
    raise CheckpointError("it has no array metadata (an emptied or partial state/ folder?)")
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
  return {"/".join(_key_name(k) for k in path): (tuple(leaf.shape), np.dtype(leaf.dtype))
          for path, leaf in leaves}


def saved_shapes(state_dir: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{"params/embed/embedding": (shape, dtype), ...} of the arrays saved in `state_dir` (metadata
  only, no array is read); CheckpointError naming the intact step before it when it cannot be read."""
  try:
    return _read_shapes(state_dir)
  except CheckpointError as error:
    raise damaged(os.path.dirname(os.path.normpath(state_dir)), str(error)) from None


def _shape_errors(saved: dict, wanted: dict) -> list[str]:
  """Readable differences between two {path: (shape, dtype)} maps (`wanted`: this run's)."""
  order = sorted(wanted, key=lambda path: (not path.startswith("params/"), path))  # weights first
  errors = [f"{path}: saved {saved[path][0]}, this run {wanted[path][0]}"
            for path in order if path in saved and saved[path][0] != wanted[path][0]]
  errors += [f"{path}: not in the checkpoint" for path in sorted(set(wanted) - set(saved))]
  errors += [f"{path}: in the checkpoint, not in this run" for path in sorted(set(saved) - set(wanted))]
  return errors


def _shapes_of(nested: dict) -> dict:
  return {"/".join(_key_name(k) for k in path): (tuple(leaf.shape), np.dtype(leaf.dtype))
          for path, leaf in jax.tree_util.tree_leaves_with_path(nested)}


def _architecture_diff(saved: dict, config: dict) -> list[str]:
  """model.* / moe.* fields whose saved value differs from `config`'s (for error messages)."""
  diffs = []
  for section in ("model", "moe"):
    mine, theirs = config.get(section) or {}, saved.get(section) or {}
    diffs += [f"{section}.{k}={mine[k]!r} (checkpoint: {theirs[k]!r})" for k in sorted(mine)
              if k in theirs and theirs[k] != mine[k]]
  return diffs


def check_saved_config(step_dir: str, config: Any) -> None:
  """CheckpointError when the config saved in `step_dir` is of another model than `config` (a
  model.* / moe.* field that gives the parameters another meaning differs). Reads one small file."""
  saved = _read_json(os.path.join(step_dir, "config"))
  # The fields a checkpoint may differ in (how the model computes, not what its parameters mean),
  # as for model.init_from; train/init_from.py imports this module, hence the late import.
  from meshrl.train.init_from import _RUN_FIELDS  # pylint: disable=import-outside-toplevel
  diffs = [d for d in _architecture_diff(saved, _config_dict(config)) if d.split("=")[0] not in _RUN_FIELDS]
  if diffs:
    raise CheckpointError(f"checkpoint {step_dir} was saved by a run of another model: {', '.join(diffs)}. "
                          "Give this run another work directory (--workdir), or pass --overwrite to "
                          "replace the run there; nothing was changed.")


def _read_json(path: str) -> dict:
  """A JSON item saved by orbax's JsonSave (`<item>/metadata`), {} when absent."""
  file = os.path.join(path, "metadata")
  if not os.path.isfile(file):
    return {}
  with open(file, encoding="utf-8") as f:
    return json.load(f)


def _json_ready(value: Any) -> Any:
  """numpy / jax scalars and arrays -> Python numbers and lists, recursively (JSON items)."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    value = np.asarray(jax.device_get(value))
    return value.item() if value.ndim == 0 else value.tolist()
  if isinstance(value, dict):
    return {str(k): _json_ready(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_ready(v) for v in value]
  return value


def array_to_json(value) -> dict:
  """One array as a JSON value that keeps its dtype and shape (for `extra_state`, whose JSON item
  would otherwise turn arrays into dtype-less nested lists); `array_from_json` inverts it."""
  value = np.asarray(jax.device_get(value))
  return {"dtype": str(value.dtype), "shape": list(value.shape), "data": value.reshape(-1).tolist()}


def array_from_json(value: dict) -> np.ndarray:
  """The numpy array `array_to_json` wrote."""
  return np.asarray(value["data"], value["dtype"]).reshape(value["shape"])


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
                                          item_names=_ITEMS + ("extra",))

  def latest_step(self) -> int | None:
    """The newest committed step, or None."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    """True when `step` is a multiple of `every` and not saved yet."""
    return self._manager.should_save(step)

  def save(self, step: int, state: Any, *, data_state: dict | None = None, config: Any = None,
           extra_state: dict | None = None, force: bool = False) -> bool:
    """Saves `state` (any pytree of jax arrays), the data iterator state, the config and extra state.

    Args:
      step: the step number naming the checkpoint.
      state: e.g. a TrainState; arrays may be sharded over any mesh.
      data_state: JSON-serialisable iterator state (grain `get_state()`), restored as is.
      config: the resolved ConfigDict (or a dict), stored as JSON.
      extra_state: anything else a step depends on (carried rollouts, a quarantine list): a dict of
        JSON values; numpy / jax arrays in it are stored as (nested) lists.
      force: save even when `step` is not a multiple of `every`.

    Returns:
      Whether a save was started (async: it may still be writing; `wait()` to be sure).
    """
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(to_nested_dict(state)),
        data=ocp.args.JsonSave(_json_ready(dict(data_state or {}))),
        config=ocp.args.JsonSave(_config_dict(config)),
        extra=ocp.args.JsonSave(_json_ready(dict(extra_state or {}))))
    return self._manager.save(step, args=args, force=force)

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def check_config(self, config: Any, *, step: int | None = None) -> None:
    """CheckpointError when checkpoint `step` (default: the latest) was saved by a run of another
    model (a model.* / moe.* field that gives the parameters another meaning differs), or is
    incomplete.
    Reads two small JSON files; call it before the run writes anything."""
    step = self.latest_step() if step is None else step
    if step is None:
      return
    check_complete(self.step_dir(step))
    check_saved_config(self.step_dir(step), config)

  def restore(self, target: Any, *, step: int | None = None) -> Restored | None:
    """Reads a checkpoint into the layout and shardings of `target`.

    Args:
      target: a state of the saved structure, concrete or abstract (`jax.ShapeDtypeStruct`s with
        `sharding=`), laid out on the current mesh. Its shardings decide where arrays land.
      step: the step to read; None = the latest.

    Returns:
      `Restored(step, state, data_state, config, extra_state)`, or None when there is no checkpoint.

    Raises:
      CheckpointError naming the step folder: parts missing, array shapes that differ from the
      target's (with the saved config's differing model fields), or files orbax cannot read.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    step_dir = self.step_dir(step)
    check_complete(step_dir)
    abstract = to_nested_dict(abstract_state(target))
    errors = _shape_errors(saved_shapes(os.path.join(step_dir, "state")), _shapes_of(abstract))
    if errors:
      more = f" ... ({len(errors) - 4} more)" if len(errors) > 4 else ""
      raise CheckpointError(f"checkpoint {step_dir} does not fit this run's state (another model?): "
                            f"{'; '.join(errors[:4])}{more}.")
    has_extra = os.path.isdir(os.path.join(step_dir, "extra"))
    items = dict(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore(),
                 config=ocp.args.JsonRestore())
    if has_extra:
      items["extra"] = ocp.args.JsonRestore()
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-except  (orbax/tensorstore raise many kinds)
      raise unreadable(step_dir, e) from e
    return Restored(step=step, state=from_nested_dict(out["state"], target),
                    data_state=dict(out["data"] or {}), config=dict(out["config"] or {}),
                    extra_state=dict((out["extra"] if has_extra else None) or {}))

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


def find_step_dir(path: str, step: int | None = None) -> str:
  """The step folder `path` names: a step folder itself (holding state/), or a folder of steps
  (`checkpoints/`) or a work directory holding one, at `step` (default: its latest)."""
  if os.path.isdir(os.path.join(path, "state")) and step is None:
    return path
  for folder in (path, os.path.join(path, "checkpoints")):
    steps = committed_steps(folder)
    if steps:
      if step is not None and step not in steps:
        raise CheckpointError(f"{folder} has no checkpoint of step {step} (it has {steps}).")
      return os.path.join(folder, str(steps[-1] if step is None else step))
  raise CheckpointError(f"{path} holds no checkpoint (neither <step>/state nor checkpoints/<step>/).")


def load_params(path: str, *, step: int | None = None, device: jax.Device | None = None,
                parts: tuple[str, ...] | None = ("params",)) -> dict:
  """The saved arrays of `parts` of a TrainState checkpoint, on one device, without the training
  mesh (no model code or config needed): for inspection, export or a single-device evaluation.

  Args:
    path: a step folder, a `checkpoints/` folder or a work directory (`find_step_dir`).
    step: which step of a folder of steps (default: the latest).
    device: where the arrays land (default: the first CPU device).
    parts: top-level parts of the saved TrainState to read: "params", "extra" (router biases, when
      the model has any), "opt_state", "step"; None = all. Only these are read from disk.

  Returns:
    {part: nested dict of jax.Arrays}, keyed like `to_nested_dict` of the saved state (e.g.
    out["params"]["embed"]["embedding"]: [V, D]); every array on `device`, fully addressable.
  """
  step_dir = find_step_dir(path, step)
  check_complete(step_dir)
  state_dir = os.path.join(step_dir, "state")
  device = device or jax.local_devices(backend="cpu")[0]
  sharding = SingleDeviceSharding(device)
  shapes = saved_shapes(state_dir)
  parts = tuple(sorted({k.split("/")[0] for k in shapes})) if parts is None else tuple(parts)
  unknown = [p for p in parts if not any(k == p or k.startswith(p + "/") for k in shapes)]
  if unknown:
    raise CheckpointError(f"checkpoint {step_dir} has no {unknown} (it has "
                          f"{sorted({k.split('/')[0] for k in shapes})}).")
  target: dict = {}
  for key, (shape, dtype) in shapes.items():
    names = key.split("/")
    if names[0] not in parts:
      continue
    node = target
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  try:
    return ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except
    raise unreadable(step_dir, e) from e
