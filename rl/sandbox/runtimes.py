"""Reproducible runtimes: a task's declared packages built once into a root filesystem, cached by the
hash of the declaration, bound read-only into its sandboxes.

  spec = RuntimeSpec(suite="bookworm", debian=("jq",), pip=("six==1.16.0",))
  built = RuntimeCache().build(spec)      # mmdebstrap, once; later calls find it by spec.digest
  session = Session.start(SessionSpec(limits, runtime=built.runtime))

A declaration is a Debian suite, Debian packages and pip requirements. Its `digest` is the SHA-256
of its canonical JSON (sorted, de-duplicated lists, the always-installed `BASE_PACKAGES`, the
architecture and `BUILDER_VERSION`), so the same declaration names the same tree on every machine and
a changed one never reuses a stale tree. Building happens on the host, outside any sandbox (the only
step with network): `mmdebstrap` installs Debian's "required" packages (as a -slim image holds
them) and the declared ones, with their dependencies, from Debian's archive into a fresh directory
with SOURCE_DATE_EPOCH fixed (reproducible output, Debian's `mmdebstrap` manual), then `pip install` runs in a chroot of it (`--no-compile`: no bytecode whose
bytes depend on the build). The directory is renamed into the cache only when complete (a manifest
records the declaration, the installed Debian versions and pip's freeze), under a per-digest lock,
so concurrent builders wait for one build. `tree_digest(path)` hashes a tree's paths, kinds, modes,
link targets and file contents (not times): two builds of one declaration agree on it while the
archive does not move (Debian point releases change versions; pin them in the declaration for a
tree that never changes).

The sandbox sees the tree's /usr, /etc and /opt read-only and its /bin, /lib*... links
(`runtime_from_rootfs`), and has no network; the host's /usr stays the default runtime. A runtime
that fails to build raises RuntimeBuildError naming the package (from apt's and pip's messages) and
the build log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from typing import Callable, Sequence

from meshrl.rl.sandbox.bwrap import Runtime

BUILDER_VERSION = 2  # bump when the build recipe changes what a declaration produces
BASE_PACKAGES = ("bash", "coreutils", "python3")  # the session supervisor and shell need these
PIP_PACKAGE = "python3-pip"  # added when pip requirements are declared
SUITES = ("bookworm", "trixie")  # Debian suites the archive serves (and mmdebstrap here can build)
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SOURCE_DATE_EPOCH = "1700000000"
MANIFEST = "meshrl-runtime.json"
DEBIAN_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$")
PIP_REQUIREMENT = re.compile(
    r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?(\[[A-Za-z0-9._,-]+\])?"
    r"((==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!-]+(,(==|>=|<=|~=|!=|<|>)[A-Za-z0-9.*+!-]+)*)?$")


class RuntimeBuildError(RuntimeError):
  """A runtime that could not be built; the message names the package (when apt or pip said which)
  and the build log."""


def _architecture() -> str:
  try:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return os.uname().machine


@dataclasses.dataclass(frozen=True)
class RuntimeSpec:
  """A runtime declaration (see the module docstring); ValueError naming a bad field or package."""
  suite: str = "bookworm"
  debian: tuple[str, ...] = ()  # "name" or "name=version"
  pip: tuple[str, ...] = ()  # "name", "name==1.2", "name[extra]>=1,<2"

  def __post_init__(self):
    if self.suite not in SUITES:
      raise ValueError(f"runtime suite={self.suite!r} is not one of {list(SUITES)} (the Debian "
                       f"suites this builder takes from Debian's archive).")
    for field, pattern, what in (("debian", DEBIAN_NAME, "a Debian package name (name or "
                                  "name=version)"),
                                 ("pip", PIP_REQUIREMENT, "a pip requirement (name, name==1.2, "
                                  "name[extra]>=1); URLs, paths and options are not allowed")):
      values = getattr(self, field)
      if isinstance(values, str) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"runtime {field}={values!r} must be a list of strings.")
      object.__setattr__(self, field, tuple(values))
      for value in values:
        if not pattern.match(value):
          raise ValueError(f"runtime {field} entry {value!r} is not {what}.")

  def canonical(self) -> dict:
    """What the digest covers: the declaration, sorted and de-duplicated, plus what the builder adds."""
    debian = set(self.debian) | set(BASE_PACKAGES) | ({PIP_PACKAGE} if self.pip else set())
    return {"builder": BUILDER_VERSION, "suite": self.suite, "architecture": _architecture(),
            "debian": sorted(debian), "pip": sorted(set(self.pip))}

  @property
  def digest(self) -> str:
    text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def runtime_from_rootfs(path: str) -> Runtime:
  """The sandbox's read-only view of a root filesystem: its /usr, /etc, /opt bound, its top-level
  links (/bin -> usr/bin, ...) recreated, python3 from its /usr/bin."""
  binds, symlinks = [], []
  for name in ("usr", "etc", "opt"):
    full = os.path.join(path, name)
    if os.path.isdir(full) and not os.path.islink(full):
      binds.append((full, "/" + name))
  for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
    full = os.path.join(path, name)
    if os.path.islink(full):
      symlinks.append((os.readlink(full), "/" + name))
    elif os.path.isdir(full):
      binds.append((full, "/" + name))
  return Runtime(tuple(binds), tuple(symlinks), "/usr/bin/python3")


def tree_digest(path: str, *, skip: Sequence[str] = ()) -> str:
  """SHA-256 over a tree's relative paths, kinds, permission bits, link targets and file contents
  (not times or owners), in sorted order; `skip` names relative paths left out."""
  digest = hashlib.sha256()
  skipped = set(skip)
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(dirs + files):
      full = os.path.join(root, name)
      rel = os.path.relpath(full, path)
      if rel in skipped:
        if name in dirs:
          dirs.remove(name)
        continue
      info = os.lstat(full)
      mode = stat.S_IMODE(info.st_mode)
      if stat.S_ISLNK(info.st_mode):
        entry = f"l {rel} {os.readlink(full)}"
      elif stat.S_ISDIR(info.st_mode):
        entry = f"d {rel} {mode:o}"
      elif stat.S_ISREG(info.st_mode):
        with open(full, "rb") as handle:
          entry = f"f {rel} {mode:o} {hashlib.file_digest(handle, 'sha256').hexdigest()}"
      else:
        entry = f"o {rel} {stat.S_IFMT(info.st_mode):o}"
      digest.update(entry.encode("utf-8", "surrogateescape") + b"\n")
  return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class BuiltRuntime:
  spec: RuntimeSpec
  digest: str
  path: str  # the cache entry; the root filesystem is path/rootfs
  manifest: dict

  @property
  def rootfs(self) -> str:
    return os.path.join(self.path, "rootfs")

  @property
  def runtime(self) -> Runtime:
    return runtime_from_rootfs(self.rootfs)


Builder = Callable[[RuntimeSpec, str, "object"], dict]  # (spec, rootfs dir, log file) -> manifest extras


def default_cache_dir() -> str:
  """$MESHRL_RUNTIME_CACHE, else /var/cache/meshrl/runtimes for root (the sandbox's unprivileged uid
  must reach it; root's home is private), else ~/.cache/meshrl/runtimes."""
  if os.environ.get("MESHRL_RUNTIME_CACHE"):
    return os.environ["MESHRL_RUNTIME_CACHE"]
  if os.geteuid() == 0:
    return "/var/cache/meshrl/runtimes"
  return os.path.join(os.path.expanduser("~"), ".cache", "meshrl", "runtimes")


def check_reachable(path: str) -> None:
  """ValueError naming the first folder above `path` that other users cannot enter: when the host is
  root, sandboxes run as unprivileged uids that must read the runtime's tree."""
  if os.geteuid() != 0:
    return
  current = os.path.abspath(path)
  while True:
    parent = os.path.dirname(current)
    if os.path.isdir(current) and not os.stat(current).st_mode & 0o001:
      raise ValueError(f"runtime cache {path}: the folder {current} (mode "
                       f"{stat.S_IMODE(os.stat(current).st_mode):o}) is closed to other users, so the "
                       f"sandbox's unprivileged uid cannot read the runtime; put the cache elsewhere "
                       f"(MESHRL_RUNTIME_CACHE, default for root: /var/cache/meshrl/runtimes).")
    if parent == current:
      return
    current = parent


class RuntimeCache:
  """Built runtimes under `root` (default $MESHRL_RUNTIME_CACHE or ~/.cache/meshrl/runtimes), one
  folder per digest: rootfs/, build.log and the manifest."""

  def __init__(self, root: str | None = None, *, builder: Builder | None = None):
    self.root = os.path.abspath(root or default_cache_dir())
    self.builder = builder or mmdebstrap_build
    os.makedirs(self.root, mode=0o755, exist_ok=True)
    check_reachable(self.root)

  def path(self, spec: RuntimeSpec) -> str:
    return os.path.join(self.root, spec.digest)

  def get(self, spec: RuntimeSpec) -> BuiltRuntime | None:
    """The built runtime of `spec`, or None if it is not in the cache."""
    path = self.path(spec)
    try:
      with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
        manifest = json.load(handle)
    except (OSError, ValueError):
      return None
    return BuiltRuntime(spec, spec.digest, path, manifest)

  def build(self, spec: RuntimeSpec) -> BuiltRuntime:
    """The runtime of `spec`, built now unless the cache has it (RuntimeBuildError if it fails;
    nothing is left in the cache then)."""
    found = self.get(spec)
    if found is not None:
      return found
    with _locked(os.path.join(self.root, spec.digest + ".lock")):
      found = self.get(spec)  # another process may have built it while we waited
      if found is not None:
        return found
      staging = tempfile.mkdtemp(prefix=f".{spec.digest[:16]}-", dir=self.root)
      try:
        os.chmod(staging, 0o755)  # the sandbox's unprivileged uid reads the tree through it
        rootfs = os.path.join(staging, "rootfs")
        started = time.monotonic()
        log_path = os.path.join(staging, "build.log")
        with open(log_path, "w", encoding="utf-8") as log:
          extras = self.builder(spec, rootfs, log)
        manifest = {"digest": spec.digest, "declaration": spec.canonical(),
                    "tree_digest": tree_digest(rootfs), "build_s": round(time.monotonic() - started, 1),
                    **extras}
        with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as handle:
          json.dump(manifest, handle, indent=1, sort_keys=True)
        os.rename(staging, self.path(spec))
      except BaseException as error:
        kept = None
        if os.path.exists(os.path.join(staging, "build.log")):  # keep the log for the message
          kept = os.path.join(self.root, f"{spec.digest}.failed.log")
          shutil.copyfile(os.path.join(staging, "build.log"), kept)
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, RuntimeBuildError):
          raise RuntimeBuildError(f"{error} (build log: {kept})") from None
        raise
    return self.get(spec)


@contextlib.contextmanager
def _locked(path: str):
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


_APT_FAILURES = (re.compile(r"Unable to locate package (\S+)"),
                 re.compile(r"Package '?([^' ]+)'? has no installation candidate"),
                 re.compile(r"Version '[^']+' for '([^']+)' was not found"),
                 re.compile(r"Couldn't find any package by (?:glob|regex) '([^']+)'"),
                 re.compile(r"^\s*(\S+) : Depends: ", re.M))
_PIP_FAILURES = (re.compile(r"No matching distribution found for (\S+)"),
                 re.compile(r"Could not find a version that satisfies the requirement (\S+)"),
                 re.compile(r"Failed to build (\S+)"))


def failing_package(log: str) -> tuple[str, str] | None:
  """(kind "Debian"/"pip", package) that a build log blames, or None (pure)."""
  for kind, patterns in (("Debian", _APT_FAILURES), ("pip", _PIP_FAILURES)):
    for pattern in patterns:
      found = pattern.search(log)
      if found:
        return kind, found.group(1)
  return None


def mmdebstrap_build(spec: RuntimeSpec, rootfs: str, log) -> dict:
  """Builds `spec` into the new directory `rootfs` with mmdebstrap and pip (see the module
  docstring); returns the manifest's extras (installed Debian versions, pip freeze)."""
  tool = shutil.which("mmdebstrap")
  if tool is None:
    raise RuntimeBuildError("mmdebstrap is not installed: apt-get update && apt-get install -y "
                            "mmdebstrap (Debian/Ubuntu)")
  canonical = spec.canonical()
  env = dict(os.environ, SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH, LC_ALL="C.UTF-8")
  # minbase: the "required" packages (awk, apt, ...) as a -slim Debian image has them, then ours
  argv = [tool, "--variant=minbase", f"--include={','.join(canonical['debian'])}",
          f"--architectures={canonical['architecture']}", "--format=directory"]
  if os.geteuid() == 0:
    argv.append("--mode=root")
  if spec.pip:
    # pip runs in a chroot of the new tree with the host's network settings: its proxy variables
    # and CA bundle (copied in for the build only; it is not part of the runtime).
    pip = ["python3", "-m", "pip", "install", "--no-compile", "--no-cache-dir",
           "--break-system-packages", "--disable-pip-version-check", "--no-input",
           "--root-user-action=ignore", *canonical["pip"]]
    passed = [f"{k}={_shell_quote(v)}" for k, v in os.environ.items() if k in _NETWORK_ENV]
    ca = _host_ca_bundle()
    if ca:
      argv.append(f"--customize-hook=cp {_shell_quote(ca)} \"$1/tmp/meshrl-build-ca.crt\"")
      passed.append("PIP_CERT=/tmp/meshrl-build-ca.crt")
    clean = ["env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "HOME=/root", "LC_ALL=C.UTF-8", f"SOURCE_DATE_EPOCH={SOURCE_DATE_EPOCH}"]
    # env -i: nothing else of the host's environment (its pip configuration) reaches the build
    argv.append("--customize-hook=chroot \"$1\" " + " ".join(clean + passed)
                + " " + " ".join(_shell_quote(a) for a in pip))
    argv.append("--customize-hook=rm -f \"$1/tmp/meshrl-build-ca.crt\"")
  argv.append("--customize-hook=chroot \"$1\" dpkg-query -W -f '${Package}=${Version}\\n' "
              "> \"$1/.meshrl-dpkg\"")
  if spec.pip:
    argv.append("--customize-hook=chroot \"$1\" env -i PATH=/usr/bin:/bin python3 -m pip freeze "
                "--disable-pip-version-check > \"$1/.meshrl-pip\" 2>/dev/null")
  argv += [spec.suite, rootfs, os.environ.get("MESHRL_DEBIAN_MIRROR", DEFAULT_MIRROR)]
  log.write("$ " + " ".join(argv) + "\n")
  log.flush()
  proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
  log.flush()
  if proc.returncode != 0:
    with open(log.name, encoding="utf-8", errors="replace") as handle:
      text = handle.read()
    blamed = failing_package(text)
    what = (f"{blamed[0]} package {blamed[1]!r} cannot be installed" if blamed
            else f"mmdebstrap exited {proc.returncode}: {text.strip()[-400:]!r}")
    raise RuntimeBuildError(f"runtime {spec.digest[:12]} ({spec.suite}; debian={list(spec.debian)}, "
                            f"pip={list(spec.pip)}): {what}")
  extras = {}
  for key, name in (("debian_versions", ".meshrl-dpkg"), ("pip_freeze", ".meshrl-pip")):
    path = os.path.join(rootfs, name)
    if os.path.exists(path):
      with open(path, encoding="utf-8") as handle:
        extras[key] = sorted(line.strip() for line in handle if line.strip())
      os.unlink(path)
  return extras


_NETWORK_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
                "PIP_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT")  # passed to pip


def _host_ca_bundle() -> str | None:
  """The CA bundle the host's own pip trusts (a proxy's CA may be in it), or None."""
  for name in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
    if os.path.isfile(os.environ.get(name, "")):
      return os.environ[name]
  default = "/etc/ssl/certs/ca-certificates.crt"
  return default if os.path.isfile(default) else None


def _shell_quote(text: str) -> str:
  return "'" + text.replace("'", "'\\''") + "'"


def host_missing(spec: RuntimeSpec) -> list[str]:
  """What the host's /usr lacks of `spec` (its suite, Debian packages, pip requirements), for running
  a declared task on the host runtime without building it; [] when the host has everything. Exact
  pins (name=version, name==version) must match; other pip specifiers only need the package."""
  missing = []
  try:
    with open("/etc/os-release", encoding="utf-8") as handle:
      codename = re.search(r"^VERSION_CODENAME=(\S+)", handle.read(), re.M)
  except OSError:
    codename = None
  if not codename or codename.group(1).strip('"') != spec.suite:
    missing.append(f"suite {spec.suite} (the host is {codename.group(1) if codename else 'unknown'})")
  wanted = dict((entry.split("=", 1) + [""])[:2] for entry in spec.canonical()["debian"])
  try:
    query = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version} ${db:Status-Status}\n",
                            *wanted], capture_output=True, text=True, check=False)
    installed = {parts[0]: parts[1] for parts in map(str.split, query.stdout.splitlines())
                 if len(parts) == 3 and parts[2] == "installed"}
  except OSError:
    installed = {}
  for name, version in wanted.items():
    if name not in installed or (version and installed[name] != version):
      missing.append(f"Debian package {name}{'=' + version if version else ''}")
  for requirement in spec.pip:
    name = re.split(r"(?=[\[<>=!~])", requirement, maxsplit=1)[0]
    exact = re.fullmatch(r"[^=<>!~\[]+(?:\[[^]]*\])?==([^,]+)", requirement)
    check = subprocess.run(["/usr/bin/python3", "-c", f"import importlib.metadata as m; "
                            f"print(m.version({name!r}))"], capture_output=True, text=True,
                           check=False)
    if check.returncode != 0 or (exact and check.stdout.strip() != exact.group(1)):
      missing.append(f"pip package {requirement}")
  return missing
