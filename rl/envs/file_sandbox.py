"""The files_copy family (rl/envs/file_tasks.py) run in the real sandbox: rl.env_backend = "sandbox".

  env = FileSandboxEnv()                 # a TerminalEnv (rl/envs/terminal.py)
  env.reset(example)                     # a persistent bubblewrap session, q.txt written into /work
  env.step("<cmd>cat q.txt</cmd>")       # run by the session's bash -> "owl\\n[exit 0]"
  env.step("<cmd>echo owl > f.txt</cmd>")
  env.step("<done>")                     # the check, run by the harness beside the shell -> reward 1

An example becomes a `FileCopyTask`, which speaks TerminalEnv's task protocol (session_spec,
setup_entries, env, check_call, id, prompt, max_turns, timeout_s), so the episode takes the one
sandbox path terminal task directories take: the same session pool, per-command timeouts, session
limits and failure classes. The check (the target file holds exactly the word and a newline, the
in-memory FileTaskEnv's verdict) runs as a check of the session, where the policy cannot forge its
exit status; the word reaches it in the check's environment, never in the work directory.

Observations are the real shell's: the command's output and its exit status (terminal.observation_text),
so the warm start (rl/step/episode_collect.Demonstrations, which runs oracle episodes in the run's
environment) shows the policy the sandbox's observations too.
"""

from __future__ import annotations

import dataclasses
import os

from meshrl.rl.envs import file_tasks
from meshrl.rl.envs.terminal import TerminalEnv
from meshrl.rl.sandbox import Limits, SandboxUnavailable, check_bwrap
from meshrl.rl.sandbox.bwrap import Runtime
from meshrl.rl.sandbox.session import UID_BASE
from meshrl.rl.sandbox.session import SessionSpec

BACKENDS = ("memory", "sandbox")  # rl.env_backend: where generated multi-turn families run
COMMAND_TIMEOUT_S = 5.0  # seconds one command (and the check) may run
# Exits 0 when the target holds exactly "$ANSWER\n" (the trailing "x" keeps $(...) from eating newlines).
CHECK = '[ -f "$TARGET" ] && [ "$(cat -- "$TARGET"; printf x)" = "$(printf "%s\\nx" "$ANSWER")" ]'


@dataclasses.dataclass(frozen=True)
class FileCopyTask:
  """A files_copy example as a terminal task (TerminalEnv's task protocol)."""
  prompt: str
  files: tuple  # ((name, text), ...) written into the work directory
  target: str
  answer: str
  max_turns: int
  timeout_s: float = COMMAND_TIMEOUT_S
  id: str = file_tasks.FAMILY

  @classmethod
  def of(cls, example: dict) -> "FileCopyTask":
    if not isinstance(example, dict) or not isinstance(example.get("files"), dict):
      raise ValueError(f"FileSandboxEnv takes a {file_tasks.FAMILY} example with 'files', got {example!r:.80}.")
    return cls(prompt=example["prompt"], files=tuple(sorted(example["files"].items())),
               target=example["target"], answer=example["answer"],
               max_turns=int(example.get("max_turns", file_tasks.MAX_TURNS)),
               id=f"{file_tasks.FAMILY}:{example['prompt']}")

  def session_spec(self, limits: Limits) -> SessionSpec:
    return SessionSpec(limits)

  @property
  def setup_entries(self) -> tuple:
    return tuple((name, "f", 0o644, text.encode()) for name, text in self.files)

  @property
  def env(self) -> dict:
    return {}

  def check_call(self) -> dict:
    return {"argv": ["bash", "-c", CHECK, "check"], "env": {"TARGET": self.target, "ANSWER": self.answer},
            "timeout_s": self.timeout_s}


class FileSandboxEnv(TerminalEnv):
  """TerminalEnv over files_copy examples: reset(example) runs the example as a FileCopyTask."""

  def reset(self, task) -> str:
    return super().reset(FileCopyTask.of(task) if isinstance(task, dict) else task)


def file_env(example: dict):
  """The environment of a files_copy example: FileSandboxEnv when it says "backend": "sandbox"
  (TaskPool stamps rl.env_backend on its examples), else the in-memory FileTaskEnv."""
  backend = example.get("backend", "memory")
  if backend not in BACKENDS:
    raise ValueError(f"example backend={backend!r} is not one of {BACKENDS} (rl.env_backend).")
  return FileSandboxEnv() if backend == "sandbox" else file_tasks.FileTaskEnv()


def check_backend_runs(backend: str) -> None:
  """Before a run starts: with rl.env_backend = "sandbox", bubblewrap must start a session here (the
  probe sessions run: as an unprivileged uid when this process is root). ValueError in one line
  naming the field and why, else every episode would fail its environment one by one."""
  if backend != "sandbox":
    return
  try:
    check_bwrap(Runtime.host(), uid=UID_BASE if os.geteuid() == 0 else None)
  except SandboxUnavailable as error:
    raise ValueError(f"rl.env_backend='sandbox' cannot run here: {' '.join(str(error).split())} "
                     "(rl.env_backend=memory runs the same tasks in an in-memory shell).") from None
