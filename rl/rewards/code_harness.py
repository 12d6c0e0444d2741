"""The test harness the "code" reward runs inside the sandbox (stdlib only; sent as main.py).

Two processes, so the candidate never grades itself:
  parent (`python main.py`): makes itself non-dumpable (the child cannot read its memory), reads
    and deletes tests.json (nonce, tests, budget_s), starts the child, sends it only the calls,
    reads one JSON line per test from the child's fd 3 until the budget runs out, compares each
    returned value with the expected one strictly (same JSON type and value; the parent alone
    knows the expected values), and prints one line "<nonce> {"passed", "total", "errors"}".
  child (`python main.py --child`): execs solution.py as module "solution" (stdout to /dev/null),
    evaluates each call in a fresh copy of its namespace and writes {"i", "value"} or {"i",
    "error"} to fd 3; an assert-statement test (a str) writes {"i", "ok": true} when it runs
    without raising (such tests trust the child; structured tests do not).
A hang in one test loses only the tests after it; a crash loses nothing already reported.
"""

import json
import os
import select
import sys
import time

_MAX_RESULT_BYTES = 1 << 20


def _same(got, expected):
  """Strict equality over JSON values: bool is not int, 1 is not 1.0."""
  if type(got) is not type(expected):
    return False
  if isinstance(expected, list):
    return len(got) == len(expected) and all(map(_same, got, expected))
  if isinstance(expected, dict):
    return got.keys() == expected.keys() and all(_same(got[k], expected[k]) for k in expected)
  return got == expected


def _child():
  calls = json.loads(sys.stdin.read())

  def emit(record):
    try:
      line = json.dumps(record)
    except (TypeError, ValueError) as error:
      line = json.dumps({"i": record.get("i"), "error": f"result is not JSON: {error}"[:200]})
    os.write(3, (line + "\n").encode())

  namespace = {"__name__": "solution"}
  try:
    with open("solution.py", encoding="utf-8", errors="replace") as handle:
      source = handle.read()
    exec(compile(source, "solution.py", "exec"), namespace)  # pylint: disable=exec-used
  except BaseException as error:  # pylint: disable=broad-except
    emit({"load_error": f"{type(error).__name__}: {error}"[:300]})
    return
  for index, call in enumerate(calls):
    try:
      if call["assert"]:
        exec(call["code"], dict(namespace))  # pylint: disable=exec-used
        emit({"i": index, "ok": True})
      else:
        emit({"i": index, "value": eval(call["code"], dict(namespace))})  # pylint: disable=eval-used
    except BaseException as error:  # pylint: disable=broad-except
      emit({"i": index, "error": f"{type(error).__name__}: {error}"[:200]})


def _non_dumpable():
  try:
    import ctypes  # pylint: disable=import-outside-toplevel
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
  except Exception:  # pylint: disable=broad-except
    pass


def _start_child(calls):
  calls_r, calls_w = os.pipe()
  results_r, results_w = os.pipe()
  pid = os.fork()
  if pid == 0:
    try:
      devnull = os.open("/dev/null", os.O_WRONLY)
      os.dup2(calls_r, 0)
      os.dup2(devnull, 1)
      os.dup2(results_w, 3)
      os.closerange(4, 1 << 16)
      os.execv(sys.executable, [sys.executable, "-s", "main.py", "--child"])
    finally:
      os._exit(127)
  os.close(calls_r)
  os.close(results_w)
  os.write(calls_w, json.dumps(calls).encode())
  os.close(calls_w)
  return pid, results_r


def _read_results(fd, deadline):
  data = b""
  while len(data) < _MAX_RESULT_BYTES:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([fd], [], [], left)[0]:
      break
    chunk = os.read(fd, 1 << 16)
    if not chunk:
      break
    data += chunk
  return data


def _parent():
  _non_dumpable()
  with open("tests.json", encoding="utf-8") as handle:
    spec = json.load(handle)
  os.remove("tests.json")
  nonce, tests = spec["nonce"], spec["tests"]
  deadline = time.monotonic() + float(spec["budget_s"])
  calls = [{"assert": isinstance(t, str), "code": t if isinstance(t, str) else t["call"]}
           for t in tests]
  pid, results_r = _start_child(calls)
  data = _read_results(results_r, deadline)
  try:
    os.kill(pid, 9)
  except ProcessLookupError:
    pass
  os.waitpid(pid, 0)
  records, errors = {}, []
  for line in data.decode("utf-8", errors="replace").splitlines():
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if isinstance(record, dict) and "load_error" in record and not errors:
      errors.append(f"solution.py: {record['load_error']}")
    index = record.get("i") if isinstance(record, dict) else None
    if isinstance(index, int) and index not in records:
      records[index] = record
  passed = 0
  for index, test in enumerate(tests):
    record = records.get(index, {})
    if isinstance(test, str):
      ok = record.get("ok") is True
    else:
      ok = "value" in record and _same(record["value"], test["expected"])
    passed += ok
    if not ok and len(errors) < 3:
      errors.append(f"test {index}: " + str(record.get("error", "no result" if not record
                                                           else "wrong value"))[:200])
  summary = {"passed": passed, "total": len(tests), "errors": errors}
  sys.stdout.write(f"{nonce} {json.dumps(summary)}\n")
  sys.stdout.flush()


if __name__ == "__main__":
  if sys.argv[1:] == ["--child"]:
    _child()
  else:
    _parent()
