"""What one sandboxed run did: `SandboxResult`."""

from __future__ import annotations

import dataclasses

# killed_reason values (None: the program ended on its own). A crash by a signal reads
# "signal SIGSEGV"; a sandbox that could not run reads "sandbox_error: ...".
TIMEOUT = "timeout"
CPU_LIMIT = "cpu_limit"
FILE_SIZE_LIMIT = "file_size_limit"
FILE_COUNT_LIMIT = "file_count_limit"
OUTPUT_LIMIT = "output_limit"
SETUP_ERROR = "setup_error"
SANDBOX_ERROR = "sandbox_error"


class EnvFailure(RuntimeError):
  """Raised where the environment, not the policy, failed (a sandbox that broke): retried by the
  environment scheduler (rl/envs/scheduler.py) and by RewardPool (rl/rewards/pool.py), never
  scored as a wrong answer."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Outcome of `Sandbox.run`.

  exit_code is None when the program did not exit by itself (killed, or never started); then
  `killed_reason` says why. stdout/stderr are the first `Limits.max_output_bytes` raw bytes of each
  stream (any bytes, UTF-8 or not); `stdout_text`/`stderr_text` decode them safely. Times are
  seconds: `startup_s` from the call (in a pool: from a worker taking the run) to the supervisor
  starting the program, `wall_s` the whole run as the host saw it from the same moment, `cpu_s`
  user + system time of every process of the run.
  peak_memory_mb is the largest resident set of any process of the run (Linux carries the forking
  supervisor's ~10 MB into it, so that is its floor); cpu_s and peak_memory_mb are None when the
  host had to kill the sandbox itself.
  """
  exit_code: int | None
  stdout: bytes
  stderr: bytes
  stdout_truncated: bool
  stderr_truncated: bool
  timed_out: bool
  killed_reason: str | None
  wall_s: float
  cpu_s: float | None
  peak_memory_mb: float | None
  startup_s: float | None
  signal: str | None = None

  @property
  def ok(self) -> bool:
    """The program exited by itself with status 0."""
    return self.exit_code == 0 and self.killed_reason is None

  @property
  def stdout_text(self) -> str:
    return self.stdout.decode("utf-8", errors="backslashreplace")

  @property
  def stderr_text(self) -> str:
    return self.stderr.decode("utf-8", errors="backslashreplace")

  def summary(self) -> str:
    """One line for logs: exit code or reason, times, memory."""
    outcome = self.killed_reason or f"exit {self.exit_code}"
    return (f"{outcome} wall={self.wall_s:.3f}s cpu={self.cpu_s} peak_mb={self.peak_memory_mb} "
            f"stdout={len(self.stdout)}B{'+' if self.stdout_truncated else ''} "
            f"stderr={len(self.stderr)}B{'+' if self.stderr_truncated else ''}")


def failed(reason: str, *, wall_s: float = 0.0, stderr: bytes = b"") -> SandboxResult:
  """A result for a run that never got going (`reason` is "sandbox_error: ..." or similar)."""
  return SandboxResult(exit_code=None, stdout=b"", stderr=stderr, stdout_truncated=False,
                       stderr_truncated=False, timed_out=False, killed_reason=reason,
                       wall_s=wall_s, cpu_s=None, peak_memory_mb=None, startup_s=None)
