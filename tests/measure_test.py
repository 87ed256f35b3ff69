"""measure: collective bytes read off partitioned HLO, with the cost model's ring accounting."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tapas_jax as tapas
from tapas_jax import measure

# One HLO line per case, in the forms XLA prints (Shardy mesh groups, iota groups,
# explicit groups, tuples, async starts), and the bytes each device sends.
LINES = [
    ("%a = f32[1024]{0} all-reduce(%x), channel_id=1, replica_groups=mesh['d'=2,'m'=4] {'m'}, "
     "to_apply=%add", "all-reduce", 2 * 3 / 4 * 4096),
    ("%b = f32[64,32]{1,0} all-gather(f32[16,32]{1,0} %y), replica_groups=[2,4]<=[8], "
     "dimensions={0}", "all-gather", 3 / 4 * 64 * 32 * 4),
    ("%c = bf16[16,32]{1,0} reduce-scatter(%z), replica_groups={{0,1},{2,3},{4,5},{6,7}}, "
     "dimensions={0}, to_apply=%add", "reduce-scatter", 1 * 16 * 32 * 2),
    ("%d = f32[8,8]{1,0} all-to-all(%w), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
     "all-to-all", 7 / 8 * 256),
    ("%e = f32[100]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}",
     "collective-permute", 400),
    ("%f = (f32[10]{0}, s32[6]{0}) all-reduce-start(%p, %q), replica_groups=[4,2]<=[8], "
     "to_apply=%add", "all-reduce", 2 * 1 / 2 * (40 + 24)),
]


@pytest.mark.parametrize("line,kind,sent", LINES)
def test_each_collective_form_is_counted(line, kind, sent):
  got = measure.collective_bytes(line, num_devices=8)
  assert got[kind] == pytest.approx(sent)
  assert got["total"] == pytest.approx(sent)


def test_done_halves_and_groups_of_one_send_nothing():
  text = "\n".join([
      "%g = f32[10]{0} all-reduce-done(%f)",
      "%h = f32[10]{0} all-reduce(%x), replica_groups={{0},{1},{2},{3}}, to_apply=%add"])
  assert measure.collective_bytes(text)["total"] == 0


def test_compiled_program_figures_match_the_sharding():
  mesh = tapas.make_mesh({"data": 2, "model": 4})
  # x split over both axes; the sum over dim 1 all-reduces over `model` only.
  f = jax.jit(lambda x: x.sum(axis=1), in_shardings=NamedSharding(mesh, P("data", "model")),
              out_shardings=NamedSharding(mesh, P("data")))
  compiled = f.lower(jax.ShapeDtypeStruct((64, 1024), jnp.float32)).compile()
  got = measure.measure(compiled, 8)
  assert got.comm_bytes["all-reduce"] == pytest.approx(2 * 3 / 4 * 32 * 4)
  assert got.argument_bytes == 64 * 1024 * 4 // 8
  assert got.memory_bytes >= got.argument_bytes
