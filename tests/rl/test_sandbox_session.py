"""Persistent sessions (rl/sandbox/session.py, session_shell.py): shell state and background processes
live across turns, per-command timeouts interrupt only the foreground, checks cannot be forged, runaway
sessions end with nothing left behind, sessions cannot see each other, a pool keeps them warm.

Every test needs bubblewrap and skips with the install hint without it (.ci/run installs it). The
attack tests (test_sandbox_attacks_*.py) also run against sessions (their fixtures' "session" mode).
"""

import concurrent.futures
import os
import secrets
import threading
import time

import pytest

from meshrl.rl import sandbox as sb
from meshrl.rl.sandbox import runner
from meshrl.rl.sandbox.session import Session, SessionSpec
from meshrl.rl.sandbox.session_pool import SessionPool
from sandbox_attack_helpers import _assert_nothing_left, _leases, _sandbox_processes  # tests/rl/conftest.py

LIMITS = sb.Limits(timeout_s=5.0, cpu_s=10.0, memory_mb=256, max_processes=24, disk_mb=8,
                   max_files=400, max_output_bytes=4096)
SERVER = """import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(8)
while True:
  c, _ = s.accept()
  c.sendall(sys.argv[2].encode())
  c.close()
"""
ASK = "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', {port})).recv(99).decode())\""


def _start(spec=None, **kwargs):
  try:
    return Session.start(spec or SessionSpec(LIMITS), **kwargs)
  except sb.SandboxUnavailable as error:  # CI installs bubblewrap (.ci/run); a laptop may not.
    pytest.skip(f"bubblewrap unavailable: {error}")


@pytest.fixture
def session():
  box = _start()
  yield box
  box.close()


def test_background_process_started_in_turn_1_answers_in_turn_3(session):
  token = secrets.token_hex(8)
  session.write_files({"server.py": SERVER})
  first = session.run(f"python3 server.py 8080 {token} >/dev/null 2>&1 & mkdir -p sub && cd sub && "
                      f"export TOKEN={token}; greet() {{ echo hi $1; }}")
  assert first.ok, first
  second = session.run("sleep 0.3; echo turn2 > note")
  assert second.ok and second.stdout == b""
  third = session.run(ASK.format(port=8080) + "; echo $PWD $TOKEN; greet you; cat note")
  assert third.ok, third
  assert third.stdout.decode().split("\n")[:-1] == [
      token, f"/work/sub {token}", "hi you", "turn2"]
  # The one-shot sandbox is the control: nothing it starts outlives its run.
  one_shot = sb.Sandbox(LIMITS).run(["bash", "-c", ASK.format(port=8080) + " 2>&1; echo ${TOKEN:-unset}"])
  assert b"ConnectionRefusedError" in one_shot.stdout and one_shot.stdout.endswith(b"unset\n")


def test_exit_status_streams_and_bytes_round_trip(session):
  assert session.run("false").exit_code == 1
  assert session.run("echo $?").stdout == b"1\n"  # `$?` is the previous command's, not the protocol's
  both = session.run("echo out; echo err >&2", stderr="separate")
  assert (both.stdout, both.stderr) == (b"out\n", b"err\n")
  merged = session.run("echo out; echo err >&2")
  assert (merged.stdout, merged.stderr) == (b"out\nerr\n", b"")
  tricky = b"printf '%s\\n' \"it's\" '\\\\x41' $'tab\\there' '\xff\xfe'; cat <<'EOF'\n$HOME `x` \"q\"\nEOF"
  result = session.run(tricky)
  assert result.ok, result
  assert result.stdout == b"it's\n\\\\x41\ntab\there\n\xff\xfe\n$HOME `x` \"q\"\n"
  syntax = session.run("if then fi (")
  assert syntax.exit_code == 2 and b"syntax error" in syntax.stdout
  assert session.run("echo still here").stdout == b"still here\n"
  killed = session.run("kill -SEGV $BASHPID & wait; sh -c 'kill -KILL $$'")
  assert killed.exit_code == 137 and killed.killed_reason is None  # 128 + SIGKILL, as bash says


def test_timeout_interrupts_the_foreground_and_keeps_the_background(session):
  assert session.run("sleep 300 & cd /tmp; X=kept").ok
  started = time.monotonic()
  slow = session.run("echo before; sleep 60; echo never", timeout_s=0.5)
  assert slow.timed_out and slow.killed_reason == "timeout" and slow.exit_code is None
  assert slow.stdout == b"before\n" and not slow.shell_restarted
  assert time.monotonic() - started < 2.5
  busy = session.run("while :; do :; done", timeout_s=0.5)  # a loop inside the shell itself
  assert busy.timed_out and not busy.shell_restarted
  after = session.run("echo $PWD $X; pgrep -x sleep | wc -l")
  assert after.stdout == b"/tmp kept\n1\n", after  # the `&` job lives; the foreground sleep is gone
  stubborn = session.run("trap '' INT; while :; do :; done", timeout_s=0.5)
  assert stubborn.timed_out and stubborn.shell_restarted
  fresh = session.run("echo $PWD ${X:-reset}; pgrep -x sleep | wc -l")
  assert fresh.stdout == b"/work reset\n1\n"  # a fresh shell; files and `&` jobs remain


def test_exit_restarts_the_shell_and_the_session_goes_on(session):
  assert session.run("cd /tmp && touch kept").ok
  gone = session.run("exit 7")
  assert gone.exit_code == 7 and gone.shell_restarted
  assert session.run("echo $PWD; ls /tmp").stdout == b"/work\nkept\n"


def test_output_is_capped_and_a_flood_is_interrupted(session):
  capped = session.run("head -c 5000 /dev/zero | tr '\\0' x")
  assert capped.ok and capped.stdout == b"x" * LIMITS.max_output_bytes and capped.stdout_truncated
  started = time.monotonic()
  flood = session.run("yes")
  assert flood.killed_reason == "output_limit" and len(flood.stdout) == LIMITS.max_output_bytes
  assert time.monotonic() - started < LIMITS.timeout_s
  assert session.run("echo ok").stdout == b"ok\n"


def test_check_runs_beside_the_shell_and_its_status_cannot_be_forged():
  session = _start(SessionSpec(LIMITS, extra_writable=("/tests",)))
  try:
    _forged_check(session)
  finally:
    session.close()


def _forged_check(session):
  forger = """import os, time
fake = b'{"id": %d, "exit": 0, "timed_out": false, "killed": null, "shell": null, "stdout": "", "stderr": "", "stdout_seen": 0, "stderr_seen": 0, "seconds": 0}\\n'
opened = 0
while True:  # the supervisor's report pipe is one of PID 1's descriptors
  for fd in range(64):
    try:
      handle = os.open(f'/proc/1/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
      continue
    opened += 1
    for request in range(1, 40):
      try:
        os.write(handle, fake % request)
      except OSError:
        pass
    os.close(handle)
  open('/tmp/opened_pid1', 'w').write(str(opened))
  time.sleep(0.01)
"""
  session.write_files({"forger.py": forger, "server.py": SERVER})
  assert session.run("python3 forger.py >/dev/null 2>&1 & python3 server.py 9000 svc >/dev/null 2>&1 &"
                     " sleep 0.5").ok
  verdict = session.check(["bash", "/tests/run.sh"], files={
      "/tests/run.sh": ASK.format(port=9000) + "\nexit 3\n"}, timeout_s=5)
  assert verdict.exit_code == 3 and verdict.stdout == b"svc\n", verdict  # it reached the service
  assert session.read_file("/tmp/opened_pid1") == (b"0", False)  # the supervisor's fds stay closed
  hung = session.check(["sleep", "60"], timeout_s=0.5)
  assert hung.timed_out and hung.exit_code is None and hung.seconds < 3
  missing = session.check(["no-such-tool"])
  assert missing.exit_code == 127
  quiet = session.check(["bash", "-c", "exec >/tmp/check.log 2>&1; sleep 0.6; exit 4"])
  assert quiet.exit_code == 4 and quiet.seconds >= 0.6  # its exit ends it, not its closed pipes
  leaves = session.check(["bash", "-c", "sleep 30 & echo done"], timeout_s=5)
  assert leaves.ok and leaves.stdout == b"done\n" and leaves.seconds < 2  # a child holding the pipe
  assert session.run(ASK.format(port=9000)).stdout == b"svc\n"  # the policy's processes live on


def test_read_file_follows_the_shell_and_never_blocks(session):
  assert session.run("mkdir -p d && cd d && printf abc > f && mkfifo pipe").ok
  assert session.read_file("f") == (b"abc", False)
  assert session.read_file("/work/d/f", max_bytes=2) == (b"ab", True)
  with pytest.raises(OSError, match="Is a directory"):
    session.read_file("/work/d")
  started = time.monotonic()
  assert session.read_file("pipe") == (b"", False)  # a FIFO nobody writes: no hang
  assert time.monotonic() - started < 1.0
  with pytest.raises(OSError, match="No such file"):
    session.read_file("missing")


@pytest.mark.parametrize("how", ["session_timeout", "file_count_limit", "close"])
def test_runaway_or_escaped_session_is_killed_and_its_files_are_gone(how, tmp_path):
  marker = f"marker-{secrets.token_hex(8)}"
  spec = SessionSpec(LIMITS if how != "file_count_limit" else sb.Limits(max_files=200, disk_mb=8))
  before = set(_sandbox_processes())
  with _leases() as uids:
    session = _start(spec, session_timeout_s=1.5 if how == "session_timeout" else 60)
    daemon = ("python3 -c \"import os, signal, time\nfor s in (signal.SIGTERM, signal.SIGHUP, "
              "signal.SIGINT): signal.signal(s, signal.SIG_IGN)\nif os.fork() == 0:\n  os.setsid()\n"
              "  while True: time.sleep(1)\"")
    assert session.run(f"touch /work/{marker} /tmp/{marker} /dev/shm/{marker}; {daemon}").ok
    if os.geteuid() == 0:
      assert _sandbox_processes(uids) == [], "a live session's processes count as its own"
    if how == "session_timeout":
      result = session.run("sleep 10")
      assert result.killed_reason == "session_ended: session_timeout", result
    elif how == "file_count_limit":
      result = session.run("for i in $(seq 1000); do : > f$i; done; sleep 5")
      assert result.killed_reason == "session_ended: file_count_limit", result
    else:
      session.close()
    assert not session.alive
    assert session.run("true").killed_reason.startswith("session_ended")
  _assert_nothing_left(before, uids if os.geteuid() == 0 else None)
  for top in ("/tmp", "/dev/shm", "/var/tmp", str(tmp_path)):
    assert not os.path.exists(os.path.join(top, marker))
  assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).startswith(b"sleep\x0010")]


def _cmdline(pid):
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
      return handle.read()
  except OSError:
    return b""


def test_eight_concurrent_sessions_cannot_see_each_other():
  """Eight sessions at once, each with a server on the same loopback port (each has a network of its
  own), its own files, variables and processes: every answer is the session's own."""
  try:
    pool = SessionPool(SessionSpec(LIMITS), warm=0)
  except sb.SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable: {error}")
  tokens = [secrets.token_hex(6) for _ in range(8)]
  everyone_up = threading.Barrier(8)

  def episode(token):
    session = pool.acquire()
    try:
      session.write_files({"server.py": SERVER, "mine": token + "\n"})
      outputs = [session.run(f"python3 server.py 8000 {token} >/dev/null 2>&1 & SECRET={token}").stdout]
      everyone_up.wait(timeout=120)  # all 8 sessions live at once, however slowly a busy machine starts them
      started = time.monotonic()
      for _ in range(3):
        outputs.append(session.run("sleep 0.3; " + ASK.format(port=8000) + "; echo $SECRET; cat mine; "
                                   "ls /proc | grep -c '^[0-9]'").stdout)
      return outputs, started, time.monotonic()
    finally:
      session.close()

  with pool, concurrent.futures.ThreadPoolExecutor(8) as threads:
    results = list(threads.map(episode, tokens))
  for token, (outputs, _, _) in zip(tokens, results):
    for out in outputs[1:]:
      lines = out.decode().split()
      assert lines[:3] == [token] * 3, (token, out)
      assert int(lines[3]) <= 6  # supervisor, shell, server, this command's processes: no other session's
    others = b"".join(outputs)
    assert not any(t.encode() in others for t in tokens if t != token)
  spans = sorted((start, end) for _, start, end in results)
  assert max(start for start, _ in spans) < min(end for _, end in spans), "the 8 sessions did not overlap"


def test_pool_keeps_sessions_warm_and_fresh():
  try:
    pool = SessionPool(SessionSpec(LIMITS), warm=2)
  except sb.SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable: {error}")
  with pool:
    deadline = time.monotonic() + 20
    while len(pool._ready) < 2 and time.monotonic() < deadline:  # pylint: disable=protected-access
      time.sleep(0.02)
    started = time.monotonic()
    first = pool.acquire(env={"GREETING": "hello there"})
    warm_s = time.monotonic() - started
    assert first.run("echo $GREETING; touch left").stdout == b"hello there\n"
    first.close()
    second = pool.acquire()
    assert second.run("ls; echo ${GREETING:-none}").stdout == b"none\n"  # nothing of the first
    second.close()
    cold_started = time.monotonic()
    cold = Session.start(SessionSpec(LIMITS))
    cold_s = time.monotonic() - cold_started
    cold.close()
    assert pool.started >= 3 and pool.taken == 2
  assert warm_s < cold_s, (warm_s, cold_s)  # a warm session skips bwrap, the supervisor and bash
  assert all(not s.alive for s in pool._ready)  # pylint: disable=protected-access
  with pytest.raises(RuntimeError, match="closed"):
    pool.acquire()


def test_work_directory_and_environment_follow_the_spec():
  session = _start(SessionSpec(LIMITS, work="/app", extra_writable=("/tests",)), env={"MODE": "x y"})
  try:
    result = session.run("pwd; echo $HOME $MODE; touch /tests/t /app/a && echo writable; "
                         "touch /work/w 2>/dev/null || echo no-work")
    assert result.stdout == b"/app\n/app x y\nwritable\nno-work\n", result
  finally:
    session.close()


def test_bad_input_is_refused_before_anything_runs(session):
  for command in ("a\0b", 5, b"x" * (1 << 20)):
    with pytest.raises(ValueError, match="command must be str or bytes"):
      session.run(command)
  with pytest.raises(ValueError, match="stderr='both'"):
    session.run("true", stderr="both")
  with pytest.raises(ValueError, match="timeout_s=-1"):
    session.run("true", timeout_s=-1)
  with pytest.raises(ValueError, match="'../x'"):
    session.write_files({"../x": "1"})
  with pytest.raises(ValueError, match="env '1X'"):
    session.set_env({"1X": "v"})
  with pytest.raises(ValueError, match="argv"):
    session.check([])
  with pytest.raises(ValueError, match="read-only runtime"):
    SessionSpec(LIMITS, work="/usr/app")
  with pytest.raises(ValueError, match="limits must be a Limits"):
    SessionSpec({"timeout_s": 1})
  assert session.run("echo fine").stdout == b"fine\n"


def test_uids_are_leased_per_session():
  if os.geteuid() != 0:
    pytest.skip("sandbox uids are leased only when the host is root")
  with _leases() as uids:
    first, second = _start(), _start()
    try:
      owners = {session.run("id -u").stdout for session in (first, second)}
      assert owners == {b"1000\n"} and len(uids) == 2  # the same uid inside, two host uids
      assert all(runner.UID_BASE <= uid for uid in uids)
    finally:
      first.close()
      second.close()


def _recycling_pool(keep=1):
  try:
    return SessionPool(SessionSpec(LIMITS), warm=0, keep=keep)
  except sb.SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable: {error}")


def _returned(pool, count, timeout_s=20.0):
  """Waits until the pool has recycled `count` sessions in all (released ones come back in the background)."""
  deadline = time.monotonic() + timeout_s
  while pool.recycled < count and time.monotonic() < deadline:
    time.sleep(0.01)
  return pool.recycled >= count


KEYS = """import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": (248, 250), "aarch64": (217, 219)}[__import__("os").uname().machine]
if sys.argv[1] == "add":
  user = libc.syscall(nr[0], b"user", b"meshrl_left", b"owl", 3, ctypes.c_long(-4))
  persistent = libc.syscall(nr[1], ctypes.c_long(22), ctypes.c_long(-1), ctypes.c_long(-2))
  kept = libc.syscall(nr[0], b"user", b"meshrl_kept", b"owl", 3, ctypes.c_long(persistent))
  print(user > 0, kept > 0)
else:
  found = [libc.syscall(nr[1], ctypes.c_long(10), ctypes.c_long(k), b"user", name, ctypes.c_long(0))
           for k in (-4, -5) for name in (b"meshrl_left", b"meshrl_kept")]
  persistent = libc.syscall(nr[1], ctypes.c_long(22), ctypes.c_long(-1), ctypes.c_long(-2))
  found += [libc.syscall(nr[1], ctypes.c_long(10), ctypes.c_long(persistent), b"user", b"meshrl_kept", ctypes.c_long(0))]
  print(max(found) > 0)
"""


def test_a_recycled_session_keeps_nothing_of_its_last_episode():
  """Released, a session is recycled and handed out again (the same session: no new sandbox), and the
  next episode finds nothing of the last one: no file in any writable mount (not even in a folder
  made unreadable), the mounts' modes back, no process, no variable, the work dir as cwd, no kernel
  key, and POSIX message queues cannot be made at all."""
  pool = _recycling_pool()
  with pool:
    first = pool.acquire(env={"GREETING": "hi"})
    setup = first.run("mkdir -p sub/locked && touch sub/locked/f .hidden /tmp/t /dev/shm/s && "
                      "chmod 000 sub/locked && chmod 700 /work /tmp && cd sub && export LEFT=1 && "
                      "(while true; do touch /tmp/beat; sleep 0.05; done) >/dev/null 2>&1 & "
                      f"cat > /tmp/keys.py <<'PY'\n{KEYS}PY\npython3 /tmp/keys.py add")
    assert setup.ok and setup.stdout.endswith(b"True True\n"), setup  # after the job line "[1] PID"
    assert first.run("python3 /tmp/keys.py find").stdout == b"True\n"  # the probe finds a key that is there
    pool.release(first)
    assert _returned(pool, 1), "the released session was not recycled"
    second = pool.acquire()
    assert second is first  # a recycled session, not a new sandbox
    look = ("sleep 0.3; ls -A /work /tmp /dev/shm | tr -s '\\n' ' '; echo; echo ${GREETING:-none} ${LEFT:-none}; pwd; "
            "stat -c %a /work /tmp /dev/shm | tr '\\n' ' '")  # a surviving loop would touch /tmp/beat
    after = second.run(look)
    assert after.stdout.decode().splitlines() == ["/dev/shm: /tmp: /work: ", "none none", "/work",
                                                      "755 1777 1777 "], after
    second.write_files({"keys.py": KEYS})
    assert second.run("python3 keys.py find").stdout == b"False\n"  # the keys of the last episode are gone
    queue = second.run("python3 -c \"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
                       "print(libc.mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None))\"")
    assert queue.stdout == b"-1\n", queue
    second.close()


def test_a_session_holding_what_recycling_cannot_remove_is_ended_not_reused():
  """A SysV shared-memory segment lives in the session's IPC namespace past its processes: the session
  is ended, and the next episode gets another sandbox that does not hold the segment."""
  pool = _recycling_pool()
  with pool:
    first = pool.acquire()
    made = first.run("python3 -c \"import ctypes; print(ctypes.CDLL(None).shmget(4242, 4096, 0o1666) >= 0)\"")
    assert made.stdout == b"True\n", made
    pool.release(first)
    deadline = time.monotonic() + 20
    while first.alive and time.monotonic() < deadline:
      time.sleep(0.01)
    assert not first.alive and first.ended == "not_recycled: a SysV shm object is left" and pool.recycled == 0, (
        first.alive, first.ended, pool.recycled)
    second = pool.acquire()
    assert second is not first
    assert second.run("cat /proc/sysvipc/shm | wc -l").stdout == b"1\n"  # the header line only
    second.close()
