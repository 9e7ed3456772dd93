"""mx.hlo_collectives: the collectives (and values per device) in compiled HLO text."""

import meshax as mx


def count_collectives(text):
    return {k: v["count"] for k, v in mx.hlo_collectives(text).items()}


SAMPLE = """
ENTRY %main.0_spmd (param.2: f32[4,2], param.3: f32[4,2]) -> (f32[4,2], f32[4,2]) {
  %ppermute.3 = f32[4,2]{1,0} collective-permute(%param.2), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %all_gather.3 = f32[16,2]{1,0} all-gather(%param.2), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %reduce_scatter.7 = f32[1,2]{1,0} reduce-scatter(%param.3), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%region_2.0
  %all-to-all = (f32[1,2]{1,0}, f32[1,2]{1,0}, f32[1,2]{1,0}, f32[1,2]{1,0}) all-to-all(%a, %b, %c, %d), channel_id=1
  %all-reduce = (f32[4,2]{1,0}, f32[4,2]{1,0}, /*index=2*/f32[3]{0}) all-reduce(%param.2, %x, %y), channel_id=1, to_apply=%region_0.0
  %all-reduce.1 = f32[4,2]{1,0} all-reduce(%param.2), channel_id=2, to_apply=%region_0.0
  %ars = f32[8]{0} all-reduce-start(%p), channel_id=3, to_apply=%region_0.0
  %ard = f32[8]{0} all-reduce-done(%ars)
  %ags = (f32[2]{0}, f32[8]{0}) all-gather-start(%p), dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  %cps = (f32[2]{0}, f32[2]{0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,1}}
  %cpd = f32[2]{0} collective-permute-done(%cps)
  %gte = f32[4,2]{1,0} get-tuple-element(%all-reduce), index=0
  ROOT %t = (f32[4,2]{1,0}) tuple(%gte)
}
"""


def test_count_collectives_sample():
    assert count_collectives(SAMPLE) == {
        "allreduce": 3 + 1 + 1,
        "allgather": 2,
        "alltoall": 1,
        "reduce_scatter": 1,
        "permute": 2,
    }


def test_count_collectives_empty():
    assert count_collectives("ENTRY %main () -> f32[] {\n ROOT %c = f32[] constant(1)\n}") == {
        "allreduce": 0,
        "allgather": 0,
        "alltoall": 0,
        "reduce_scatter": 0,
        "permute": 0,
    }


def test_values_per_device_sample():
    values = {k: v["values"] for k, v in mx.hlo_collectives(SAMPLE).items()}
    assert values == {
        "allreduce": (8 + 8 + 3) + 8 + 8,  # the tuple's elements, then the two single ones
        "allgather": 16 * 2 // 4 + 8 // 1,  # result / group size (4; the start has no groups: 1)
        "alltoall": 4 * 2,
        "reduce_scatter": 2 * 4,  # result x group size
        "permute": 8 + 2,
    }


LOOPS = """
HloModule m
%sum (a: f32[], b: f32[]) -> f32[] {
  ROOT %add = f32[] add(%a, %b)
}
%inner_body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %ar = f32[2]{0} all-reduce(%x), channel_id=1, to_apply=%sum
}
%body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %ag = f32[8]{0} all-gather(%x), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %w2 = (s32[], f32[2]{0}) while(%t), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}
%cond (p: (s32[], f32[2])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
%data_body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %cp = f32[2]{0} collective-permute(%x), source_target_pairs={{0,1}}
}
%yes (p: f32[2]) -> f32[2] {
  %ar2 = f32[4]{0} all-reduce(%x), channel_id=3, to_apply=%sum
}
%no (p: f32[2]) -> f32[2] {
  ROOT %c = f32[2]{0} copy(%p)
}
ENTRY %main (param: f32[2]) -> f32[2] {
  %w = (s32[], f32[2]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"5"}}
  %w3 = (s32[], f32[2]{0}) while(%t1), condition=%cond, body=%data_body
  %c = f32[2]{0} conditional(%b, %param, %param), branch_computations={%yes, %no}
  %top = f32[2]{0} all-reduce(%param), channel_id=4, to_apply=%sum
}
"""


def test_per_run_counts_a_loop_body_times_its_trip_count():
    """The text holds each body once; one run runs the outer loop's body 5 times and the loop
    inside it 3 times each, a loop whose trip count the data decide once, each branch once."""
    once, per_run = mx.hlo_collectives(LOOPS), mx.hlo_collectives(LOOPS, per_run=True)
    assert {k: v["count"] for k, v in once.items() if v["count"]} == {"allreduce": 3, "allgather": 1, "permute": 1}
    assert {k: (v["count"], v["values"]) for k, v in per_run.items() if v["count"]} == {
        "allreduce": (5 * 3 + 1 + 1, 5 * 3 * 2 + 4 + 2),
        "allgather": (5, 5 * 8 // 4),
        "permute": (1, 2),
    }
    assert mx.hlo_collectives(SAMPLE, per_run=True) == mx.hlo_collectives(SAMPLE)  # (no loops)
