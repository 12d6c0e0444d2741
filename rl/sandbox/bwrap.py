"""The bubblewrap command line of a sandbox, the read-only runtime it shows, and the install check.

Namespaces: user, PID, IPC, UTS, network (a loopback of its own, nothing else), cgroup; no new user
namespaces inside (`--disable-userns`); a new session (no TIOCSTI into the host's terminal);
`PR_SET_NO_NEW_PRIVS` (bwrap's default) makes setuid binaries run without privileges.
File system: the root is an empty tmpfs remounted read-only; the runtime (/usr and the /bin, /lib*
links, ld.so.cache) is bound read-only; /proc is the sandbox's own; /dev holds only null, zero, full,
random, urandom, tty and pts, and is read-only; /work (the working directory), /tmp and /dev/shm are
private tmpfs mounts of `disk_mb` each, gone with the mount namespace when the run ends. Nothing of
the host's home, working tree, environment or processes is visible. The environment is cleared and
set to PATH, HOME=/work, LANG, TMPDIR.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys

WORK = "/work"
WRITABLE = (WORK, "/tmp", "/dev/shm")
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `apt-get update && apt-get install -y "
                "bubblewrap`; Fedora: `dnf install bubblewrap`); it needs user namespaces "
                "(`sysctl kernel.unprivileged_userns_clone=1` / `user.max_user_namespaces>0`).")


class SandboxUnavailable(RuntimeError):
  """bubblewrap is missing or cannot create namespaces here; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Runtime:
  """What the sandbox sees read-only: bind mounts (host path, sandbox path), symlinks (target,
  sandbox path), and the Python interpreter's path inside the sandbox."""
  binds: tuple[tuple[str, str], ...]
  symlinks: tuple[tuple[str, str], ...]
  python: str

  @classmethod
  def host(cls, python_prefix: str | None = None) -> "Runtime":
    """The host's /usr, with Debian's /usr/bin/python3; without it (or given `python_prefix`), the
    interpreter prefix (e.g. a pyenv version) bound at the neutral path /opt/python."""
    binds, symlinks = [("/usr", "/usr")], []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
      path = "/" + name
      if os.path.islink(path):
        symlinks.append((os.readlink(path), path))
      elif os.path.isdir(path):
        binds.append((path, path))
    for path in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
      if os.path.exists(path):
        binds.append((path, path))
    if python_prefix is None and os.path.exists("/usr/bin/python3"):
      return cls(tuple(binds), tuple(symlinks), "/usr/bin/python3")
    prefix = python_prefix or sys.base_prefix
    binds.append((prefix, "/opt/python"))
    return cls(tuple(binds), tuple(symlinks), "/opt/python/bin/python3")


def bwrap_argv(runtime: Runtime, *, disk_mb: int, work: str = WORK,
               extra_writable: tuple[str, ...] = ()) -> list[str]:
  """bwrap's options for one sandbox (the command follows `--`): `work` is the working directory and
  HOME (default /work; a session may use another absolute path, e.g. a Dockerfile's WORKDIR), and
  `extra_writable` more private tmpfs mounts of `disk_mb` each (e.g. /tests)."""
  writable = check_mounts(work, extra_writable)
  argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
          "--new-session", "--as-pid-1", "--uid", "1000", "--gid", "1000",
          "--hostname", "sandbox"]
  for source, dest in runtime.binds:
    argv += ["--ro-bind", source, dest]
  for target, dest in runtime.symlinks:
    argv += ["--symlink", target, dest]
  size = str(int(disk_mb) << 20)
  argv += ["--proc", "/proc", "--dev", "/dev"]
  for path in writable:
    argv += ["--size", size, "--perms", "0755" if path in (work, *extra_writable) else "1777",
             "--tmpfs", path]
  argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", work, "--clearenv"]
  for name, value in base_env(work).items():
    argv += ["--setenv", name, value]
  return argv


def base_env(work: str = WORK) -> dict[str, str]:
  """The environment every sandboxed program starts with."""
  return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8", "TMPDIR": "/tmp",
          "PYTHONDONTWRITEBYTECODE": "1"}


_RESERVED = ("/", "/proc", "/dev", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
             "/etc", "/opt")


def check_mounts(work: str, extra_writable: tuple[str, ...] = ()) -> tuple[str, ...]:
  """The writable mounts (work dir, /tmp, /dev/shm, extras) after checking each is a normalised
  absolute path outside the read-only runtime and that none is given twice; ValueError naming it."""
  writable = (work, "/tmp", "/dev/shm", *extra_writable)
  for path in (work, *extra_writable):
    if not isinstance(path, str) or not path.startswith("/") or os.path.normpath(path) != path \
        or "\0" in path:
      raise ValueError(f"sandbox mount {path!r} must be a normalised absolute path.")
    if any(path == top or path.startswith(top + "/") for top in _RESERVED if top != "/") \
        or path == "/":
      raise ValueError(f"sandbox mount {path!r} lies in the read-only runtime "
                       f"({', '.join(_RESERVED)}); choose another path, e.g. /work or /app.")
  for path in writable:
    for other in writable:
      if path == other and writable.count(path) > 1 or other.startswith(path + "/"):
        raise ValueError(f"sandbox mounts {list(writable)}: {other!r} lies in (or is) {path!r}; "
                         f"give separate folders.")
  return writable


@functools.lru_cache(maxsize=None)
def check_bwrap(runtime: Runtime, *, uid: int | None = None) -> str:
  """The path of a bwrap that runs `runtime`'s Python here (as host `uid` if given); else
  SandboxUnavailable saying why.

  Never falls back to running code without isolation.
  """
  path = shutil.which("bwrap")
  if path is None:
    raise SandboxUnavailable(f"bubblewrap (`bwrap`) is not on PATH: {INSTALL_HINT}")
  argv = [path] + bwrap_argv(runtime, disk_mb=1)[1:] + ["--", runtime.python, "-I", "-S", "-c",
                                                      "pass"]
  try:
    user = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    probe = subprocess.run(argv, capture_output=True, timeout=30, env={}, check=False, **user)
  except (OSError, subprocess.TimeoutExpired) as error:
    raise SandboxUnavailable(f"bwrap at {path} could not run a probe ({error}): {INSTALL_HINT}")
  if probe.returncode != 0:
    reason = probe.stderr.decode(errors="replace").strip() or f"exit {probe.returncode}"
    raise SandboxUnavailable(
        f"bwrap at {path} cannot start a sandbox here: {reason}. Every path the runtime binds "
        f"({', '.join(src for src, _ in runtime.binds)}) must be readable by the sandbox's "
        f"unprivileged uid; if namespaces are the problem: {INSTALL_HINT}")
  return path
