"""Which mesh should a config use on a TPU topology? Enumerates the mesh shapes (stages included) that
divide the chips and split what each axis splits, estimates them from shapes, compiles the RL step's
programs for the most promising ones and the config's own mesh (rl/step/aot.py, on this CPU through libtpu),
and ranks them by projected RL step time among those that fit in 90% of a chip's HBM (rl/step/planner.py).

  python scripts/plan_layout.py --config=configs/paper_3t.py --topology=v5p:16x16x16 \
      --json runs/plan_paper_3t.json --markdown runs/plan_paper_3t.md
  python scripts/plan_layout.py --config=configs/v5e_8.py --topology=v5e:2x4 --top=2

JSON: {"config", "topology", "num_slices", "chips", "candidates": N, "estimated": [{sizes, bytes_per_chip,
step_s, bubble}, ...] (the cheapest 20 by estimate), "ranked": [{sizes, fits, step_s, steps: {step:
{total_gib, fits, projected_s, compute_s, ici_s, dcn_s, bubble}}, estimate_s, baseline}, ...] best first}.
`step_s` is update + prefill + rl.max_new_tokens x decode, each compute (model FLOPs at 40% MFU, over 1 -
bubble) plus the compiled program's per-chip ICI and DCN bytes over the links' bandwidths.

Exit status: 0 when a candidate fits; 1 when none does; 2 for bad input (an unknown topology or step, a
slice count the chips do not split into).
"""

import argparse
import dataclasses
import json
import os
import sys
import time

from meshrl.configs import cli


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:2x4, v5p:16x16x16")
  parser.add_argument("--num_slices", type=int, default=1, help="slices joined over DCN")
  parser.add_argument("--top", type=int, default=3, help="candidates to compile besides the config's own mesh")
  parser.add_argument("--steps", default="update,prefill,decode", help="programs compiled per candidate")
  parser.add_argument("--json", default="", help="write the plan here")
  parser.add_argument("--markdown", default="", help="write the table here")


def main(argv) -> int:
  args, cfg = cli.parse(argv, add_flags=_add_flags, description=__doc__)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from meshrl.rl.step import aot, planner  # pylint: disable=import-outside-toplevel  (imports jax)
  from meshrl.train.metrics import PEAK_FLOPS  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  steps = [s.strip() for s in args.steps.split(",") if s.strip()]
  try:
    unknown = [s for s in steps if s not in aot.STEPS]
    if unknown or args.top < 0:
      raise ValueError(f"--steps names unknown step(s) {unknown}; choose from {aot.STEPS}" if unknown
                       else f"--top={args.top} must be >= 0.")
    with cfg.unlocked():
      cfg.mesh.num_slices = args.num_slices
    devices = aot.topology_devices(args.topology, args.num_slices)
    kind = devices[0].device_kind
    hbm_bw, ici, dcn = planner.links(kind)
    peak = next(flops for name, flops in PEAK_FLOPS if name in kind)
    hbm = aot.hbm_bytes(devices[0])
    found = planner.candidates(cfg, len(devices))
  except (ValueError, RuntimeError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  estimates = [planner.estimate(cfg, sizes, num_chips=len(devices), peak=peak, hbm_bytes=hbm_bw, ici=ici, dcn=dcn)
               for sizes in found]
  limit = aot.HBM_FRACTION * hbm
  baseline = planner.baseline_sizes(cfg)
  if baseline not in found:
    print(f"# the config's own mesh {baseline} is not among the shapes (a -1, or one that does not split); "
          "ranked without it", flush=True)
    baseline = None
  chosen = planner.choose(estimates, top=args.top, limit_bytes=limit, baseline=baseline)
  print(f"# {args.config} on {args.topology} x{args.num_slices}: {len(devices)} chips; {len(found)} mesh shapes "
        f"divide them, {sum(e.bytes_per_chip <= limit for e in estimates)} estimated to fit; compiling "
        f"{len(chosen)}: the {args.top} fastest by estimate and the config's own mesh", flush=True)

  built = {}  # id(trial) -> (trial, its mesh, its model numbers): built once per candidate

  def compile_fn(trial, step):
    if id(trial) not in built:
      mesh = aot.topology_mesh(trial, devices)
      built[id(trial)] = (trial, mesh, aot.model_numbers(trial, mesh))
    _, mesh, numbers = built[id(trial)]
    report = aot.compile_step(step, trial, mesh, args.topology, numbers)
    gib = f"{report.per_chip['total'] / 2 ** 30:.1f} GiB" if report.per_chip else "out of memory"
    print(f"  {dict((a, trial.mesh[a]) for a in planner.MESH_AXES)} "
          f"{step}: {gib}, compiled in {report.compile_s:.0f} s", flush=True)
    return report

  ranked = planner.rank(cfg, chosen, compile_fn, steps=steps, ici=ici, dcn=dcn)
  table = planner.markdown(ranked)
  print("\n" + table + f"\n\n(wall {time.perf_counter() - start:.0f} s)")
  record = dict(config=args.config, topology=args.topology, num_slices=args.num_slices, chips=len(devices),
                candidates=len(found), steps=steps,
                estimated=[dataclasses.asdict(e) for e in sorted(estimates, key=lambda e: e.step_s)[:20]],
                ranked=[dataclasses.asdict(p) for p in ranked])
  for path, text in ((args.json, json.dumps(record, indent=2)), (args.markdown, table + "\n")):
    if path:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
  return 0 if ranked and ranked[0].fits else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
