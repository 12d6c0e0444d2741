#!/usr/bin/env bash
# The generation and RL-step benchmarks of issue 30 on one accelerator host (a GPU or a TPU VM), in
# one command, each part under its own time limit so that one slow or failing part costs only itself.
#
#   bash scripts/bench_accelerator.sh OUT_DIR [OLD_PARENT]
#
# OUT_DIR receives each part's JSON and log: speed.json (scripts/bench_speed.py: plain decoding
# against draft and n-gram speculation at batch 1, in an RL generator and in the server),
# episodic.json (scripts/bench_rollout.py --sections episodic), rl_peer.json (scripts/bench_rl.py at
# configs/tiny.py:peer: the rollout phase against the bare sampler), and agent_new.jsonl, with
# OLD_PARENT also agent_old.jsonl: 40 steps of the agent demo (configs/tiny_agent.py, evaluation off;
# profile_summary.json: the new code's steps 41-43 traced, each compiled program's time),
# whose step times steps.txt tabulates (mean and median `step_wall_s` over steps 11-40, side by side, and the
# programs compiled in those steps where the run counts them). OLD_PARENT is
# a folder holding `meshrl`, an earlier checkout laid out as the package (e.g. `git archive 33e505b`
# unpacked into OLD_PARENT/meshrl); its own tiny_agent preset runs.
# Nothing outside OUT_DIR is written; the runs' work directories are temporary and removed after.
# The accelerator is the one JAX finds (JAX_PLATFORMS as set; unset = the default backend).
set -uo pipefail
out=${1:?usage: bench_accelerator.sh OUT_DIR [OLD_PARENT]}
old_parent=${2:-}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...: runs COMMAND under a limit, its output to OUT_DIR/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/parts.txt"
}

agent_steps() {  # agent_steps PARENT NAME [FLAGS...]: 40 steps of the demo of the meshrl under PARENT
  local parent=$1 name=$2; shift 2
  PYTHONPATH=$parent${PYTHONPATH:+:$PYTHONPATH} part "agent_$name" 170 "$python" "$parent/meshrl/scripts/rl.py" \
    --config="$parent/meshrl/configs/tiny_agent.py" --config.rl.num_steps=40 --config.eval.every=0 \
    --workdir="$scratch/agent_$name" "$@"
  cp "$scratch/agent_$name/metrics.jsonl" "$out/agent_$name.jsonl" 2>/dev/null
}

# The package as `meshrl` (an editable install maps the folders the same way; this needs none).
mkdir -p "$scratch/new" && ln -s "$here" "$scratch/new/meshrl"
"$python" -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/devices.txt"

# Steps 41-43 of the new code are traced (train/profile.py) after the 40 that steps.txt times: the
# time of each compiled program, for where the accelerator's step goes (profile_summary.json).
agent_steps "$scratch/new" new --config.rl.num_steps=43 --config.log.profile_start=41
cp "$scratch/agent_new/profile/summary.json" "$out/profile_summary.json" 2>/dev/null
[ -n "$old_parent" ] && agent_steps "$old_parent" old
"$python" - "$out" <<'PY' | tee "$out/steps.txt"
import json, os, sys
for name in ("new", "old"):
  path = os.path.join(sys.argv[1], f"agent_{name}.jsonl")
  if not os.path.exists(path):
    continue
  rows = [json.loads(line) for line in open(path)]
  # step_wall_s: the loop's wall time per step, checkpoint and hooks included (since 982b859); a
  # checkout without it is read by time_s, which is the loop's time only for a synchronous step.
  field = "step_wall_s" if all("step_wall_s" in r for r in rows if "time_s" in r) else "time_s"
  times = sorted(r[field] for r in rows if 11 <= r.get("step", 0) <= 40)
  compiles = {r["step"]: r["compiles"] for r in rows if r.get("step") in (10, 40) and "compiles" in r}
  if times:
    median = (times[(len(times) - 1) // 2] + times[len(times) // 2]) / 2
    grew = f", {compiles[40] - compiles[10]} compiles" if len(compiles) == 2 else ""
    print(f"agent {name}: mean step {sum(times) / len(times):.4f} s, median {median:.4f} s over steps 11-40 "
          f"({field}, {len(times)} steps{grew})")
PY

export PYTHONPATH=$scratch/new${PYTHONPATH:+:$PYTHONPATH}
part speed 200 "$python" "$here/scripts/bench_speed.py" --only=speculative,ngram,server_speculative \
  --json "$out/speed.json"
part rl_peer 100 "$python" "$here/scripts/bench_rl.py" --config="$here/configs/tiny.py:peer" \
  --config.mesh.fsdp=1 --steps 6 --json "$out/rl_peer.json"
part episodic 100 "$python" "$here/scripts/bench_rollout.py" --sections episodic --repeats 2 \
  --json "$out/episodic.json"
cat "$out/parts.txt"
