"""The command line every script shares: `--config=PATH[:ARG]`, `--config.a.b=VALUE`, `--cpu_devices=N`.

The syntax is ml_collections' `config_flags` one; parsing it here lets an unknown key or a wrong type
fail before anything is compiled or written, with the key's name and the closest valid one.
This module imports no jax: `--cpu_devices` must be applied before jax is first imported.

  args, cfg = cli.parse(sys.argv[1:], add_flags=lambda p: p.add_argument("--steps", type=int))
  import jax  # only now

  if __name__ == "__main__":
    sys.exit(cli.run(main, sys.argv[1:]))   # errors a user can fix: one line on stderr
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from typing import Callable, Sequence

from meshrl.configs.hugepages import reexec_with_hugepages
from meshrl.configs.loader import ConfigError, load


def simulate_cpu_devices(count: int) -> None:
  """Makes jax (not yet imported) see `count` CPU devices, as a multi-chip host would.

  Also sets what libtpu needs to stay out of the way of CPU runs (and of a second such process).
  """
  if "jax" in sys.modules:
    raise RuntimeError("--cpu_devices must be applied before jax is imported.")
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors are one line, "error: <what> (--help lists the flags)", exit status 2
  (argparse prints the whole usage first, many lines for a script with many flags); --help keeps
  the description's line breaks."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    super().__init__(*args, **kwargs)

  def error(self, message: str):
    self.exit(2, f"error: {message} (--help lists the flags)\n")

  def parse_args(self, args=None, namespace=None):
    """argparse's, and a report file flag (--json, --markdown) that names a folder is refused here,
    not when the report is written at the end of a long run."""
    parsed = super().parse_args(args, namespace)
    for name in OUTPUT_FILE_FLAGS:
      value = getattr(parsed, name, None)
      if isinstance(value, str) and value and os.path.isdir(value):
        self.error(f"--{name}={value!r} is a folder; give the path of the file to write")
    return parsed


OUTPUT_FILE_FLAGS = ("json", "markdown")  # flags that name a report file a script writes


def parse(argv: Sequence[str], add_flags: Callable[[argparse.ArgumentParser], None] | None = None,
          default_config: str = "configs/tiny.py", description: str | None = None):
  """Parses a script's argv into (argparse namespace, locked config).

  On a bad config path, key or value it prints the reason and exits with status 2; nothing is written.
  First the script may re-execute itself with huge pages for its buffers (configs/hugepages.py).
  """
  reexec_with_hugepages()
  parser = ArgumentParser(description=description)
  parser.add_argument("--config", default=default_config,
                      help="preset file, optionally with an argument: configs/tiny.py[:ARG]")
  parser.add_argument("--cpu_devices", type=int, default=0,
                      help="simulate N CPU devices (set before jax is imported); 0 = leave as is")
  parser.add_argument("--coordinator", default="",
                      help="host:port of process 0 when this is one of several processes of a job "
                           "(or MESHRL_COORDINATOR); a Cloud TPU pod slice needs nothing")
  parser.add_argument("--num_processes", type=int, default=0,
                      help="processes in the job (with --coordinator; or MESHRL_NUM_PROCESSES)")
  parser.add_argument("--process_id", type=int, default=-1,
                      help="this process's index, 0..num_processes-1 (or MESHRL_PROCESS_ID)")
  if add_flags is not None:
    add_flags(parser)
  overrides = [a[2:] for a in argv if a.startswith("--config.")]
  rest = [a for a in argv if not a.startswith("--config.")]
  args = parser.parse_args(rest)
  try:
    config = load(args.config, overrides)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  if args.cpu_devices < 0:
    parser.error(f"--cpu_devices={args.cpu_devices} must be >= 0 (0 = the devices there are)")
  if args.cpu_devices:
    simulate_cpu_devices(args.cpu_devices)
  args.overrides = overrides
  return args, config


def join_job(args) -> None:
  """Joins the multi-process job that --coordinator / --num_processes / --process_id (or the
  MESHRL_* environment, or a Cloud TPU pod slice) describe; nothing for a single process. Call it
  right after `parse`, before anything touches a device. A bad description exits with status 2."""
  from meshrl.sharding import hosts  # pylint: disable=import-outside-toplevel  (imports jax)
  try:
    hosts.initialize(args.coordinator, args.num_processes, args.process_id)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # meshrl's top folder


def disk_full(error: BaseException | None) -> bool:
  """Whether `error`, or an exception it was raised from, is a full disk (ENOSPC, or "No space left
  on device" as orbax and tensorstore word it)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


def one_line(error: BaseException) -> str:
  """The message of `error` as the one line a script prints: an OSError's strerror and file, or the
  first line of the message; ' [MESHRL_TRACEBACK=1 shows where]' when it was not raised by meshrl's
  own checks (the last frame is outside this package), where a traceback would help."""
  if isinstance(error, OSError) and error.strerror:
    text = error.strerror + (f": {error.filename}" if error.filename else "")
  else:
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if type(error).__name__ not in ("ValueError", "ConfigError", "CheckpointError", "WorkdirError"):
      text = f"{type(error).__name__}: {text}"
  frames = traceback.extract_tb(error.__traceback__)
  if frames and not os.path.abspath(frames[-1].filename).startswith(PACKAGE_DIR + os.sep):
    text += " [MESHRL_TRACEBACK=1 shows where]"
  return text


def run(main: Callable[[Sequence[str]], int], argv: Sequence[str]) -> int:
  """Runs a script's `main(argv)` and turns what a user can fix into one line on stderr instead of a
  traceback: bad input (ValueError: a config, file, row or checkpoint; exit 2), a full disk or
  another OS error (exit 1), a run stopped by non-finite steps (exit 1), and a second Ctrl-C (the
  first one saves and stops at the end of the step: train/preemption.py; exit 130).
  MESHRL_TRACEBACK=1 lets every exception through with its traceback."""
  try:
    return main(argv)
  except KeyboardInterrupt:
    if os.environ.get("MESHRL_TRACEBACK") == "1":
      raise
    print("interrupted: stopped at once; checkpoints already written are intact (run the same command "
          "to resume from the latest).", file=sys.stderr)
    return 130
  except Exception as error:  # pylint: disable=broad-except
    if os.environ.get("MESHRL_TRACEBACK") == "1":
      raise
    stop = type(error).__name__ == "NonFiniteError"  # train/stops.py (imports jax, so by name)
    if not (isinstance(error, (ValueError, OSError)) or stop or disk_full(error)):
      raise
    prefix = "error: disk full: " if disk_full(error) and "disk" not in str(error) else "error: "
    print(prefix + one_line(error), file=sys.stderr)
    return 2 if isinstance(error, ValueError) and not disk_full(error) else 1


def write_json(path: str, report: dict, *, indent: int = 2, announce: bool = True) -> None:
  """A script's JSON report to `path` (its folder made), and a line saying where it went."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=indent)
  if announce:
    print(f"\nwrote {path}")


def bare_run(cfg) -> None:
  """A benchmark's RL run: no warm start, checkpoints, progress bar or evaluation (in place)."""
  cfg.rl.sft_steps = 0
  cfg.checkpoint.enabled = False
  cfg.log.progress_bar = False
  cfg.eval.every = 0
