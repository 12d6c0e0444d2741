"""rl/envs/tools.py and TerminalEnv with tool calls: the standard tools run in the episode's session
(paths follow the shell's directory), task-defined tools get their arguments, every malformed or
unknown call or bad argument is an error observation (never an exception), `submit` grades the
episode; the Qwen3 chat template renders the tools and the results around the episode."""

import json

import pytest

from meshrl.model.chat_template import load_chat_template
from meshrl.model.tool_calls import format_call
from meshrl.rl.envs.episode import Budget, run_episode
from meshrl.rl.envs.terminal import EPISODE_LIMITS, TerminalEnv, load_task
from meshrl.rl.envs.tools import BASH, task_tool, Toolbox
from meshrl.rl.sandbox import SandboxUnavailable, Session, SessionPool, SessionSpec


@pytest.fixture
def session():
  try:
    box = Session.start(SessionSpec(EPISODE_LIMITS))
  except SandboxUnavailable as error:  # CI installs bubblewrap (.ci/run); a laptop may not.
    pytest.skip(f"bubblewrap unavailable (apt-get install -y bubblewrap): {error}")
  yield box
  box.close()


def _turn(*calls):
  return "I will act.\n" + "\n".join(format_call(name, args) for name, args in calls)


def test_standard_tools_share_the_session_and_its_directory(session):
  toolbox = Toolbox.standard()
  out = toolbox.step(_turn(("bash", {"command": "mkdir -p src && cd src && X=1"}),
                           ("write_file", {"path": "a.txt", "content": "héllo\n"}),
                           ("read_file", {"path": "../src/a.txt"}),
                           ("bash", {"command": "pwd; cat a.txt; echo $X"})), session, timeout_s=5)
  assert out.errors == 0 and out.calls == 4 and not out.submitted
  assert [m["name"] for m in out.messages] == ["bash", "write_file", "read_file", "bash"]
  assert [m["tool_call_id"] for m in out.messages] == ["call_0_0", "call_0_1", "call_0_2", "call_0_3"]
  assert out.messages[2]["content"] == "héllo\n"
  assert out.messages[3]["content"] == "/work/src\nhéllo\n1\n[exit 0]"
  slow = toolbox.step(_turn(("bash", {"command": "sleep 30", "timeout": 0.3})), session, timeout_s=5)
  assert slow.messages[0]["content"].startswith("[timed out after")


def test_bad_calls_become_error_observations(session):
  toolbox = Toolbox.standard(extra=[task_tool("greet", "Greets.", {
      "type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]},
      "echo \"hi $TOOL_WHO\"; echo \"$MESHRL_TOOL_ARGS\"")])
  out = toolbox.step(_turn(("nope", {}), ("bash", {"cmd": "ls"}), ("read_file", {"path": "missing"}),
                           ("write_file", {"path": "/usr/x", "content": "x"}),
                           ("greet", {"who": "you & me"}), ("submit", {"answer": "42"}),
                           ("bash", {"command": "touch late"}))
                     + "<tool_call>{oops}</tool_call>", session, timeout_s=5)
  contents = [m["content"] for m in out.messages]
  assert contents[0] == "error: unknown tool 'nope'; available: bash, greet, read_file, submit, write_file"
  assert contents[1].startswith("error: arguments of bash do not match its schema: arguments lacks the "
                                "required 'command'; arguments has the unknown property 'cmd'")
  assert contents[2].startswith("error: read_file:") and "No such file" in contents[2]
  assert contents[3].startswith("error: write_file:") and "Read-only file system" in contents[3]
  assert contents[4] == 'hi you & me\n{"who": "you & me"}\n[exit 0]'
  assert contents[5] == "submitted" and out.submitted and out.answer == "42"
  assert contents[6] == contents[7] == "error: not run: the task was already submitted"
  assert out.errors == 6 and out.calls == 8
  assert session.run("ls late 2>&1").exit_code != 0  # the call after submit did not run
  empty = toolbox.step("I think the answer is 42.", session, timeout_s=5)
  assert empty.errors == 1 and empty.messages[0]["content"].startswith("error: no tool call")


def _task(tmp_path):
  folder = tmp_path / "t"
  folder.mkdir()
  (folder / "task.json").write_text(json.dumps({
      "id": "tools", "domain": "term_tools", "max_turns": 4, "timeout_s": 10,
      "prompt": "Start a server on 127.0.0.1:7100 answering 'ok' and note its port in port.txt."}))
  (folder / "check.sh").write_text(
      "[ \"$(cat port.txt)\" = 7100 ] && python3 -c \"import socket, sys; sys.exit(socket.create_"
      "connection(('127.0.0.1', 7100), timeout=2).recv(9) != b'ok')\"\n")
  (folder / "oracle.sh").write_text("true\n")
  return load_task(str(folder))


SERVER = ("python3 -c \"import socket\ns = socket.socket(); s.bind(('127.0.0.1', 7100)); s.listen()\n"
          "while True:\n  c, _ = s.accept(); c.sendall(b'ok'); c.close()\" >/dev/null 2>&1 & sleep 0.5")


def test_a_tool_call_episode_through_the_qwen3_template(tmp_path, hf_fixtures):
  """The prompt offers the tools through Qwen3's template; the policy's turns are tool calls as the
  template writes them; observations are the results rendered by the template; submit grades."""
  hf_fixtures.save_tokenizer(str(tmp_path / "tok"), chat_template=hf_fixtures.QWEN3_CHAT_TEMPLATE)
  template = load_chat_template(str(tmp_path / "tok"))
  task = _task(tmp_path)
  try:
    pool = SessionPool(SessionSpec(EPISODE_LIMITS), warm=0)
  except SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable (apt-get install -y bubblewrap): {error}")
  env = TerminalEnv(pool, toolbox=Toolbox.standard())
  prompt = env.toolbox.render(template, [{"role": "user", "content": task.prompt}])
  assert json.dumps(BASH.schema(), ensure_ascii=False) in prompt and [t["function"]["name"] for t in env.tools] == [
      "bash", "read_file", "write_file", "submit"]
  turns = iter([_turn(("bash", {"command": SERVER})), "no call, just talk",
                _turn(("write_file", {"path": "port.txt", "content": "7100"}), ("submit", {}))])
  observations = []

  def policy(conversation):
    if conversation[-1]["role"] == "tool":
      observations.append(conversation[-1]["content"])
    return next(turns)

  with pool:
    episode = run_episode(env, task, policy, Budget(max_turns=4))
  assert episode.reward == 1.0 and episode.end == "done", episode
  assert episode.malformed_calls == 1  # the turn without a call
  assert observations[0] == "\n<tool_response>\n[1] 3\n[exit 0]\n</tool_response>\n"  # bash's job notice
  assert "error: no tool call" in observations[1]
  rendered = env.toolbox.observation(template, episode.info["tool_messages"])
  assert rendered == ("<|im_start|>user\n<tool_response>\nwrote 4 bytes to port.txt\n</tool_response>\n"
                      "<tool_response>\nsubmitted\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_the_turn_limit_still_grades_a_tool_episode(tmp_path):
  try:
    pool = SessionPool(SessionSpec(EPISODE_LIMITS), warm=0)
  except SandboxUnavailable as error:
    pytest.skip(f"bubblewrap unavailable (apt-get install -y bubblewrap): {error}")
  with pool:
    episode = run_episode(TerminalEnv(pool, toolbox=Toolbox.standard()), _task(tmp_path),
                          lambda c: _turn(("bash", {"command": "echo 7100 > port.txt"})), Budget(max_turns=2))
  assert episode.end == "max_turns" and episode.reward == 0.0 and episode.env_failure is None
