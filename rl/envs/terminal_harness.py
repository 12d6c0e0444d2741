"""Runs inside the sandbox (stdlib only; never imported by meshrl): shell steps over a work directory.

rl/envs/terminal.py sends this file's text as `python3 -I -S -c <text>` with one JSON object on stdin:
  {"state": [entry...], "initial": [entry...] | null, "snapshot": bool, "max_state_bytes": int,
   "stop_after_timeout": bool (skip the steps after one that timed out),
   "steps": [{"script": str, "timeout": float, "reset": bool, "output_cap": int}, ...]}
where an entry is [relative path, "d" | "f" | "l", mode, base64 data (file) or link target (link)].

It writes `state` into /work, then for each step: when "reset", kills what is left, empties /work and
writes `initial`; writes the script to /tmp and runs `bash SCRIPT` in /work (stdin empty, stdout and
stderr together into a file in /tmp, the first output_cap bytes kept) in a session of its own, killed
with its group at the step's timeout; then kills every process the step left (no process outlives its
step; files do). At the end it prints one JSON line:
  {"steps": [{"exit": int | null, "signal": int | null, "timed_out": bool, "output": base64,
              "truncated": bool, "seconds": float}], "state": [entry...] | null, "state_error": str | null}
The caller treats that line as untrusted (the steps ran the policy's commands as this process's uid).
"""

import base64
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

WORK = "/work"


def _kill_leftovers():
  try:
    os.kill(-1, signal.SIGKILL)  # every process but PID 1 (the supervisor) and this one
  except ProcessLookupError:
    pass
  while True:
    try:
      if os.waitpid(-1, os.WNOHANG)[0] == 0:
        break
    except ChildProcessError:
      break


def _clear():
  for name in os.listdir(WORK):
    path = os.path.join(WORK, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      os.unlink(path)


def _write(entries):
  for path, kind, mode, data in entries:
    full = os.path.normpath(os.path.join(WORK, path))
    if not full.startswith(WORK + "/"):
      continue
    parent = os.path.dirname(full)
    os.makedirs(parent, exist_ok=True)
    if kind == "d":
      os.makedirs(full, exist_ok=True)
      os.chmod(full, mode & 0o7777 | 0o700)
    elif kind == "l":
      os.symlink(data, full)
    else:
      with open(full, "wb") as handle:
        handle.write(base64.b64decode(data))
      os.chmod(full, mode & 0o7777)


def _snapshot(limit):
  entries, total = [], 0
  for root, dirs, files in os.walk(WORK):
    for name in sorted(dirs) + sorted(files):
      full = os.path.join(root, name)
      rel = os.path.relpath(full, WORK)
      info = os.lstat(full)
      if stat.S_ISLNK(info.st_mode):
        entries.append([rel, "l", 0, os.readlink(full)])
      elif stat.S_ISDIR(info.st_mode):
        entries.append([rel, "d", stat.S_IMODE(info.st_mode), ""])
      elif stat.S_ISREG(info.st_mode):
        total += info.st_size
        if total > limit:
          return None, "the work directory holds more than %d bytes" % limit
        with open(full, "rb") as handle:
          entries.append([rel, "f", stat.S_IMODE(info.st_mode),
                          base64.b64encode(handle.read()).decode()])
  return entries, None


def _run_step(index, step):
  script = "/tmp/.meshrl-step-%d.sh" % index
  out_path = "/tmp/.meshrl-out-%d" % index
  with open(script, "w", encoding="utf-8", errors="surrogateescape") as handle:
    handle.write(step["script"])
  started = time.monotonic()
  with open(out_path, "wb") as out:
    proc = subprocess.Popen(["bash", script], cwd=WORK, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
      status = proc.wait(timeout=step["timeout"])
    except subprocess.TimeoutExpired:
      timed_out = True
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      status = proc.wait()
  seconds = time.monotonic() - started
  _kill_leftovers()
  with open(out_path, "rb") as out:
    output = out.read(step["output_cap"] + 1)
  for path in (script, out_path):
    try:
      os.unlink(path)
    except OSError:
      pass
  return {"exit": None if timed_out or status < 0 else status,
          "signal": -status if status < 0 and not timed_out else None, "timed_out": timed_out,
          "output": base64.b64encode(output[:step["output_cap"]]).decode(),
          "truncated": len(output) > step["output_cap"], "seconds": seconds}


def main():
  request = json.loads(sys.stdin.buffer.read())
  _write(request["state"])
  results = []
  for index, step in enumerate(request["steps"]):
    if step.get("reset"):
      _kill_leftovers()
      _clear()
      _write(request["initial"] or [])
    results.append(_run_step(index, step))
    if results[-1]["timed_out"] and request.get("stop_after_timeout"):
      break
  state, error = None, None
  if request.get("snapshot"):
    state, error = _snapshot(request["max_state_bytes"])
  sys.stdout.write(json.dumps({"steps": results, "state": state, "state_error": error}) + "\n")
  sys.stdout.flush()


if __name__ == "__main__":
  main()
