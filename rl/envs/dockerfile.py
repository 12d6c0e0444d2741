"""The common subset of a Terminal-Bench task's Dockerfile, translated into a sandbox environment: a
reproducible runtime (rl/sandbox/runtimes.py), a work directory, environment variables and the files
the image copies in.

  env = parse_dockerfile(text, task_dir)   # TaskError "Dockerfile:LINE: ... why" outside the subset

Supported (everything else is refused, naming the line and why):
  FROM     debian:<bookworm|12|trixie|13>[-slim], python:<3.11|3.13>[-slim][-bookworm|-trixie]
           (the Python image's version must be the python3 of a Debian suite: 3.11 bookworm, 3.13
           trixie), ubuntu:<22.04|24.04> (built from Debian's packages: bookworm, trixie; the Ubuntu
           archive is not a source here). One FROM, first; no stages.
  RUN      `&&` / `;` chains of: apt-get / apt update, install [-y, -q, --no-install-recommends]
           PACKAGES (Debian packages of the runtime), apt-get clean / rm -rf /var/lib/apt/lists/*
           (nothing to do), pip / pip3 / python[3] -m pip / uv pip install [--no-cache-dir, -q,
           --system, --break-system-packages] REQUIREMENTS (pip packages of the runtime), and
           mkdir -p DIRS inside the WORKDIR (folders of the work directory); a leading
           DEBIAN_FRONTEND=... assignment is allowed. Nothing else runs: the runtime is built from
           packages, never by running the task's commands.
  COPY     [--chown=...] SRC... DEST: files or folders of the task directory into the WORKDIR (DEST
           relative to it, or absolute inside it); no --from, no wildcards.
  WORKDIR  the sandbox's work directory (writable, and HOME); relative paths join the previous one.
  ENV      KEY=VALUE... or KEY VALUE; $VAR and ${VAR} expand from earlier ENV and the sandbox's base
           environment.
Comments, blank lines and backslash continuations as Docker reads them.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import shlex
import stat

from meshrl.rl.sandbox.bwrap import base_env, check_mounts
from meshrl.rl.sandbox.runtimes import DEBIAN_NAME, PIP_REQUIREMENT, RuntimeSpec

MAX_COPY_BYTES = 16 << 20
_DEBIAN = {"bookworm": "bookworm", "12": "bookworm", "trixie": "trixie", "13": "trixie"}
_PYTHON = {"3.11": "bookworm", "3.13": "trixie"}
_UBUNTU = {"22.04": "bookworm", "24.04": "trixie"}
_APT_FLAGS = {"-y", "--yes", "-q", "-qq", "--quiet", "--no-install-recommends", "--assume-yes"}
_PIP_FLAGS = {"--no-cache-dir", "-q", "--quiet", "--system", "--break-system-packages",
              "--disable-pip-version-check", "--no-input", "--root-user-action=ignore"}
_SEPARATORS = ("&&", ";")


class DockerfileError(ValueError):
  """A Dockerfile line outside the supported subset; the message names the line and why."""


@dataclasses.dataclass(frozen=True)
class DockerEnvironment:
  """What a Dockerfile declares, for a sandbox session."""
  base: str  # "python:3.11-slim -> debian bookworm"
  runtime: RuntimeSpec
  workdir: str
  env: tuple  # ((name, value), ...) in declaration order
  setup: tuple  # ((path relative to workdir, "d"/"f", mode, bytes), ...)


def _logical_lines(text: str) -> list[tuple[int, str]]:
  """(first line number, text) of each instruction: comments and blank lines dropped, backslash
  continuations joined (comment lines inside a continuation skipped, as Docker does)."""
  lines, current, start = [], "", 0
  for number, raw in enumerate(text.splitlines(), start=1):
    stripped = raw.strip()
    if not current and (not stripped or stripped.startswith("#")):
      continue
    if current and stripped.startswith("#"):
      continue
    if not current:
      start = number
    if raw.rstrip().endswith("\\"):
      current += raw.rstrip()[:-1] + " "
      continue
    lines.append((start, current + raw))
    current = ""
  if current:
    lines.append((start, current))
  return lines


def _base(image: str, fail) -> tuple[str, tuple[str, ...]]:
  """(Debian suite, packages the image implies) of a FROM image."""
  name, _, tag = image.partition(":")
  name = name.split("/")[-1] if name.startswith(("docker.io/", "library/")) else name
  if not tag or tag == "latest":
    fail(f"FROM {image}: pin a release tag (e.g. debian:bookworm-slim, python:3.11-slim); "
         f"'latest' moves.")
  if name == "debian":
    suite = _DEBIAN.get(tag.removesuffix("-slim"))
    if suite is None:
      fail(f"FROM {image}: Debian tags supported are {sorted(_DEBIAN)} (with or without -slim).")
    return suite, ()
  if name == "python":
    version = re.match(r"^(\d+\.\d+)(?:\.\d+)?(?:-slim)?(?:-(bookworm|trixie))?$", tag)
    if version is None or version.group(1) not in _PYTHON:
      fail(f"FROM {image}: the Python version must be the python3 of a Debian suite here "
           f"({', '.join(f'{v}: {s}' for v, s in _PYTHON.items())}).")
    suite = _PYTHON[version.group(1)]
    if version.group(2) and version.group(2) != suite:
      fail(f"FROM {image}: Python {version.group(1)} is Debian {suite}'s, not {version.group(2)}'s.")
    return suite, ("python3", "python3-pip", "python3-venv")
  if name == "ubuntu":
    suite = _UBUNTU.get(tag)
    if suite is None:
      fail(f"FROM {image}: Ubuntu tags supported are {sorted(_UBUNTU)}.")
    return suite, ()
  fail(f"FROM {image}: the base must be debian:<release>, python:<version> or ubuntu:<release> "
       f"(runtimes are built from Debian's packages).")
  return "", ()


def _split_chain(tokens: list[str]) -> list[list[str]]:
  commands, current = [], []
  for token in tokens:
    if token in _SEPARATORS:
      if current:
        commands.append(current)
      current = []
    else:
      current.append(token)
  if current:
    commands.append(current)
  return commands


def _inside(path: str, workdir: str) -> str | None:
  """`path` (absolute, or relative to workdir) relative to workdir, or None outside it."""
  full = posixpath.normpath(path if path.startswith("/") else posixpath.join(workdir, path))
  if full == workdir:
    return "."
  if full.startswith(workdir.rstrip("/") + "/"):
    return full[len(workdir.rstrip("/")) + 1:]
  return None


class _Parser:
  def __init__(self, text: str, task_dir: str, name: str):
    self.task_dir, self.name = task_dir, name
    self.suite, self.base = None, ""
    self.debian, self.pip = [], []
    self.workdir = "/"
    self.env: dict[str, str] = {}
    self.setup: dict[str, tuple] = {}
    self.line = 0
    self.copied = 0
    for self.line, instruction in _logical_lines(text):
      keyword, _, rest = instruction.strip().partition(" ")
      handler = getattr(self, f"_{keyword.lower()}", None)
      if keyword.upper() != keyword or handler is None:
        self.fail(f"{keyword} is outside the supported subset (FROM, RUN, COPY, WORKDIR, ENV).")
      if keyword != "FROM" and self.suite is None:
        self.fail(f"{keyword} before FROM.")
      handler(rest.strip())
    if self.suite is None:
      raise DockerfileError(f"{self.name}: no FROM line.")
    if self.workdir == "/":
      raise DockerfileError(f"{self.name}: no WORKDIR: the sandbox needs a work directory "
                            f"(e.g. WORKDIR /app).")

  def fail(self, why: str):
    raise DockerfileError(f"{self.name}:{self.line}: {why}")

  def _from(self, rest: str):
    if self.suite is not None:
      self.fail("a second FROM: multi-stage builds are outside the supported subset.")
    words = rest.split()
    if len(words) != 1 or words[0].startswith("--"):
      self.fail(f"FROM {rest}: one image, no flags or stage names.")
    self.suite, implied = _base(words[0], self.fail)
    self.debian += implied
    self.base = f"{words[0]} -> debian {self.suite}"

  def _run(self, rest: str):
    if rest.startswith("["):
      self.fail("RUN in exec form ([...]) is outside the supported subset; write the shell form.")
    spaced = shlex.shlex(rest, posix=True, punctuation_chars=";&|<>()")
    spaced.whitespace_split = True
    try:
      tokens = list(spaced)
    except ValueError as error:
      self.fail(f"RUN {rest[:60]}: {error}.")
    for command in _split_chain(tokens):
      if any(set(word) <= set("|<>()&;") for word in command):
        self.fail(f"RUN `{' '.join(command)[:80]}`: pipes, redirections and subshells are outside "
                  f"the supported subset.")
      self._command(command, rest)

  def _command(self, words: list[str], rest: str):
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # DEBIAN_FRONTEND=noninteractive
      words = words[1:]
    shown = " ".join(words)[:80]
    if not words:
      return
    if words[0] in ("apt-get", "apt"):
      self._apt(words, shown)
    elif words[0] in ("pip", "pip3") or words[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]) \
        or words[:2] == ["uv", "pip"]:
      start = 1 if words[0] in ("pip", "pip3") else 2 if words[0] == "uv" else 3
      if words[start:start + 1] != ["install"]:
        self.fail(f"RUN `{shown}`: only `pip install` is supported.")
      self._packages(words[start + 1:], _PIP_FLAGS, self.pip, "pip", shown)
    elif words[:2] == ["rm", "-rf"] and all(w.startswith("/var/lib/apt/lists") for w in words[2:]):
      return  # apt cleanup: the runtime holds no package lists anyway
    elif words[:2] == ["mkdir", "-p"] and len(words) > 2:
      for path in words[2:]:
        rel = _inside(path, self.workdir) if self.workdir != "/" else None
        if rel is None:
          self.fail(f"RUN `{shown}`: mkdir -p outside the WORKDIR ({self.workdir}) is not supported "
                    f"(the rest of the file system is the read-only runtime).")
        if rel != ".":
          self.setup.setdefault(rel, (rel, "d", 0o755, b""))
    else:
      self.fail(f"RUN `{shown}` is outside the supported subset: only apt-get install, pip install, "
                f"mkdir -p inside the WORKDIR and apt cleanup (the runtime is built from packages, "
                f"not by running commands).")

  def _apt(self, words: list[str], shown: str):
    verbs = [w for w in words[1:] if not w.startswith("-")]
    verb = verbs[0] if verbs else ""
    if verb in ("update", "clean", "autoclean") and len(verbs) == 1:
      return
    if verb != "install":
      self.fail(f"RUN `{shown}`: only apt-get update, install and clean are supported.")
    index = words.index("install")
    flags = [w for w in words[1:index] if w.startswith("-")]
    self._packages(flags + words[index + 1:], _APT_FLAGS, self.debian, "Debian", shown)

  def _packages(self, words: list[str], flags: set, into: list, kind: str, shown: str):
    names = []
    for word in words:
      if word.startswith("-"):
        if word not in flags:
          self.fail(f"RUN `{shown}`: option {word} is outside the supported subset "
                    f"({', '.join(sorted(flags))}).")
      else:
        if not (DEBIAN_NAME if kind == "Debian" else PIP_REQUIREMENT).match(word):
          form = ("name or name=version" if kind == "Debian"
                  else "name, name==1.2; no URLs, paths or options")
          self.fail(f"RUN `{shown}`: {word!r} is not a {kind} package name ({form}).")
        names.append(word)
    if not names:
      self.fail(f"RUN `{shown}`: installs no {kind} package.")
    into += names

  def _copy(self, rest: str):
    words = rest.split()
    while words and words[0].startswith("--"):
      if not words[0].startswith("--chown="):
        self.fail(f"COPY {words[0]} is outside the supported subset (only --chown, which a one-user "
                  f"sandbox ignores).")
      words = words[1:]
    if len(words) < 2:
      self.fail("COPY needs a source and a destination.")
    *sources, dest = words
    target = _inside(dest, self.workdir) if self.workdir != "/" else None
    if target is None:
      self.fail(f"COPY to {dest}: the destination must lie in the WORKDIR ({self.workdir}); the rest "
                f"of the file system is the read-only runtime.")
    into_dir = dest.endswith("/") or len(sources) > 1 or target == "."
    for source in sources:
      if any(c in source for c in "*?["):
        self.fail(f"COPY {source}: wildcards are outside the supported subset; name the files.")
      full = os.path.normpath(os.path.join(self.task_dir, source))
      if not (full == self.task_dir or full.startswith(self.task_dir + os.sep)) or not os.path.exists(full):
        self.fail(f"COPY {source}: no such file or folder in the task directory.")
      if os.path.isdir(full):
        self._copy_tree(full, target if not into_dir or source in (".", "./") else
                        posixpath.normpath(posixpath.join(target, os.path.basename(full))))
      else:
        rel = posixpath.normpath(posixpath.join(target, os.path.basename(full))) if into_dir else target
        self._copy_file(full, rel)

  def _copy_tree(self, folder: str, target: str):
    for root, dirs, files in os.walk(folder):
      dirs.sort()
      rel_root = os.path.relpath(root, folder)
      base = target if rel_root == "." else posixpath.normpath(posixpath.join(target, rel_root))
      if base != ".":
        self.setup.setdefault(base, (base, "d", 0o755, b""))
      for name in sorted(files):
        self._copy_file(os.path.join(root, name), posixpath.normpath(posixpath.join(base, name)))

  def _copy_file(self, full: str, rel: str):
    info = os.lstat(full)
    if not stat.S_ISREG(info.st_mode):
      self.fail(f"COPY {os.path.relpath(full, self.task_dir)}: only regular files and folders.")
    self.copied += info.st_size
    if self.copied > MAX_COPY_BYTES:
      self.fail(f"COPY: more than {MAX_COPY_BYTES} bytes.")
    with open(full, "rb") as handle:
      self.setup[rel] = (rel, "f", stat.S_IMODE(info.st_mode), handle.read())

  def _workdir(self, rest: str):
    path = rest.strip().strip('"')
    path = posixpath.normpath(path if path.startswith("/") else posixpath.join(self.workdir, path))
    try:
      check_mounts(path)
    except ValueError as error:
      self.fail(f"WORKDIR {path}: {error}")
    if self.setup and self.workdir != "/" and path != self.workdir:
      self.fail(f"WORKDIR {path} after files were copied into {self.workdir}: one work directory "
                f"per task.")
    self.workdir = path

  def _env(self, rest: str):
    try:
      words = shlex.split(rest)
    except ValueError as error:
      self.fail(f"ENV {rest[:60]}: {error}.")
    if words and "=" not in words[0]:
      if len(words) < 2:
        self.fail("ENV needs KEY=VALUE or KEY VALUE.")
      pairs = [(words[0], " ".join(words[1:]))]
    else:
      pairs = [tuple(word.split("=", 1)) for word in words]
    known = {**base_env(self.workdir), **self.env}
    for pair in pairs:
      if len(pair) != 2 or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", pair[0]):
        self.fail(f"ENV {rest[:60]}: {pair[0]!r} is not a variable name.")
      name, value = pair
      self.env[name] = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: known.get(m.group(1), ""),
                              value)
      known[name] = self.env[name]


def parse_dockerfile(text: str, task_dir: str, *, name: str = "Dockerfile") -> DockerEnvironment:
  """The environment a Dockerfile declares (see the module docstring); DockerfileError naming the
  file, the line and why for anything outside the subset."""
  parser = _Parser(text, os.path.abspath(task_dir), name)
  try:
    runtime = RuntimeSpec(suite=parser.suite, debian=tuple(parser.debian), pip=tuple(parser.pip))
  except ValueError as error:
    raise DockerfileError(f"{name}: {error}") from None
  env = tuple((k, v) for k, v in parser.env.items() if k != "HOME")
  return DockerEnvironment(base=parser.base, runtime=runtime, workdir=parser.workdir, env=env,
                           setup=tuple(parser.setup[k] for k in sorted(parser.setup)))
