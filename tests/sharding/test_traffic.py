"""sharding/traffic.py: replica groups in every spelling XLA writes, loop bodies counted as they run, and
the bytes a chip sends per collective."""

from meshrl.sharding import traffic


def test_replica_groups_reads_every_spelling():
  assert traffic.replica_groups("x replica_groups={{0,4},{1,5}}, y") == [{0, 4}, {1, 5}]
  assert traffic.replica_groups("x replica_groups=[4,2]<=[2,4]T(1,0), y") == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
  assert traffic.replica_groups("x replica_groups=[2,4]<=[8], y") == [{0, 1, 2, 3}, {4, 5, 6, 7}]
  line = "x replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}"
  assert traffic.replica_groups(line) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
  line = "x replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, dimensions={0}"
  assert traffic.replica_groups(line) == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
  line = "x replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, dimensions={0}"
  assert traffic.replica_groups(line) == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]


HLO = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8] get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp())/dot_general"}
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

ENTRY %main (a: f32[8]) -> f32[32] {
  %a = f32[8] parameter(0)
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  %ag = f32[32]{0} all-gather(%a), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, metadata={op_name="jit(f)/all_gather"}
  %rs = f32[2]{0} reduce-scatter(%a), replica_groups=[1,4]<=[4], dimensions={0}, metadata={op_name="jit(f)/grad_reduce/psum"}
  ROOT %cp = f32[32]{0} collective-permute(%ag), source_target_pairs={{0,4},{4,0}}
}
"""


def test_traffic_counts_loops_groups_and_links():
  """The loop's all-reduce runs 6 times (its condition's bound): 2 x 32 B x 3/4 each; the all-gather
  over pairs that cross slices (devices 0-3 on slice 0) sends 32 B x 1/2 over DCN; the reduce-scatter
  3 x 8 B; the permute 128 B, across slices. Gradient bytes: the backward all-reduce and the scoped
  reduce-scatter; the explicit ones (sharding/compress.py's scope) the reduce-scatter alone."""
  assert traffic.loop_counts(HLO) == {"main": 1, "cond": 6, "body": 6}
  sent = traffic.traffic(HLO, slice_of=lambda d: d // 4)
  assert sent.by_op == {"all-reduce": 6 * 48.0, "all-gather": 64.0, "reduce-scatter": 24.0,
                        "collective-permute": 128.0}
  assert sent.dcn == 64.0 + 128.0 and sent.ici == 6 * 48.0 + 24.0
  assert sent.grad == 6 * 48.0 + 24.0
  assert sent.explicit == 24.0  # only the grad_reduce-scoped reduce-scatter is compress.py's


def test_megascale_sends_count_over_dcn():
  """On a multi-slice topology XLA hands a collective's slice-crossing part to the megascale runtime as
  a host send: its buffer counts over DCN, as the collective its transfer type names."""
  line = ('  %send.14 = (f32[1,2,128,64]{2,3,1,0:T(8,128)}, u32[], token[]) send(%param.16, %after-all.14), '
          'channel_id=30, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
          '"xla_megascale_runtime",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}')
  hlo = "ENTRY %main (a: f32[8]) -> f32[8] {\n" + line + "\n}\n"
  sent = traffic.traffic(hlo)
  assert sent.by_op == {"all-reduce": 65536.0} and sent.dcn == 65536.0 and sent.ici == 0.0
  assert sent.grad == 65536.0


def test_unnamed_reductions_are_gradients_only_in_a_program_with_a_backward():
  """An all-reduce without op_name (how TPU HLO writes the partitioner's own weight-gradient reductions)
  counts as a gradient reduction where the program has a backward pass, and not in a forward-only one
  (a decode step's all-reduces reduce activations)."""
  unnamed = "  %ar = f32[8]{0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%add"
  forward = "ENTRY %main (a: f32[8]) -> f32[8] {\n" + unnamed + "\n}\n"
  assert traffic.traffic(forward).grad == 0.0 and traffic.traffic(forward).ici == 32.0
  backward = forward.replace("}\n", '  %g = f32[8]{0} add(%a, %a), metadata={op_name="jit(f)/transpose(jvp())/add"}\n}\n')
  assert traffic.traffic(backward).grad == 32.0  # 2 x 32 B x 1/2
