"""A Keras 3 language model (JAX backend) planned and judged by the TPU compiler.

A model no one on this team wrote, as Keras' guides write it: a functional transformer
(`Embedding`, `LayerNormalization`, `MultiHeadAttention` with a causal mask, `Dense`
with Keras' default exact GELU) under the `mixed_bfloat16` policy, trained through
`stateless_call` and `AdamW.stateless_apply`. Our plan and the FSDP and data-parallel
baselines are searched with the `tpu-v5p` profile (our cost model), then compiled for
a TPU topology through libtpu (`tapas.verify`, no TPU needed), which prints the
compiler's peak beside the prediction, with the state in JAX's default layouts and in
the compiler's (`layouts="auto"`). Needs the test extra (keras) and the tpu extra.

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu python scripts/bench_keras.py
  ... --layers=2 --width=1024                                # smaller, faster
"""

import argparse
import os
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def build(layers: int, width: int, seq: int, vocab: int):
  """(train step, abstract state) of the Keras model."""
  import jax  # noqa: PLC0415 - after the environment is set
  import keras  # noqa: PLC0415

  keras.config.set_dtype_policy("mixed_bfloat16")
  tokens = keras.Input((seq,), dtype="int32")
  x = keras.layers.Embedding(vocab, width)(tokens)
  for _ in range(layers):
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.MultiHeadAttention(width // 128, 128)(h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.Dense(width)(keras.layers.Dense(4 * width, activation="gelu")(h))
  model = keras.Model(tokens, keras.layers.Dense(vocab, dtype="float32")(x))
  opt = keras.optimizers.AdamW(1e-3)
  opt.build(model.trainable_variables)
  xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def loss(trainable, fixed, x, y):
    logits, fixed = model.stateless_call(trainable, fixed, x, training=True)
    return xent(y, logits), fixed

  def step(state, x, y):
    trainable, fixed, slots = state
    (value, fixed), grads = jax.value_and_grad(loss, has_aux=True)(trainable, fixed, x, y)
    trainable, slots = opt.stateless_apply(slots, grads, trainable)
    return (trainable, fixed, slots), value

  def spec(v):
    return jax.ShapeDtypeStruct(v.value.shape, v.value.dtype)
  state = ([spec(v) for v in model.trainable_variables],
           [spec(v) for v in model.non_trainable_variables], [spec(v) for v in opt.variables])
  return step, state


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--topology", default="v5p:2x2x1")
  parser.add_argument("--mesh", default="data=2,model=2")
  parser.add_argument("--layouts", default="tapas,fsdp,data_parallel")
  parser.add_argument("--state_layouts", default="default,auto",
                      help="tapas.apply's layouts= to compile each plan with: JAX's "
                      "default layouts for the state, the compiler's (auto), or both")
  a = parser.parse_args()
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import tapas_jax as tapas  # noqa: PLC0415
  from tapas_jax import baselines  # noqa: PLC0415

  step, state = build(a.layers, a.width, a.seq, a.vocab)
  tokens = jax.ShapeDtypeStruct((a.batch, a.seq), jnp.int32)
  args = (state, tokens, tokens)
  mesh = {k: int(v) for k, v in (kv.split("=") for kv in a.mesh.split(","))}
  print(f"Keras 3 LM, {a.layers} layers, width {a.width}, seq {a.seq}, batch {a.batch}, "
        f"mesh {mesh}, {a.topology}; predicted by the tpu-v5p profile, compiled by libtpu")
  for layout in a.layouts.split(","):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      plan = (tapas.search(step, *args, mesh=mesh, device="tpu-v5p") if layout == "tapas"
              else baselines.baseline(layout, step, *args, mesh=mesh, device="tpu-v5p"))
    for state_layouts in a.state_layouts.split(","):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        record = tapas.verify(plan, step, *args, topology=a.topology, donate_argnums=0,
                              layouts=state_layouts)
      predicted = plan.stats.predicted_memory_bytes
      print(f"  {layout:14s} predicted {predicted / 2**30:6.2f} GiB, compiled peak "
            f"{record.live_peak_bytes / 2**30:6.2f} GiB ({predicted / record.live_peak_bytes:.2f}"
            f") with the state in {state_layouts} layouts; bytes sent predicted "
            f"{record.predicted_comm_bytes / 2**30:.2f} GiB, compiled "
            f"{record.comm_bytes.get('total', 0.0) / 2**30:.2f} ({record.comm_ratio:.2f}); step "
            f"{plan.stats.predicted_step_s * 1e3:.1f} ms (model); compile "
            f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
