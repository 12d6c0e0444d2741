"""A generated multi-turn family small enough for a tiny model: read a file, write its word elsewhere.

  prompt   "copy q.txt to f.txt:"            (the word is NOT in the prompt: it must be read)
  oracle   <cmd>cat q.txt</cmd>  -> "owl"
           <cmd>echo owl > f.txt</cmd>  -> ""
           <done>                -> check: f.txt holds "owl"

`FileTaskEnv` runs the episode in an in-memory file system with a four-command shell (`cat F`, `ls`,
`echo WORDS > F`, `echo WORDS >> F`): no sandbox process per call, so the agent demo
(configs/tiny_agent.py) spends its time on the model. With rl.env_backend = "sandbox" the same
examples run in the real sandbox instead (rl/envs/file_sandbox.py: a persistent bubblewrap session
through TerminalEnv, as terminal task directories run).

`data.tasks="files_copy:1.0"` draws it through `TaskPool` (rl/step/episodes.py `episode_pools`), with the
held-out hash split of every family; `oracle_turns(example)` is the reference episode, which
rl/step/episode_collect.Demonstrations renders as warm-start rows.
"""

from __future__ import annotations

import shlex
import string

import numpy as np

from meshrl.rl.envs.base import CMD_CLOSE, CMD_OPEN, DONE, StepResult, parse_action

VERIFIER = "files"
FAMILY = "files_copy"
MAX_TURNS = 4
LEVELS = 3
_NAMES = string.ascii_lowercase
_WORDS = ("red", "sky", "oak", "ice", "fox", "jam", "owl", "ink", "gem", "bee", "elm", "fig", "yak", "zen",
          "ray", "dew")


def copy_task(rng: np.random.Generator, difficulty: int) -> dict:
  """{"prompt": "copy q.txt to f.txt:", "files": {"q.txt": "owl\\n"}, "target": "f.txt", "answer": "owl"}.

  Difficulty 1: one of 16 short words; 2: three random letters; 3: five."""
  src, dst = (f"{_NAMES[i]}.txt" for i in rng.choice(len(_NAMES), size=2, replace=False))
  if difficulty == 1:
    word = str(_WORDS[int(rng.integers(len(_WORDS)))])
  else:
    word = "".join(_NAMES[i] for i in rng.integers(0, len(_NAMES), size=3 if difficulty == 2 else 5))
  return {"prompt": f"copy {src} to {dst}:", "files": {src: word + "\n"}, "target": dst, "answer": word,
          "max_turns": MAX_TURNS}


class TaskPool:
  """The family as a random-access pool of examples (example i from rng [seed, i], stamped with
  domain, verifier, difficulty and the backend its episodes run in, rl.env_backend: "memory"
  (FileTaskEnv) or "sandbox" (rl/envs/file_sandbox.py)): what TaskMixture's `pools` take, so
  `data.tasks="files_copy:1.0"` draws it with the usual hash split of held-out prompts, without touching
  the single-turn DOMAINS registry (this family has no single-turn verifier)."""

  def __init__(self, difficulty: int = 1, seed: int = 0, backend: str = "memory"):
    if not 1 <= difficulty <= LEVELS:
      raise ValueError(f"data.difficulty={difficulty} for {FAMILY!r} must lie in 1..{LEVELS}.")
    self.difficulty, self.seed, self.backend = difficulty, seed, backend

  def __len__(self) -> int:
    return 2 ** 31

  def __getitem__(self, index: int) -> dict:
    example = copy_task(np.random.default_rng([self.seed, int(index)]), self.difficulty)
    return {**example, "domain": FAMILY, "verifier": VERIFIER, "difficulty": self.difficulty,
            "backend": self.backend}


def _shell(files: dict[str, str], command: str) -> str:
  """Runs one command of the four-command shell on `files` (changed in place); returns its output."""
  try:
    words = shlex.split(command)
  except ValueError as error:
    return f"sh: {error}\n"
  if not words:
    return ""
  if words[0] == "ls" and len(words) == 1:
    return "".join(name + "\n" for name in sorted(files))
  if words[0] == "cat" and len(words) == 2:
    if words[1] not in files:
      return f"cat: {words[1]}: No such file\n"
    return files[words[1]]
  if words[0] == "echo" and len(words) >= 3 and words[-2] in (">", ">>"):
    name, text = words[-1], " ".join(words[1:-2]) + "\n"
    files[name] = (files.get(name, "") if words[-2] == ">>" else "") + text
    return ""
  return f"sh: {words[0]}: not supported here (cat F, ls, echo W > F, echo W >> F)\n"


class FileTaskEnv:
  """A `files_copy` example as an environment (rl/envs/base.py interface): reward 1 when, at `<done>`
  or the turn limit, the target file holds the word on one line."""

  def __init__(self):
    self.files: dict[str, str] = {}
    self.example: dict | None = None
    self.turns = 0

  def reset(self, example: dict) -> str:
    if not isinstance(example, dict) or not isinstance(example.get("files"), dict):
      raise ValueError(f"FileTaskEnv takes a {FAMILY} example with 'files', got {example!r:.80}.")
    self.example, self.files, self.turns = example, dict(example["files"]), 0
    return example["prompt"]

  def _check(self) -> StepResult:
    example, self.example = self.example, None
    solved = self.files.get(example["target"]) == example["answer"] + "\n"
    return StepResult("", 1.0 if solved else 0.0, True, {"solved": solved, "turns": self.turns})

  def step(self, action_text: str) -> StepResult:
    if self.example is None:
      raise RuntimeError("step() before reset() or after the episode ended.")
    self.turns += 1
    action = parse_action(action_text)
    if action.kind == "done":
      return self._check()
    if action.kind == "error":
      result = StepResult(f"error: {action.error}", 0.0, False, {"error": action.error})
    else:
      result = StepResult(_shell(self.files, action.command), 0.0, False, {})
    if self.turns >= int(self.example.get("max_turns", MAX_TURNS)):
      return self._check()
    return result


def oracle_turns(example: dict) -> list[str]:
  """The reference episode's policy turns."""
  src = next(iter(example["files"]))
  return [f"{CMD_OPEN}cat {src}{CMD_CLOSE}", f"{CMD_OPEN}echo {example['answer']} > {example['target']}"
          f"{CMD_CLOSE}", DONE]
