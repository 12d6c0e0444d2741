"""The command line every script shares: `--config=PATH[:ARG]`, `--config.a.b=VALUE`, `--cpu_devices=N`.

The syntax is ml_collections' `config_flags` one; parsing it here lets an unknown key or a wrong type
fail before anything is compiled or written, with the key's name and the closest valid one.
This module imports no jax: `--cpu_devices` must be applied before jax is first imported.

  args, cfg = cli.parse(sys.argv[1:], add_flags=lambda p: p.add_argument("--steps", type=int))
  import jax  # only now
"""

from __future__ import annotations

import argparse
import os
import sys
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


def parse(argv: Sequence[str], add_flags: Callable[[argparse.ArgumentParser], None] | None = None,
          default_config: str = "configs/tiny.py", description: str | None = None):
  """Parses a script's argv into (argparse namespace, locked config).

  On a bad config path, key or value it prints the reason and exits with status 2; nothing is written.
  First the script may re-execute itself with huge pages for its buffers (configs/hugepages.py).
  """
  reexec_with_hugepages()
  parser = argparse.ArgumentParser(description=description)
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
