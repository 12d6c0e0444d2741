"""Resource limits of one sandboxed run, checked when built.

Every limit is enforced by the kernel or by the in-sandbox supervisor (launcher.py), with the host as
the backstop for the wall clock:

  timeout_s        wall clock; the supervisor kills every process of the run, the host kills the
                   sandbox `HOST_GRACE_S` later if the supervisor did not report.
  cpu_s            RLIMIT_CPU of each process (SIGXCPU, then SIGKILL one second later).
  memory_mb        RLIMIT_AS (address space) of each process.
  max_processes    RLIMIT_NPROC; counted per user namespace, so only the run's own processes count.
  max_file_mb      RLIMIT_FSIZE: the largest file a process may write.
  max_open_files   RLIMIT_NOFILE.
  (always)         RLIMIT_CORE 0 (no core files) and RLIMIT_MSGQUEUE 0: no POSIX message queue can
                   be made, so none outlives an episode of a recycled session (session.py).
  disk_mb          size of each writable tmpfs (/work, /tmp, /dev/shm); writes past it fail ENOSPC.
  max_files        inodes in use across those mounts; the supervisor kills the run past it.
  max_output_bytes stdout and stderr bytes kept per stream; a stream that goes on past
                   `OUTPUT_KILL_FACTOR` times this is killed (killed_reason "output_limit").
"""

from __future__ import annotations

import dataclasses
import math

OUTPUT_KILL_FACTOR = 8
HOST_GRACE_S = 2.0


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-run limits (see the module docstring for how each is enforced)."""
  timeout_s: float = 10.0
  cpu_s: float = 10.0
  memory_mb: int = 512
  max_processes: int = 32
  max_file_mb: int = 16
  max_open_files: int = 64
  disk_mb: int = 64
  max_files: int = 2000
  max_output_bytes: int = 256 * 1024

  def __post_init__(self):
    minimum = {"timeout_s": 0.01, "cpu_s": 0.01, "memory_mb": 16, "max_processes": 1,
               "max_file_mb": 1, "max_open_files": 8, "disk_mb": 1, "max_files": 1,
               "max_output_bytes": 1}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"Limits.{field.name}={value!r} must be a number.")
      if field.type == "int" and not float(value).is_integer():
        raise ValueError(f"Limits.{field.name}={value!r} must be a whole number.")
      if not math.isfinite(value) or value < minimum[field.name]:
        raise ValueError(
            f"Limits.{field.name}={value!r} must be finite and at least {minimum[field.name]}.")

  def rlimits(self) -> list[tuple[str, int, int]]:
    """[(resource name, soft, hard)] the supervisor sets on the program before exec."""
    cpu = math.ceil(self.cpu_s)
    mib = 1 << 20
    # +2: the sandbox's outer bwrap process and the supervisor share the namespace's uid.
    return [("RLIMIT_CPU", cpu, cpu + 1),
            ("RLIMIT_AS", int(self.memory_mb) * mib, int(self.memory_mb) * mib),
            ("RLIMIT_NPROC", int(self.max_processes) + 2, int(self.max_processes) + 2),
            ("RLIMIT_FSIZE", int(self.max_file_mb) * mib, int(self.max_file_mb) * mib),
            ("RLIMIT_NOFILE", int(self.max_open_files), int(self.max_open_files)),
            ("RLIMIT_CORE", 0, 0),
            ("RLIMIT_MSGQUEUE", 0, 0)]
