"""The TPU compiler's `memory_analysis()` temp beside its own heap (the preallocated-temp
allocation of its buffer assignment, dumped through `compiler_options`), on small
scanned programs. No TPU needed (libtpu's ahead-of-time compile).

  JAX_PLATFORMS=cpu python scripts/bench_tpu_heap.py --layers=2,4,8 \
      --programs=two_loops,resid_remat,nested_remat
  JAX_PLATFORMS=cpu python scripts/bench_tpu_heap.py --topology=v5e:2x2 --scale=24 \
      --layers=8 --programs=nested_remat     # compiles: temp 18.0 GiB > 15.75, heap 10.9
"""

import argparse
import glob
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _remat_loss(body):
  def loss(ws, x):
    b = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    return jnp.sum(jax.lax.scan(b, x, ws)[0].astype(jnp.float32) ** 2)
  return lambda ws, x: ws - 0.1 * jax.grad(loss)(ws, x)


def _two_loops(ws, x):  # a stack written by one loop, read by another
  def body(h, w):
    h = jnp.tanh(h @ w)
    return h, h
  _, ys = jax.lax.scan(body, x, ws)
  return jax.lax.scan(lambda a, y: (a + jnp.sum(y.astype(jnp.float32)), None),
                      jnp.zeros((), jnp.float32), ys)[0]


def _nested(h, w):  # a loop inside the scanned body, as a chunked attention
  a = jnp.tanh(h @ w)
  c = jax.lax.map(lambda blk: jnp.tanh(blk @ w), a.reshape(8, -1, a.shape[-1]))
  return h + c.reshape(a.shape), None


PROGRAMS = {
    "two_loops": _two_loops,
    "resid_remat": _remat_loss(lambda h, w: (h + jnp.tanh(h @ w), None)),
    "nested_remat": _remat_loss(_nested),
}


def heap_bytes(folder: str) -> int:
  """The default memory's preallocated temp of the dumped buffer assignment."""
  (path,) = glob.glob(f"{folder}/*after_optimizations-buffer-assignment.txt")
  sizes = re.findall(r"allocation \d+: size (\d+), (?:page \d+, )?preallocated-temp",
                     open(path).read())
  return max(int(s) for s in sizes)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--topology", default="v5p:2x2x1")
  p.add_argument("--layers", default="2,4,8")
  p.add_argument("--programs", default=",".join(PROGRAMS))
  p.add_argument("--scale", type=int, default=1, help="rows of x: 4 x 8192 x scale")
  a = p.parse_args()
  topo = topologies.get_topology_desc(platform="tpu", topology_name=a.topology)
  n = len(topo.devices)
  mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(n), ("data",))
  print(f"jax {jax.__version__}; {a.topology}; MiB per device")
  print("| program | layers | memory_analysis temp | heap | temp - heap | compile |")
  print("|---|---|---|---|---|---|")
  for name in a.programs.split(","):
    for layers in map(int, a.layers.split(",")):
      ws = jax.ShapeDtypeStruct((layers, 1024, 1024), jnp.bfloat16,
                                sharding=NamedSharding(mesh, P()))
      x = jax.ShapeDtypeStruct((n * 8192 * a.scale, 1024), jnp.bfloat16,
                               sharding=NamedSharding(mesh, P("data")))
      with tempfile.TemporaryDirectory() as d:
        lowered = jax.jit(PROGRAMS[name]).lower(ws, x)
        try:
          c = lowered.compile(compiler_options={"xla_dump_to": d})
        except Exception as e:  # noqa: BLE001 - the compiler's refusal is a row
          print(f"| {name} | {layers} | | | | failed: {str(e).splitlines()[0][:160]} |")
          continue
        temp, heap = c.memory_analysis().temp_size_in_bytes, heap_bytes(d)
      u = 2**20
      print(f"| {name} | {layers} | {temp / u:.2f} | {heap / u:.2f} | {(temp - heap) / u:.2f}"
            " | ok |", flush=True)


if __name__ == "__main__":
  main()
