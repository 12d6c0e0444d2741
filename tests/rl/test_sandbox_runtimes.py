"""rl/sandbox/runtimes.py: declarations hash canonically, the cache builds each once (also under
concurrent builders) and keeps nothing of a failed build, a failure names the package, tree digests
see contents and not times; a real mmdebstrap build (slow; needs mmdebstrap and Debian's archive)
built twice has the same hash and contents and runs a session without the host's /usr."""

import os
import shutil
import socket
import threading
import time

import pytest

from meshrl.rl.sandbox import runtimes
from meshrl.rl.sandbox.runtimes import (BuiltRuntime, RuntimeBuildError, RuntimeCache, RuntimeSpec,
                                        failing_package, host_missing, runtime_from_rootfs,
                                        tree_digest)


@pytest.fixture
def cache_dir():
  """A folder the sandbox's uid can enter (pytest's tmp_path is closed to other users)."""
  path = _open_tmp()
  yield path
  shutil.rmtree(path, ignore_errors=True)


def test_digest_is_the_canonical_declaration():
  spec = RuntimeSpec(debian=("jq", "curl"), pip=("six==1.16.0", "attrs"))
  same = RuntimeSpec(debian=("curl", "jq", "curl"), pip=("attrs", "six==1.16.0"))
  assert spec.digest == same.digest and len(spec.digest) == 64
  canonical = spec.canonical()
  assert canonical["debian"] == sorted({"jq", "curl", "python3-pip", *runtimes.BASE_PACKAGES})
  assert canonical["pip"] == ["attrs", "six==1.16.0"] and canonical["suite"] == "bookworm"
  changed = [RuntimeSpec(debian=("jq",), pip=("six==1.16.0", "attrs")),
             RuntimeSpec(debian=("jq", "curl=7.88.1-10"), pip=("six==1.16.0", "attrs")),
             RuntimeSpec(debian=("jq", "curl"), pip=("six==1.17.0", "attrs")),
             RuntimeSpec(suite="trixie", debian=("jq", "curl"), pip=("six==1.16.0", "attrs"))]
  assert len({spec.digest, *(c.digest for c in changed)}) == 5
  # pip needs pip: declaring a requirement adds python3-pip, so the two trees differ
  assert "python3-pip" not in RuntimeSpec(debian=("jq",)).canonical()["debian"]


@pytest.mark.parametrize("kwargs, match", [
    ({"suite": "sid"}, "suite='sid'"),
    ({"debian": ("Bad Name",)}, "'Bad Name' is not a Debian package"),
    ({"debian": ("-y",)}, "'-y' is not a Debian package"),
    ({"debian": "jq"}, "must be a list of strings"),
    ({"pip": ("git+https://example.com/x",)}, "URLs, paths and options are not allowed"),
    ({"pip": ("--index-url=x",)}, "'--index-url=x' is not a pip requirement"),
    ({"pip": ("./local",)}, "'./local' is not a pip requirement"),
])
def test_bad_declarations_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RuntimeSpec(**kwargs)


def _fake_builder(calls):
  def build(spec, rootfs, log):
    calls.append(spec.digest)
    time.sleep(0.2)  # long enough for a second builder to arrive while this one holds the lock
    os.makedirs(os.path.join(rootfs, "usr", "bin"))
    with open(os.path.join(rootfs, "usr", "bin", "tool"), "w") as handle:
      handle.write(" ".join(spec.canonical()["debian"]))
    os.symlink("usr/bin", os.path.join(rootfs, "bin"))
    log.write("built\n")
    return {"debian_versions": ["tool=1"]}
  return build


def test_a_cache_the_sandbox_cannot_reach_is_refused(tmp_path):
  if os.geteuid() != 0:
    pytest.skip("only a root host runs sandboxes as other uids")
  closed = tmp_path / "closed"
  closed.mkdir(mode=0o700)
  with pytest.raises(ValueError, match=f"the folder {closed} .mode 700. is closed to other users"):
    RuntimeCache(str(closed / "cache"))


def test_cache_builds_each_declaration_once_even_for_concurrent_builders(cache_dir):
  calls = []
  spec = RuntimeSpec(debian=("jq",))
  caches = [RuntimeCache(cache_dir, builder=_fake_builder(calls)) for _ in range(3)]
  assert caches[0].get(spec) is None
  results = []
  threads = [threading.Thread(target=lambda c=c: results.append(c.build(spec))) for c in caches]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert calls == [spec.digest], "three builders, one build"
  assert len({r.path for r in results}) == 1 and results[0].path == os.path.join(cache_dir, spec.digest)
  built = caches[0].build(spec)
  assert calls == [spec.digest] and isinstance(built, BuiltRuntime)
  assert built.manifest["tree_digest"] == tree_digest(built.rootfs)
  assert built.manifest["declaration"] == spec.canonical()
  assert built.runtime.binds == ((os.path.join(built.rootfs, "usr"), "/usr"),)
  assert built.runtime.symlinks == (("usr/bin", "/bin"),)
  other = RuntimeSpec(debian=("curl",))
  caches[1].build(other)
  assert calls == [spec.digest, other.digest]
  assert sorted(p for p in os.listdir(cache_dir) if not p.endswith(".lock")) == sorted(
      [spec.digest, other.digest])


def test_a_failed_build_names_the_package_and_leaves_no_cache_entry(tmp_path, cache_dir, monkeypatch):
  """mmdebstrap_build against a stand-in mmdebstrap that fails as apt does for a missing package."""
  fake = tmp_path / "bin" / "mmdebstrap"
  fake.parent.mkdir()
  fake.write_text("#!/bin/sh\necho 'I: running apt-get update...'\n"
                  "echo 'E: Unable to locate package nosuchpkg-meshrl'\nexit 1\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
  cache = RuntimeCache(cache_dir)
  spec = RuntimeSpec(debian=("nosuchpkg-meshrl",))
  with pytest.raises(RuntimeBuildError, match="Debian package 'nosuchpkg-meshrl' cannot be installed"):
    cache.build(spec)
  assert cache.get(spec) is None
  left = sorted(os.listdir(cache.root))
  assert left == [f"{spec.digest}.failed.log", f"{spec.digest}.lock"], left
  with open(os.path.join(cache_dir, f"{spec.digest}.failed.log")) as handle:
    assert "Unable to locate package" in handle.read()


@pytest.mark.parametrize("log, blamed", [
    ("E: Unable to locate package nosuch\n", ("Debian", "nosuch")),
    ("E: Package 'oldthing' has no installation candidate\n", ("Debian", "oldthing")),
    ("E: Version '9.9' for 'jq' was not found\n", ("Debian", "jq")),
    ("ERROR: Could not find a version that satisfies the requirement six==99 (from versions: 1.16)\n"
     "ERROR: No matching distribution found for six==99\n", ("pip", "six==99")),
    ("I: all fine\nE: something else broke\n", None),
])
def test_failing_package_reads_apt_and_pip(log, blamed):
  assert failing_package(log) == blamed


def test_tree_digest_sees_contents_modes_and_links_not_times(tmp_path):
  def tree(root):
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_text("x")
    os.symlink("d/f", root / "link")
    return root
  a, b = tree(tmp_path / "a"), tree(tmp_path / "b")
  os.utime(b / "d" / "f", (1, 1))
  assert tree_digest(str(a)) == tree_digest(str(b))
  (b / "d" / "f").chmod(0o600)
  assert tree_digest(str(a)) != tree_digest(str(b))
  (b / "d" / "f").chmod((a / "d" / "f").stat().st_mode & 0o777)
  (b / "d" / "f").write_text("y")
  assert tree_digest(str(a)) != tree_digest(str(b))
  assert tree_digest(str(b), skip=["d/f"]) == tree_digest(str(a), skip=["d/f"])


def test_runtime_from_rootfs_binds_usr_etc_opt_and_recreates_links(tmp_path):
  for name in ("usr", "etc", "lib64"):
    (tmp_path / name).mkdir()
  os.symlink("usr/bin", tmp_path / "bin")
  os.symlink("usr/lib", tmp_path / "lib")
  runtime = runtime_from_rootfs(str(tmp_path))
  assert runtime.binds == ((str(tmp_path / "usr"), "/usr"), (str(tmp_path / "etc"), "/etc"),
                           (str(tmp_path / "lib64"), "/lib64"))
  assert runtime.symlinks == (("usr/bin", "/bin"), ("usr/lib", "/lib"))
  assert runtime.python == "/usr/bin/python3"


@pytest.mark.skipif(not os.path.exists("/etc/debian_version"), reason="the host is not Debian")
def test_host_missing_names_what_the_host_lacks():
  host = RuntimeSpec(suite=_host_suite() or "bookworm", debian=("bash",))
  assert host_missing(host) == ([] if _host_suite() else ["suite bookworm (the host is unknown)"])
  lacking = RuntimeSpec(suite=host.suite, debian=("nosuchpkg-meshrl",), pip=("nosuchpip-meshrl==1",))
  assert [m for m in host_missing(lacking) if "suite" not in m] == [
      "Debian package nosuchpkg-meshrl", "pip package nosuchpip-meshrl==1"]


def _host_suite():
  try:
    for line in open("/etc/os-release", encoding="utf-8"):
      if line.startswith("VERSION_CODENAME="):
        suite = line.split("=", 1)[1].strip().strip('"')
        return suite if suite in runtimes.SUITES else None
  except OSError:
    return None
  return None


def _archive_reachable() -> bool:
  try:
    socket.create_connection(("deb.debian.org", 80), timeout=3).close()
    return True
  except OSError:
    return False


@pytest.mark.slow
def test_a_runtime_built_twice_has_the_same_hash_and_contents_and_runs_a_session(tmp_path):
  """Two independent builds (two caches) of one declaration: the same digest and the same tree; a
  session in it finds the declared tools, not the host's, and has no network."""
  if shutil.which("mmdebstrap") is None:
    pytest.skip("mmdebstrap is not installed: apt-get update && apt-get install -y mmdebstrap")
  if not _archive_reachable():
    pytest.skip("Debian's archive (deb.debian.org) is not reachable")
  spec = RuntimeSpec(debian=("jq",), pip=("six==1.16.0",))
  shared = _open_tmp()  # pytest's tmp_path is closed to the sandbox's unprivileged uid
  try:
    _build_twice_and_run(spec, shared)
  finally:
    shutil.rmtree(shared, ignore_errors=True)


def _open_tmp():
  import tempfile  # pylint: disable=import-outside-toplevel
  path = tempfile.mkdtemp(prefix="meshrl-runtime-test-")
  os.chmod(path, 0o755)
  return path


def _build_twice_and_run(spec, shared):
  from meshrl.rl.sandbox import Limits, SandboxUnavailable  # pylint: disable=import-outside-toplevel
  from meshrl.rl.sandbox.session import Session, SessionSpec  # pylint: disable=import-outside-toplevel
  first = RuntimeCache(os.path.join(shared, "one")).build(spec)
  second = RuntimeCache(os.path.join(shared, "two")).build(spec)
  assert first.digest == second.digest == spec.digest
  assert first.manifest["tree_digest"] == second.manifest["tree_digest"]
  assert tree_digest(first.rootfs) == tree_digest(second.rootfs) == first.manifest["tree_digest"]
  assert first.manifest["pip_freeze"] == ["six==1.16.0"]
  assert any(v.startswith("jq=") for v in first.manifest["debian_versions"])
  try:
    session = Session.start(SessionSpec(Limits(timeout_s=20), runtime=first.runtime))
  except SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable: {error}")
  try:
    result = session.run("echo '{\"a\": 7}' | jq .a; python3 -c 'import six; print(six.__version__)'; "
                         "command -v git || echo no-git; python3 -c \"import socket; "
                         "socket.create_connection(('151.101.0.223', 80), timeout=2)\" 2>&1 | tail -1")
  finally:
    session.close()
  lines = result.stdout.decode().splitlines()
  assert lines[:3] == ["7", "1.16.0", "no-git"], result  # the host has git; the runtime does not
  assert "Network is unreachable" in lines[3]  # no network inside (loopback only)
