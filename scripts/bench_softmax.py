"""A softmax's probabilities on the TPU compiler: written or recomputed, per dtype and size.

Small attention programs (two layers, SGD, data parallel over v5p:2x2x1 with the
`tpu-v5p` profile), each compiled once through libtpu's ahead-of-time path (no TPU
needed); printed: our predicted peak with the probabilities written where the dots
read them in bf16 (`Facts.costly_narrow` on `div`, the model) and with them recomputed
in each dot (the rule off), beside the compiler's live peak (`peak_memory_in_bytes`).

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu python scripts/bench_softmax.py
  ... --seqs=512,1024 --variants=bf16,f32_to_bf16
"""

import argparse
import dataclasses
import os
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tapas_jax as tapas  # noqa: E402
from tapas_jax import baselines, rules  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
# variant -> (softmax dtype, dtype the dots read the probabilities in, with an MLP)
VARIANTS = {
    "bf16": (BF16, BF16, False),  # computed in bf16
    "f32_to_bf16": (F32, BF16, False),  # f32, converted for the dots (Keras' mixed policy)
    "f32": (F32, F32, False),  # all f32: the dots read f32
    "f32_to_bf16_mlp": (F32, BF16, True),  # and a GELU MLP after the attention
}


def _step(softmax_dtype, probs_dtype, mlp):
  def block(p, x):
    q, k, v = (jnp.einsum("bsd,dhe->bshe", x.astype(BF16), p[n].astype(BF16)) for n in "qkv")
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(softmax_dtype)
    w = jax.nn.softmax(s, -1).astype(probs_dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", w, v.astype(probs_dtype)).astype(BF16)
    x = x + jnp.einsum("bshe,hed->bsd", o, p["o"].astype(BF16)).astype(F32)
    if mlp:
      u = jax.nn.gelu(x.astype(BF16) @ p["up"].astype(BF16))
      x = x + (u @ p["down"].astype(BF16)).astype(F32)
    return x

  def loss(ps, x):
    for p in ps:
      x = block(p, x)
    return jnp.mean(x ** 2)

  return lambda ps, x: jax.tree.map(lambda a, g: a - 0.1 * g, ps, jax.grad(loss)(ps, x))


def _args(batch, seq, width, heads, layers=2):
  s = jax.ShapeDtypeStruct
  p = {n: s((width, heads, width // heads), F32) for n in "qkv"}
  p.update(o=s((heads, width // heads, width), F32), up=s((width, 4 * width), F32),
           down=s((4 * width, width), F32))
  return [p] * layers, s((batch, seq, width), F32)


def _predicted(step, args, written: bool):
  """(the data-parallel plan, its predicted peak) with the probabilities `written`
  where the dots read them in bf16, or recomputed in each dot."""
  facts = rules.FACTS["div"]
  rules.FACTS["div"] = dataclasses.replace(facts, costly_narrow=written)
  try:
    plan = baselines.baseline("data_parallel", step, *args, mesh={"data": 4},
                              device="tpu-v5p")
  finally:
    rules.FACTS["div"] = facts
  return plan, plan.stats.predicted_memory_bytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", default="512,1024,2048")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--topology", default="v5p:2x2x1")
  a = parser.parse_args()
  print(f"batch {a.batch}, width {a.width}, {a.heads} heads, 2 layers, data parallel over "
        f"{a.topology}; MiB per device")
  print(f"{'variant':16s} {'seq':>5s} {'written':>9s} {'recomputed':>10s} {'compiled':>9s} "
        f"{'ratio':>6s} {'rule off':>8s}")
  for variant in a.variants.split(","):
    for seq in map(int, a.seqs.split(",")):
      step, args = _step(*VARIANTS[variant]), _args(a.batch, seq, a.width, a.heads)
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan, written = _predicted(step, args, True)
        _, recomputed = _predicted(step, args, False)
        live = tapas.verify(plan, step, *args, topology=a.topology,
                            donate_argnums=0).live_peak_bytes
      print(f"{variant:16s} {seq:5d} {written / 2**20:9.2f} {recomputed / 2**20:10.2f} "
            f"{live / 2**20:9.2f} {written / live:6.3f} {recomputed / live:8.3f}", flush=True)


if __name__ == "__main__":
  main()
