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
