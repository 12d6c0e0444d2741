"""Tool-call actions of agent episodes: the standard tools and task-defined ones, run in the
episode's sandbox session (rl/sandbox/session.py). The format (rendering, parsing, JSON schemas) is
model/tool_calls.py's.

  toolbox = Toolbox.standard(extra=[task_tool("run_tests", "Run the tests.", {...}, "pytest -q")])
  prompt = toolbox.render(template, [{"role": "user", "content": task}])   # tools offered
  outcome = toolbox.step(action_text, session, timeout_s=10.0)              # parse, check, run
  outcome.messages        # [{"role": "tool", "tool_call_id", "name", "content"}], one per call
  toolbox.observation(template, outcome.messages)  # the text to append after the policy's turn

Standard tools: `bash` (a command in the session's shell: cwd, variables and background jobs
persist), `read_file` and `write_file` (paths relative to the shell's current directory), `submit`
(ends the episode; the environment then grades it). A task-defined tool (`task_tool`) runs its shell
command in the session with the call's arguments as JSON in $MESHRL_TOOL_ARGS (and each scalar
argument as $TOOL_<NAME>), in a subshell so it leaves the shell's state alone.

Whatever the policy writes, `step` never raises: a turn without a call, a malformed block, an unknown
tool, arguments that do not match the tool's schema, or a tool that fails become error observations
(tool messages starting "error:", counted in `ToolOutcome.errors`); calls after a `submit` are not run.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import Callable, Sequence

from meshrl.model import tool_calls as fmt
from meshrl.rl.sandbox.session import CommandResult, Session

MAX_READ_BYTES = 64 << 10
Run = Callable[[Session, dict, float], str]  # (session, arguments, timeout_s) -> the tool's output


def command_text(result: CommandResult, cap: int = 4000) -> str:
  """A command's output as a tool result: the text (head and tail past `cap` characters) and its
  status ("[exit 0]", "[timed out after 10.0 s]", ...)."""
  text = (result.stdout + result.stderr).decode("utf-8", errors="replace")
  if len(text) > cap:
    text = text[:cap // 2] + "\n...\n" + text[-cap // 2:]
  if result.stdout_truncated or result.stderr_truncated:
    text += "\n[output truncated]"
  restarted = "; the shell was restarted in the work directory" if result.shell_restarted else ""
  return f"{text}[{result.describe()}{restarted}]"


def _bash(session: Session, arguments: dict, timeout_s: float) -> str:
  timeout = min(float(arguments.get("timeout", timeout_s)), timeout_s)
  return command_text(session.run(arguments["command"], timeout_s=timeout))


def _read_file(session: Session, arguments: dict, timeout_s: float) -> str:
  del timeout_s
  data, truncated = session.read_file(arguments["path"], max_bytes=int(arguments.get(
      "max_bytes", MAX_READ_BYTES)))
  return data.decode("utf-8", errors="replace") + ("\n[truncated]" if truncated else "")


def _write_file(session: Session, arguments: dict, timeout_s: float) -> str:
  del timeout_s
  session.write_files({arguments["path"]: arguments["content"]}, relative_to="shell")
  return f"wrote {len(arguments['content'].encode())} bytes to {arguments['path']}"


@dataclasses.dataclass(frozen=True)
class Tool:
  """A function tool: its OpenAI definition (name, description, JSON schema of the arguments) and
  how it runs in a session (None for `submit`, which the environment handles)."""
  name: str
  description: str
  parameters: dict
  run: Run | None

  def __post_init__(self):
    fmt.check_tools([self.schema()])

  def schema(self) -> dict:
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}


def _object(properties: dict, required: Sequence[str]) -> dict:
  return {"type": "object", "properties": properties, "required": list(required),
          "additionalProperties": False}


BASH = Tool("bash", "Run a shell command in the task's terminal (bash). The working directory, "
            "variables and background processes persist between calls.",
            _object({"command": {"type": "string", "minLength": 1, "description": "The command."},
                     "timeout": {"type": "number", "exclusiveMinimum": 0,
                                 "description": "Seconds it may run (capped by the task)."}},
                    ["command"]), _bash)
READ_FILE = Tool("read_file", "Read a text file (relative to the current directory).",
                 _object({"path": {"type": "string", "minLength": 1},
                          "max_bytes": {"type": "integer", "minimum": 1, "maximum": MAX_READ_BYTES}},
                         ["path"]), _read_file)
WRITE_FILE = Tool("write_file", "Write a text file (relative to the current directory), replacing it.",
                  _object({"path": {"type": "string", "minLength": 1}, "content": {"type": "string"}},
                          ["path", "content"]), _write_file)
SUBMIT = Tool("submit", "Finish the task; it is then checked.",
              _object({"answer": {"type": "string", "description": "A final answer, if the task "
                                  "asks for one."}}, []), None)
STANDARD = (BASH, READ_FILE, WRITE_FILE, SUBMIT)


def task_tool(name: str, description: str, parameters: dict, command: str) -> Tool:
  """A task-defined tool running `command` in the session (see the module docstring)."""
  if not isinstance(command, str) or not command.strip():
    raise ValueError(f"task tool {name!r}: command must be a non-empty shell command.")

  def run(session: Session, arguments: dict, timeout_s: float) -> str:
    exports = [f"export MESHRL_TOOL_ARGS={shlex.quote(json.dumps(arguments))}"]
    for key, value in arguments.items():
      if isinstance(value, (str, int, float, bool)) and key.isidentifier():
        exports.append(f"export TOOL_{key.upper()}={shlex.quote(str(value))}")
    return command_text(session.run(f"( {'; '.join(exports)}; {command}\n)", timeout_s=timeout_s))

  return Tool(name, description, parameters, run)


@dataclasses.dataclass
class ToolOutcome:
  """What one turn's calls did: a tool message per call (errors included), whether `submit` was
  called (and its answer), how many calls were errors."""
  messages: list = dataclasses.field(default_factory=list)
  submitted: bool = False
  answer: str | None = None
  errors: int = 0
  calls: int = 0


class Toolbox:
  """The tools of an episode (names unique; ValueError otherwise)."""

  def __init__(self, tools: Sequence[Tool]):
    self.tools = {tool.name: tool for tool in tools}
    if len(self.tools) != len(tools):
      raise ValueError(f"tool names {[t.name for t in tools]} repeat a name.")
    fmt.check_tools(self.schemas())

  @classmethod
  def standard(cls, extra: Sequence[Tool] = ()) -> "Toolbox":
    return cls(list(STANDARD) + list(extra))

  def schemas(self) -> list[dict]:
    return [tool.schema() for tool in self.tools.values()]

  def render(self, template, messages: Sequence[dict], **variables) -> str:
    """The prompt with the tools offered (by the chat template; plain text when it is None)."""
    return fmt.render_with_tools(template, messages, self.schemas(), **variables)

  def observation(self, template, messages: Sequence[dict]) -> str:
    """The text to append after the policy's turn: the tool results and the next prompt."""
    return fmt.render_tool_results(template, messages, self.schemas())

  def step(self, action_text, session: Session, *, timeout_s: float, turn: int = 0) -> ToolOutcome:
    """Parses `action_text`, checks each call, runs the good ones in `session` (never raises)."""
    outcome = ToolOutcome()
    parsed = fmt.parse_tool_calls(action_text)
    if not parsed:
      outcome.errors = 1
      outcome.messages.append(_message(f"call_{turn}_0", "none", "error: no tool call in this turn; "
                                       f"call one of {sorted(self.tools)} as {fmt.CALL_OPEN}"
                                       f"{{\"name\": ..., \"arguments\": {{...}}}}{fmt.CALL_CLOSE}"))
      return outcome
    for item in parsed:
      call_id = f"call_{turn}_{item.index}"
      outcome.calls += 1
      if outcome.submitted:
        outcome.messages.append(_message(call_id, getattr(item, "name", None) or "none",
                                         "error: not run: the task was already submitted"))
        outcome.errors += 1
        continue
      error, content = self._run(item, session, timeout_s)
      outcome.errors += error
      if not error and item.name == SUBMIT.name:
        outcome.submitted, outcome.answer = True, item.arguments.get("answer")
      outcome.messages.append(_message(call_id, getattr(item, "name", None) or "none", content))
    return outcome

  def _run(self, item, session: Session, timeout_s: float) -> tuple[bool, str]:
    """(is an error, the tool message's content) of one parsed block."""
    if isinstance(item, fmt.CallError):
      return True, f"error: {item.error}"
    tool = self.tools.get(item.name)
    if tool is None:
      return True, f"error: unknown tool {item.name!r}; available: {', '.join(sorted(self.tools))}"
    problems = fmt.check_arguments(tool.parameters, item.arguments)
    if problems:
      return True, f"error: arguments of {item.name} do not match its schema: {'; '.join(problems)}"
    if tool.run is None:
      return False, "submitted"
    try:
      return False, tool.run(session, item.arguments, timeout_s)
    except (OSError, ValueError) as error:  # a file that cannot be read or written, a bad path
      return True, f"error: {item.name}: {error}"
    except RuntimeError as error:  # the session ended (the environment sees it on the session)
      return True, f"error: {item.name}: {error}"


def _message(call_id: str, name: str, content: str) -> dict:
  return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
