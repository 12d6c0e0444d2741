"""Terminal-Bench tasks (rl/envs/tbench.py, rl/envs/dockerfile.py): the Dockerfile subset becomes a
runtime declaration, a work dir, ENV and copied files, and every line outside it is refused naming the
file, the line and why; task.yaml likewise; the shipped tasks (tasks/tbench) pass the quality gate, are
an RL domain of multi-turn terminal tasks, and a policy's episode runs in their sandbox session.
scripts/tbench.py's oracle/null pass rates: tests/scripts/test_tbench.py."""

import json
import os
import shutil

import pytest

from meshrl.rl.envs import tbench
from meshrl.rl.envs.dockerfile import DockerfileError, parse_dockerfile
from meshrl.rl.envs.episode import Budget, run_episode
from meshrl.rl.envs.quality import run_gate
from meshrl.rl.envs.registry import DomainMixture, load_domains
from meshrl.rl.envs.terminal import TaskError, TerminalEnv, load_tasks
from meshrl.rl.sandbox import SandboxUnavailable, check_bwrap
from meshrl.rl.sandbox.bwrap import Runtime
from meshrl.rl.sandbox.runtimes import host_missing

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(REPO, "tasks", "tbench")


def _needs_sandbox_and_host_packages():
  """Skips (with the install hint) where bubblewrap or the shipped tasks' packages are missing."""
  try:
    check_bwrap(Runtime.host(), uid=61000 if os.geteuid() == 0 else None)
  except SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable: {error}")
  missing = sorted({m for t in load_tasks([SHIPPED])[0] for m in host_missing(t.environment.runtime)})
  if missing:
    pytest.skip(f"the host lacks {missing} for --runtime host (apt-get install -y jq sqlite3 git), "
                f"or run scripts/tbench.py --runtime build")


def test_dockerfile_subset_becomes_a_runtime_workdir_env_and_files(tmp_path):
  (tmp_path / "a.txt").write_text("A")
  (tmp_path / "data" / "sub").mkdir(parents=True)
  (tmp_path / "data" / "sub" / "x.sh").write_text("X")
  (tmp_path / "data" / "sub" / "x.sh").chmod(0o755)
  env = parse_dockerfile(
      "# syntax=docker/dockerfile:1\n"
      "FROM python:3.11-slim-bookworm\n"
      "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \\\n"
      "    --no-install-recommends jq sqlite3 \\\n"
      "    && rm -rf /var/lib/apt/lists/*\n"
      "RUN pip install --no-cache-dir pyyaml==6.0; python3 -m pip install six\n"
      "WORKDIR /srv\n"
      "WORKDIR app\n"
      "ENV MODE=prod PATH=/srv/app/bin:$PATH\n"
      "ENV GREETING hello world\n"
      "COPY a.txt /srv/app/\n"
      "COPY --chown=1000:1000 data ./data\n"
      "RUN mkdir -p out /srv/app/logs\n", str(tmp_path))
  assert env.base == "python:3.11-slim-bookworm -> debian bookworm"
  assert env.runtime.suite == "bookworm"
  assert env.runtime.debian == ("python3", "python3-pip", "python3-venv", "jq", "sqlite3")
  assert env.runtime.pip == ("pyyaml==6.0", "six")
  assert env.workdir == "/srv/app"
  assert dict(env.env) == {"MODE": "prod", "PATH": "/srv/app/bin:/usr/local/bin:/usr/bin:/bin",
                           "GREETING": "hello world"}
  assert [(p, k, oct(m)) for p, k, m, _ in env.setup] == [
      ("a.txt", "f", "0o644"), ("data", "d", "0o755"), ("data/sub", "d", "0o755"),
      ("data/sub/x.sh", "f", "0o755"), ("logs", "d", "0o755"), ("out", "d", "0o755")]
  assert dict((p, d) for p, _, _, d in env.setup)["data/sub/x.sh"] == b"X"


@pytest.mark.parametrize("text, where, why", [
    ("FROM debian:12\nUSER bob\nWORKDIR /app", "Dockerfile:2:", "USER is outside the supported subset"),
    ("FROM debian:12\nWORKDIR /app\nRUN curl -sSL x | sh", "Dockerfile:3:", "pipes, redirections"),
    ("FROM debian:12\nWORKDIR /app\nRUN make install", "Dockerfile:3:", "RUN `make install` is outside"),
    ("FROM debian:12\nWORKDIR /app\nRUN apt-get install -y --force-yes jq", "Dockerfile:3:",
     "option --force-yes"),
    ("FROM debian:12\nWORKDIR /app\nRUN pip install -r req.txt", "Dockerfile:3:", "option -r"),
    ("FROM debian:12\nWORKDIR /app\nRUN pip install git+https://x/y", "Dockerfile:3:",
     "is not a pip package name"),
    ("FROM debian:latest\nWORKDIR /app", "Dockerfile:1:", "pin a release tag"),
    ("FROM python:3.12-slim\nWORKDIR /app", "Dockerfile:1:", "python3 of a Debian suite"),
    ("FROM alpine:3.19\nWORKDIR /app", "Dockerfile:1:", "debian:<release>, python:<version>"),
    ("FROM debian:12 AS build\nWORKDIR /app", "Dockerfile:1:", "no flags or stage names"),
    ("FROM debian:12\nFROM debian:12\nWORKDIR /app", "Dockerfile:2:", "multi-stage"),
    ("WORKDIR /app\nFROM debian:12", "Dockerfile:1:", "WORKDIR before FROM"),
    ("FROM debian:12\nWORKDIR /app\nCOPY a.txt /etc/a.txt", "Dockerfile:3:", "must lie in the WORKDIR"),
    ("FROM debian:12\nWORKDIR /app\nCOPY --from=build /x .", "Dockerfile:3:", "COPY --from=build"),
    ("FROM debian:12\nWORKDIR /app\nCOPY *.txt .", "Dockerfile:3:", "wildcards"),
    ("FROM debian:12\nWORKDIR /app\nCOPY ../secret .", "Dockerfile:3:", "no such file"),
    ("FROM debian:12\nWORKDIR /usr/local/app", "Dockerfile:2:", "read-only runtime"),
    ("FROM debian:12\nRUN mkdir -p /opt/x\nWORKDIR /app", "Dockerfile:2:", "mkdir -p outside the WORKDIR"),
    ("FROM debian:12\nWORKDIR /app\nRUN [\"apt-get\", \"install\", \"jq\"]", "Dockerfile:3:", "exec form"),
    ("FROM debian:12\nRUN apt-get install -y jq", "Dockerfile:", "no WORKDIR"),
])
def test_dockerfile_lines_outside_the_subset_are_refused(text, where, why, tmp_path):
  (tmp_path / "a.txt").write_text("A")
  with pytest.raises(DockerfileError) as caught:
    parse_dockerfile(text, str(tmp_path))
  assert str(caught.value).startswith(where) and why in str(caught.value), str(caught.value)


@pytest.mark.parametrize("text, message", [
    ("instruction: x\nmax_agent_timeout_sec: 60\ncheckout: main\n",
     "task.yaml:3: field 'checkout' is outside the supported subset"),
    ("instruction: x\nmax_test_timeout_sec: soon\n", "task.yaml:2: field 'max_test_timeout_sec'='soon' has the wrong type"),
    ("instruction: x\nmax_test_timeout_sec: -1\n", "task.yaml:2: field 'max_test_timeout_sec'=-1 must lie in"),
    ("instruction: x\nparser_name: swebench\n", "task.yaml:2: parser_name='swebench'"),
    ("descriptions:\n  - key: base\n    description: x\n", "task.yaml:1: field 'descriptions'"),
    ("author_name: me\n", "task.yaml: field 'instruction' is missing"),
    ("instruction: [unclosed\n", "task.yaml:2: not valid YAML"),
    ("instruction: x\nrun_tests_in_same_shell: 1\n", "task.yaml:2: field 'run_tests_in_same_shell'=1"),
])
def test_task_yaml_outside_the_subset_is_refused_naming_the_line(text, message):
  with pytest.raises(TaskError) as caught:
    tbench.parse_task_yaml(text)
  assert str(caught.value).startswith(message), str(caught.value)


def test_the_shipped_tasks_load_with_their_runtimes():
  tasks, broken = load_tasks([SHIPPED])
  assert broken == {} and len(tasks) == 12 and all(isinstance(t, tbench.TBenchTask) for t in tasks)
  by_id = {t.id: t for t in tasks}
  assert by_id["jq-users"].environment.runtime.debian == ("jq",)
  assert by_id["fix-median"].environment.runtime.debian == ("python3", "python3-pip", "python3-venv")
  assert by_id["env-config"].env == {"APP_MODE": "production", "APP_PORT": "9090"}
  assert {t.environment.workdir for t in tasks} == {"/app"}
  assert len({t.environment.runtime.digest for t in tasks}) == 5  # runtimes are shared by declaration
  assert [p for p, *_ in by_id["web-service"].setup_entries] == ["www", "www/index.html"]
  call = by_id["hello-file"].check_call()
  assert call["argv"] == ["bash", "/tests/run-tests.sh"] and "/tests/test_outputs.py" in call["files"]


def test_the_shipped_tasks_pass_the_quality_gate_and_planted_faults_do_not(tmp_path):
  _needs_sandbox_and_host_packages()
  for name, fault in (("no-op-solution", "solution"), ("always-passes", "tests"), ("flaky", "flaky")):
    folder = tmp_path / "faults" / name
    shutil.copytree(os.path.join(SHIPPED, "hello-file"), folder)
    if fault == "solution":
      (folder / "solution.sh").write_text("true\n")
    elif fault == "tests":
      (folder / "run-tests.sh").write_text("exit 0\n")
    else:
      (folder / "run-tests.sh").write_text("[ -f /tmp/ran ] && exit 1; touch /tmp/ran; "
                                           "python3 -m unittest discover -s \"$TEST_DIR\" -p 'test_*.py'\n")
  report = run_gate([SHIPPED, str(tmp_path / "faults")], k=1, repeats=2, runtime="host")
  assert report["tasks"] == 15
  assert sorted(report["quarantined"]) == ["always-passes", "flaky", "no-op-solution"], report["reasons"]
  assert "the tests fail after the solution" in report["reasons"]["no-op-solution"]
  assert "the tests pass when nothing was done" in report["reasons"]["always-passes"]
  assert "flaky tests" in report["reasons"]["flaky"]


def test_the_shipped_tasks_are_a_multi_turn_rl_domain(tmp_path):
  """A registry file names the folder as a terminal domain: examples carry the task and its runtime
  mode; TerminalEnv plays an episode in the task's session (its runtime, /app, ENV, files) whose
  service, started in turn 1, answers the tests at the end."""
  domains = tmp_path / "domains.jsonl"
  domains.write_text(json.dumps({"name": "tbench", "source": f"tasks:{SHIPPED}", "reward": "terminal",
                                 "weight": 1.0, "max_turns": 4, "timeout_s": 20, "runtime": "host"}) + "\n")
  mixture = DomainMixture(load_domains(str(domains)), seed=0)
  examples = mixture.take(40)
  assert {e["task_id"] for e in examples} <= {t.id for t in load_tasks([SHIPPED])[0]}
  assert all(e["verifier"] == "terminal" and e["runtime"] == "host" and e["max_turns"] == 4
             and e["task_format"] == "tbench" for e in examples)
  _needs_sandbox_and_host_packages()
  example = dict(next(e for e in examples), task_dir=os.path.join(SHIPPED, "web-service"),
                 task_id="web-service")
  turns = iter(["<cmd>echo $HOME; ls</cmd>",
                "<cmd>python3 -m http.server 8000 --bind 127.0.0.1 --directory www >/dev/null 2>&1 &"
                "</cmd>", "<cmd>sleep 1; cd www</cmd>", "<done>"])
  episode = run_episode(TerminalEnv(call_timeout_s=20), example, lambda conversation: next(turns),
                        Budget(max_turns=4))
  assert episode.reward == 1.0 and episode.env_failure is None, episode
  assert episode.messages[2]["content"].startswith("/app\nwww\n")
  unsolved = run_episode(TerminalEnv(call_timeout_s=20), example, lambda c: "<done>", Budget(max_turns=2))
  assert unsolved.reward == 0.0 and unsolved.env_failure is None
  with pytest.raises(ValueError, match="field 'runtime'='docker'"):
    domains.write_text(json.dumps({"name": "x", "source": f"tasks:{SHIPPED}", "reward": "terminal",
                                   "weight": 1.0, "runtime": "docker"}) + "\n")
    load_domains(str(domains))


def test_host_runtime_refuses_a_task_the_host_cannot_hold(tmp_path):
  folder = tmp_path / "needs"
  shutil.copytree(os.path.join(SHIPPED, "hello-file"), folder)
  (folder / "Dockerfile").write_text("FROM debian:bookworm\nRUN apt-get install -y nosuchpkg-meshrl\n"
                                     "WORKDIR /app\n")
  task = tbench.load_tbench_task(str(folder))
  with pytest.raises(ValueError, match="the host's /usr lacks Debian package nosuchpkg-meshrl"):
    tbench.resolve_runtime(task.environment.runtime, "host")
  with pytest.raises(ValueError, match="runtime mode 'docker'"):
    tbench.resolve_runtime(task.environment.runtime, "docker")
