"""A run's work directory: whether it holds another run, clearing it on --overwrite, and room on disk.

  leftovers = check_workdir(workdir, cfg, resuming=False, overwrite=args.overwrite)  # before writing
  check_free_space(workdir, checkpoint_bytes, field="--workdir")
  clear_outputs(workdir, leftovers)                                                   # then write

A folder holds a run when it has any of RUN_OUTPUTS. A run may write into it only when it resumes
that run (checkpoint.restore and a checkpoint there), when it is the same config starting again (a run
stopped before its first checkpoint), or when asked to replace it (`--overwrite`, which removes
RUN_OUTPUTS and nothing else). Everything here reads, except `clear_outputs`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

from meshrl.configs.cli import disk_full  # noqa: F401 (part of this module's API)

# What a run (scripts/rl.py, scripts/sft.py) writes into its work directory.
RUN_OUTPUTS = ("config.json", "metrics.jsonl", "eval.jsonl", "checkpoints", "sft", "tb", "reward_curve.png", "profile",
               "loss_curve.png")


class WorkdirError(ValueError):
  """A work directory a run must not write into as asked; the message says what to do."""


def run_outputs(workdir: str) -> list[str]:
  """The RUN_OUTPUTS present in `workdir` (folders only when not empty)."""
  if not os.path.isdir(workdir):
    return []
  found = []
  for name in RUN_OUTPUTS:
    path = os.path.join(workdir, name)
    if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path)):
      found.append(name)
  return found


def _saved_config(workdir: str) -> dict | None:
  path = os.path.join(workdir, "config.json")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def check_workdir(workdir: str, config, *, resuming: bool, overwrite: bool) -> list[str]:
  """The outputs of an earlier run to remove before this one writes (`--overwrite`), or [].

  Args:
    workdir: the run's work directory (may not exist yet).
    config: the run's resolved config (ConfigDict or dict); equal to the saved config.json means
      the same run starting again.
    resuming: this run resumes the one in `workdir` from its checkpoint.
    overwrite: the user asked to replace a run found there.

  Raises:
    WorkdirError when `workdir` holds another run and neither `resuming` nor `overwrite` says to
    write there; nothing is changed.
  """
  if "://" in workdir:  # object storage: checkpoints carry their own config check
    return []
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir={workdir!r} is a file, not a folder.")
  found = run_outputs(workdir)
  if not found or resuming:
    return []
  if overwrite:
    return found
  mine = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  if _saved_config(workdir) == json.loads(json.dumps(mine)):
    return []  # the same run again, stopped before its first checkpoint: its records are redone
  why = ("checkpoint.restore=false" if getattr(getattr(config, "checkpoint", None), "restore", True)
         is False else "no checkpoint there to resume from and another config.json")
  raise WorkdirError(f"--workdir={workdir!r} holds another run ({', '.join(found)}; {why}): pass "
                     "--overwrite to replace it, or choose another --workdir; nothing was changed.")


def clear_outputs(workdir: str, names: list[str]) -> None:
  """Removes `names` (a subset of RUN_OUTPUTS, from `check_workdir`) from `workdir`; nothing else."""
  for name in names:
    if name not in RUN_OUTPUTS:
      raise ValueError(f"{name!r} is not a run output; refusing to remove it.")
    path = os.path.join(workdir, name)
    if os.path.isdir(path):
      shutil.rmtree(path)
    elif os.path.exists(path):
      os.remove(path)


def _existing_parent(path: str) -> str:
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return path


def _mib(num_bytes: float) -> str:
  return f"{num_bytes / 2 ** 20:,.0f} MiB" if num_bytes < 2 ** 30 else f"{num_bytes / 2 ** 30:,.1f} GiB"


def check_free_space(workdir: str, needed_bytes: int, *, what: str = "a checkpoint of this run") -> None:
  """OSError(ENOSPC) in one line when the disk holding `workdir` has less free space than
  `needed_bytes` (object storage is not checked)."""
  if "://" in workdir or needed_bytes <= 0:
    return
  free = shutil.disk_usage(_existing_parent(workdir)).free
  if free < needed_bytes:
    raise OSError(errno.ENOSPC, f"{workdir} has {_mib(free)} free on its disk; {what} needs about "
                  f"{_mib(needed_bytes)}: free {_mib(needed_bytes - free)} or more, or choose another "
                  "--workdir; nothing was written")


def disk_full_message(workdir: str, needed_bytes: int, last_step: int | None) -> str:
  """One line for a run stopped by a full disk: the free space now, what a checkpoint needs, and
  the last complete checkpoint to resume from."""
  free = shutil.disk_usage(_existing_parent(workdir)).free if "://" not in workdir else 0
  resume = (f"the last complete checkpoint is step {last_step}; run the same command to resume from it"
            if last_step is not None else "no checkpoint was completed")
  return (f"the disk of {workdir} is full ({_mib(free)} free; a checkpoint of this run needs about "
          f"{_mib(needed_bytes)}): free space, then {resume}.")
