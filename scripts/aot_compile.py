"""Will it fit? Compiles the real RL programs for a TPU topology on this CPU and reports per chip.

  python scripts/aot_compile.py --config=configs/paper_3t.py --topology=v5p:16x16x16 --step=all \
      --json runs/aot_paper_3t.json --markdown runs/aot_paper_3t.md
  python scripts/aot_compile.py --config=configs/tiny.py --config.mesh.fsdp=4 --topology=v5e:2x2 \
      --step=update

The mesh (cfg.mesh, per slice) is laid over the topology's compile-only devices by `make_mesh`;
inputs are abstract (shapes and shardings, nothing allocated); the programs are the ones a run
jits: the RL update (rl/algo/update.py), the prefill of a prompt of rl.max_prompt_len tokens and one
decode step against a cache of rl.max_prompt_len + rl.max_new_tokens slots (rl/generation/core.py), and the
SFT step (train/sft.py). See rl/step/aot.py for what each figure means.

JSON: a list with one object per step: {step, topology, chips, mesh, per_chip: {argument, output,
temp, code, alias, total}, hbm_per_chip, fits, flops, model_flops, tokens, collective_bytes,
projected_step_s, compile_s, diagnosis, microbatches, bubble_fraction, grad_collective_bytes,
ici_bytes, dcn_bytes, kv_host_bytes, kv_host_row_bytes, kv_host_rows, hbm_fraction, assumed_mfu,
flops_counting, projection}. kv_host_*: the decode step with a host tier (rl.kv_host_bytes > 0): one
paused slot row's bytes and how many rows the tier holds. rl.prefill_chunk > 0 compiles the
chunked prefill (its temporaries: one chunk's activations). grad_collective_bytes: what
one chip sends reducing the gradients per step (optim.grad_collective_dtype picks its wire format);
bubble_fraction: the pipeline's idle share with mesh.stage > 1 (the projection divides by 1 - it).
`flops` is XLA's cost analysis per chip, which counts a scan / while body ONCE (layers, epochs,
minibatches, ring steps); the projection uses `model_flops` (6 N_active + attention per token for
training, 2 N_active + attention for generation, times the step's tokens) at an assumed 40% MFU of
the chips' bf16 peak.

--count_params prints the parameter counts (total, active per token) from shapes and exits.

Exit status: 0 when every step fits in 90% of a chip's HBM; 1 when one does not (the reason, with
bytes needed vs available and the largest buffers, is printed and in the JSON); 2 for bad input
(an unknown topology, a mesh that does not match its chip count, an unknown step).
Needs libtpu (`pip install -e '.[tpu]'`); a TPU is not needed.
"""

import argparse
import json
import os
import sys
import time

from meshrl.configs import cli


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--topology", default="",
                      help="TPU topology, e.g. v5e:2x2, v5p:16x16x16 (needed unless --count_params)")
  parser.add_argument("--num_slices", type=int, default=1, help="slices joined over DCN")
  parser.add_argument("--step", default="all", help="update, prefill, decode, sft, reshard (rl.generation_layout's one-off cost), routes (routing replay's routes built on the devices), a comma list, or all")
  parser.add_argument("--json", default="", help="write the reports here")
  parser.add_argument("--markdown", default="", help="write the markdown table (docs/benchmarks.md's) here")
  parser.add_argument("--count_params", action="store_true",
                      help="print total and active parameters (from shapes) and exit")


def main(argv) -> int:
  args, cfg = cli.parse(argv, add_flags=_add_flags, description=__doc__)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from meshrl.rl.step import aot  # pylint: disable=import-outside-toplevel  (imports jax)
  try:
    numbers = aot.model_numbers(cfg)  # the run's model numbers (no layout yet): their checks (mesh.stage, ...) first
    counts = aot.parameter_counts_of(cfg, numbers)
  except ValueError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  print(f"# {args.config}: {counts['total']:.4g} parameters, {counts['active_per_token']:.4g} active "
        f"per token (from shapes)", flush=True)
  if args.count_params:
    return 0
  if not args.topology:
    raise ValueError("--topology is needed to compile (e.g. --topology=v5e:2x2); --count_params alone "
                     "needs none.")
  if args.num_slices < 1:
    raise ValueError(f"--num_slices={args.num_slices} must be at least 1.")
  steps = list(aot.default_steps(cfg, numbers)) if args.step == "all" else [s.strip() for s in args.step.split(",") if s.strip()]
  if cfg.mesh.num_slices != args.num_slices:
    cfg.unlock()
    cfg.mesh.num_slices = args.num_slices
    cfg.lock()
  start = time.perf_counter()
  try:
    devices = aot.topology_devices(args.topology, args.num_slices)
    mesh = aot.topology_mesh(cfg, devices)
    numbers = aot.model_numbers(cfg, mesh)  # laid out on the topology's mesh, once for every step
    unknown = [s for s in steps if s not in aot.STEPS]
    if unknown:
      raise ValueError(f"--step names unknown step(s) {unknown}; choose from {aot.STEPS} or all.")
  except (ValueError, RuntimeError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  print(f"# {args.config} on {args.topology} x{args.num_slices}: {len(devices)} chips, mesh "
        f"{dict(mesh.shape)}", flush=True)
  reports = []
  for step in steps:
    report = aot.compile_step(step, cfg, mesh, args.topology, numbers)
    reports.append(report)
    gib = (f"{report.per_chip['total'] / 2 ** 30:.2f} GiB" if report.per_chip
           else "out of VMEM" if "VMEM" in report.diagnosis else "out of HBM")
    hbm = f"{report.hbm_per_chip / 2 ** 30:.2f} GiB" if report.hbm_per_chip else "?"
    print(f"{step:>8}: {gib} per chip of {hbm} (fits: {report.fits}), compiled in "
          f"{report.compile_s:.0f} s", flush=True)
    if report.kv_host_rows is not None:
      print(f"          {aot.host_tier_line(report)}", flush=True)
    if report.diagnosis:
      print(f"          {report.diagnosis}", file=sys.stderr, flush=True)
  print("\n" + aot.markdown_table(reports))
  print(f"\n(wall {time.perf_counter() - start:.0f} s)")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump([r.to_json() for r in reports], f, indent=2)
  if args.markdown:
    os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
    with open(args.markdown, "w", encoding="utf-8") as f:
      f.write(aot.markdown_table(reports) + "\n")
  return 0 if all(r.fits is not False for r in reports) else 1


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
