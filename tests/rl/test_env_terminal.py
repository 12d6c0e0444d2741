"""rl/envs/terminal.py: the task directory format and its loader, sandboxed shell steps whose work
directory persists across turns (ShellRunner), and terminal episodes end to end, each in one persistent
session whose shell state and background processes live across turns (bubblewrap sandboxes)."""

import json
import os
import time

import pytest

from meshrl.rl.envs import terminal_tasks
from meshrl.rl.envs.episode import Budget, run_episode
from meshrl.rl.envs.terminal import (EPISODE_LIMITS, ShellRunner, Step, TaskError, TerminalEnv,
                                     load_task, load_tasks, terminal_reward)
from meshrl.rl.sandbox import Limits, SandboxUnavailable, SessionPool, SessionSpec, check_bwrap
from meshrl.rl.sandbox.bwrap import Runtime

try:
  check_bwrap(Runtime.host(), uid=61000 if os.geteuid() == 0 else None)
  HAVE_BWRAP = True
except SandboxUnavailable:
  HAVE_BWRAP = False
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap cannot run here: apt-get "
                                 "install -y bubblewrap (Debian/Ubuntu)")


@pytest.fixture(scope="module")
def runner():
  return ShellRunner()


@pytest.fixture(scope="module")
def sessions():
  with SessionPool(SessionSpec(EPISODE_LIMITS), warm=1) as pool:
    yield pool


def _wait_recycled(pool, count, timeout_s=20.0):
  deadline = time.monotonic() + timeout_s
  while pool.recycled < count and time.monotonic() < deadline:
    time.sleep(0.01)
  assert pool.recycled == count, (pool.recycled, count)


def _task(tmp_path, family="edit", index=0):
  meta, spec = terminal_tasks.make_task(family, index)
  terminal_tasks.write_task(str(tmp_path / meta["id"]), meta, spec)
  return load_task(str(tmp_path / meta["id"])), spec


def test_loader_reports_each_broken_directory(tmp_path):
  faults = terminal_tasks.write_planted_faults(str(tmp_path / "faults"))
  good = terminal_tasks.write_tasks(str(tmp_path / "good"), per_family=1)
  tasks, broken = load_tasks([str(tmp_path / "faults"), str(tmp_path / "good")])
  loader_faults = {"invalid_json", "missing_check", "missing_oracle", "missing_field", "bad_type",
                   "unknown_field", "not_utf8", "setup_symlink", "bad_timeout", "duplicate_id"}
  assert set(broken) == {folder for folder, kind in faults.items() if kind in loader_faults}
  assert "lacks the field 'prompt'" in broken["fault_missing_field"]
  assert "not valid JSON" in broken["fault_invalid_json"]
  assert {t.id for t in tasks} >= set(good)
  with pytest.raises(TaskError, match="check.sh is missing"):
    load_task(str(tmp_path / "faults" / "fault_missing_check"))
  with pytest.raises(ValueError, match="no such directory"):
    load_tasks([str(tmp_path / "nowhere")])


def test_example_carries_the_task(tmp_path):
  task, _ = _task(tmp_path)
  example = task.example()
  assert example["verifier"] == "terminal" and example["task_dir"] == task.directory
  assert json.loads((tmp_path / task.id / "task.json").read_text())["prompt"] == example["prompt"]


@pytest.mark.needs_sandbox
def test_work_dir_persists_across_commands_processes_do_not(runner):
  first = runner.run([Step("mkdir -p d && echo hi > d/a && chmod 755 d/a && (sleep 30 &) && echo ok", 5)])
  assert first.steps[0].exit_code == 0 and first.steps[0].output == b"ok\n"
  second = runner.run([Step("cat d/a; ls -l d/a | cut -c1-10; pgrep sleep || echo none", 5)], first.state)
  assert second.steps[0].output.decode().split() == ["hi", "-rwxr-xr-x", "none"]
  slow = runner.run([Step("echo before; sleep 30", 0.5)], first.state)
  assert slow.steps[0].timed_out and slow.steps[0].output == b"before\n"
  assert slow.state.files() == first.state.files()  # a timed-out command keeps what it wrote
  broken = runner.run([Step("kill -9 $PPID", 5)], first.state)
  assert broken.unreadable and broken.env_failure is None


@needs_bwrap
def test_episode_solves_a_task_with_the_oracle_commands(tmp_path, sessions):
  task, spec = _task(tmp_path, "edit", 3)
  turns = iter(["<cmd>ls; cat settings_3.ini</cmd>", "no call here", f"<cmd>{spec['oracle'].strip()}</cmd>",
                b"<cmd>printf '\\377'</cmd>\xfe", "<done>"])
  episode = run_episode(TerminalEnv(sessions), task, lambda conversation: next(turns))
  assert episode.end == "done" and episode.reward == 1.0 and episode.solved
  assert episode.malformed_calls == 1 and episode.invalid_utf8_turns == 1
  assert "settings_3.ini" in episode.messages[2]["content"]
  assert episode.messages[4]["content"].startswith("error: no tool call")
  assert "\ufffd" in episode.messages[8]["content"]  # the command's non-UTF-8 output
  unsolved = run_episode(TerminalEnv(sessions), task, lambda c: "<cmd>rm settings_3.ini</cmd>",
                         Budget(max_turns=2))
  assert unsolved.end == "max_turns" and unsolved.reward == 0.0 and unsolved.env_failure is None


@needs_bwrap
def test_crashing_check_is_an_env_failure_not_a_wrong_answer(tmp_path, sessions):
  task, _ = _task(tmp_path, "create", 1)
  task = task.__class__(**{**task.__dict__, "check": "no_such_tool\n"})
  reported = []
  episode = run_episode(TerminalEnv(sessions), task, lambda c: "<done>",
                        on_env_failure=lambda t, reason: reported.append((t.id, reason)))
  assert episode.end == "env_failure" and "exit 127" in episode.env_failure
  assert reported == [(task.id, episode.env_failure)]


@pytest.mark.needs_sandbox
def test_terminal_reward_is_the_one_step_episode(tmp_path):
  task, spec = _task(tmp_path, "compute", 2)
  example = task.example()
  assert terminal_reward(f"<cmd>{spec['oracle'].strip()}</cmd>", example) == 1.0
  assert terminal_reward("I think it is 7", example) == 0.0


def _service_task(tmp_path):
  """A task only a persistent session can solve: the check asks a service the policy must leave
  running, and reads a file written relative to a directory entered in an earlier turn."""
  folder = tmp_path / "service"
  folder.mkdir()
  (folder / "task.json").write_text(json.dumps({
      "id": "service", "domain": "term_service", "max_turns": 5, "timeout_s": 10,
      "prompt": "Leave a server on 127.0.0.1:7000 that answers 'pong', and write its port to out/port."}))
  (folder / "check.sh").write_text(
      "[ \"$(cat out/port 2>/dev/null)\" = 7000 ] || exit 1\n"
      "python3 -c \"import socket, sys; sys.exit(socket.create_connection(('127.0.0.1', 7000), "
      "timeout=2).recv(9) != b'pong')\" || exit 1\n")
  (folder / "oracle.sh").write_text("true\n")
  (folder / "setup").mkdir()
  (folder / "setup" / "server.py").write_text(
      "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 7000))\ns.listen()\n"
      "while True:\n  c, _ = s.accept()\n  c.sendall(b'pong')\n  c.close()\n")
  return load_task(str(folder))


@needs_bwrap
def test_an_episode_lives_in_one_session_and_ends_with_it(tmp_path):
  """Turn 1 starts a service, turn 2 enters a folder, turn 3 writes there relying on the shell's
  cwd and a variable of turn 2; check.sh (in the same session) reaches the service. The session is
  handed back with the episode's end and recycled: the next episode runs in the same sandbox and
  finds nothing of this one (the service is gone, so its check fails)."""
  task = _service_task(tmp_path)
  with SessionPool(SessionSpec(EPISODE_LIMITS), warm=0) as sessions:
    _recycled_episodes(task, sessions)


def _recycled_episodes(task, sessions):
  env = TerminalEnv(sessions)
  recycled = sessions.recycled
  assert env.reset(task) == task.prompt
  turns = iter(["<cmd>python3 server.py >/dev/null 2>&1 &</cmd>", "<cmd>mkdir out && cd out; P=7000</cmd>",
                "<cmd>echo $P > port; sleep 0.3; pwd</cmd>", "<done>"])
  session = env.session
  episode = run_episode(env, task, lambda conversation: next(turns))
  assert episode.reward == 1.0 and episode.end == "done", episode
  assert episode.messages[6]["content"].startswith("/work/out\n")
  assert env.session is None  # handed back at the episode's end
  _wait_recycled(sessions, recycled + 1)
  again_env = TerminalEnv(sessions)
  again_env.reset(task)
  assert again_env.session is session  # the recycled sandbox, not a new one
  again = run_episode(again_env, task, lambda c: "<done>")  # nothing left running
  assert again.reward == 0.0 and again.env_failure is None


@needs_bwrap
def test_close_ends_an_abandoned_episode_and_a_runaway_one_is_unsolved(tmp_path, sessions):
  task = _service_task(tmp_path)
  env = TerminalEnv(sessions)
  env.reset(task)
  assert not env.step("<cmd>python3 server.py >/dev/null 2>&1 &</cmd>").done
  recycled = sessions.recycled
  env.close()
  env.close()
  assert env.session is None
  _wait_recycled(sessions, recycled + 1)  # handed back once, recycled once
  small = SessionPool(SessionSpec(Limits(max_files=50, disk_mb=8)), warm=0)
  with small:
    env = TerminalEnv(small)
    env.reset(task)
    result = env.step("<cmd>for i in $(seq 500); do : > f$i; done; sleep 5</cmd>")
  assert result.done and result.reward == 0.0 and result.info["session_ended"] == "file_count_limit"
  assert "env_failure" not in result.info  # the policy's doing, never quarantined
