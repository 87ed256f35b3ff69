"""Models written the way other libraries' users write them, planned and judged by the
TPU compiler.

* `--model=gemma`: a Gemma-2B-shaped flax linen LM as a flax user writes it (RMSNorm,
  RoPE, multi-query attention, GeGLU MLP, a 256k vocabulary tied to the embedding,
  bf16 compute over f32 parameters, optax AdamW behind global-norm clipping), unrolled.
* `--model=equinox`, `equinox_scan`, `keras_transformer`, `keras_cnn`: the programs of
  `tests/libraries_test.py` (equinox's `eqx.nn` modules, its blocks stacked by
  `eqx.filter_vmap` and run by `lax.scan`; Keras 3 functional models through
  `stateless_call`) at the width, sequence, vocabulary and batch given here.
* `--model=pallas_attention`, `shard_map_attention`: an attention layer whose attention
  runs inside a `jax.shard_map` (batch on data, heads on model) on the topology's mesh
  (`tapas.tpu_mesh`), as TPU users run a Pallas kernel: Pallas' TPU flash attention, or
  the same softmax attention in XLA ops (`tests/styles.py`); `--width` is the heads'
  total width (128 per head), `--vocab` unused.

Each layout (our search, or a baseline, `fsdp:nothing_saveable` naming its remat) is
planned with the TPU profile of the topology's generation (our cost model), compiled
through libtpu for the topology (`tapas.verify`, no TPU needed) and printed with the
compiler's live peak and collectives beside the predictions. Needs the tpu extra (and
the test extra for equinox and Keras).

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu python scripts/bench_libraries.py \\
      --model=equinox_scan --width=512 --seq=512 --vocab=8192 --batch=16 --layers=4
  ... --model=gemma --layers=18 --topology=v5p:2x2x2 --mesh=data=8 \\
      --layouts=tapas,fsdp:nothing_saveable
  ... --model=pallas_attention --width=512 --seq=512 --batch=8 --layouts=tapas,fsdp
"""

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def gemma(layers: int, width: int, seq: int, vocab: int, batch: int):
  """(step, state, batch) of the Gemma-shaped flax LM, abstract."""
  import flax.linen as nn  # noqa: PLC0415 - after the environment is set
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import optax  # noqa: PLC0415

  heads, head_dim, hidden, bf16 = 8, 256, 8 * width, jnp.bfloat16

  class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
      scale = self.param("scale", nn.initializers.zeros, (x.shape[-1],))
      var = jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
      return (x * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype) * (1 + scale).astype(x.dtype)

  def rope(x):
    half = x.shape[-1] // 2
    t = jnp.arange(x.shape[1])[:, None] / (10000 ** (jnp.arange(half) / half))[None]
    sin, cos = jnp.sin(t)[None, :, None], jnp.cos(t)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)

  class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
      q = rope(nn.DenseGeneral((heads, head_dim), use_bias=False, dtype=bf16, name="q")(x))
      k = rope(nn.DenseGeneral((1, head_dim), use_bias=False, dtype=bf16, name="k")(x))
      v = nn.DenseGeneral((1, head_dim), use_bias=False, dtype=bf16, name="v")(x)
      k, v = jnp.repeat(k, heads, axis=2), jnp.repeat(v, heads, axis=2)
      s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
      causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
      p = jax.nn.softmax(jnp.where(causal, s.astype(jnp.float32), -1e30), -1).astype(bf16)
      o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
      return nn.DenseGeneral(width, axis=(-2, -1), use_bias=False, dtype=bf16, name="o")(o)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = x + Attention()(RMSNorm()(x))
      h = RMSNorm()(x)
      gate = nn.Dense(hidden, use_bias=False, dtype=bf16, name="gate")(h)
      up = nn.Dense(hidden, use_bias=False, dtype=bf16, name="up")(h)
      return x + nn.Dense(width, use_bias=False, dtype=bf16, name="down")(nn.gelu(gate) * up)

  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      embed = nn.Embed(vocab, width, dtype=bf16, name="embed")
      x = embed(tokens) * jnp.sqrt(width).astype(bf16)
      for i in range(layers):
        x = Block(name=f"layer_{i}")(x)
      return embed.attend(RMSNorm()(x)).astype(jnp.float32)

  model = LM()
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, 3e-4, 100, 10_000), weight_decay=0.1))

  def step(state, batch):
    params, opt_state = state

    def loss(p):
      logits = model.apply({"params": p}, batch["inputs"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value

  params = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  return step, (params, jax.eval_shape(opt.init, params)), {"inputs": tokens,
                                                            "targets": tokens}


def shard_mapped(name: str, topology: str, mesh: dict, width: int, seq: int, batch: int):
  """(step, state, x) of `tests/styles.py`'s shard_mapped attention on the topology's
  mesh, abstract: Pallas' flash attention inside (`pallas_attention`), or XLA ops."""
  import jax  # noqa: PLC0415 - after the environment is set

  import tapas_jax as tapas  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  import styles  # noqa: PLC0415 - a test helper, on the path only here

  kernel = None
  if name == "pallas_attention":
    from jax.experimental.pallas.ops.tpu import flash_attention as fa  # noqa: PLC0415
    def kernel(q, k, v):
      return fa.flash_attention(q, k, v, causal=True)
  step, state, x = styles.shard_mapped_attention(
      tapas.tpu_mesh(topology, mesh), attention=kernel, batch=batch, seq=seq,
      heads=width // 128, head_dim=128, width=width)
  return (step,) + jax.eval_shape(lambda *a: a, state, x)


def library_case(name: str, layers: int, width: int, seq: int, vocab: int, batch: int):
  """(step, state, batch) of a `tests/libraries_test.py` program at these sizes."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  import libraries_test as lt  # noqa: PLC0415 - a test module, on the path only here

  return lt.program(name, lt.Sizes(vocab=vocab, seq=seq, width=width, batch=batch,
                                   layers=layers))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="equinox_scan",
                      help="gemma, equinox, equinox_scan, keras_transformer, keras_cnn, "
                      "pallas_attention, shard_map_attention")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--width", type=int, default=None,
                      help="default: 2048 for gemma, 512 for the others")
  parser.add_argument("--seq", type=int, default=None, help="default: 2048 / 512")
  parser.add_argument("--vocab", type=int, default=None, help="default: 256000 / 8192")
  parser.add_argument("--batch", type=int, default=None, help="default: 32 / 16")
  parser.add_argument("--topology", default="v5p:2x2x1")
  parser.add_argument("--mesh", default="data=2,model=2")
  parser.add_argument("--layouts", default="tapas,fsdp,data_parallel",
                      help="tapas, or a baseline; BASELINE:POLICY adds its remat")
  a = parser.parse_args()
  import tapas_jax as tapas  # noqa: PLC0415
  from tapas_jax import baselines, cost  # noqa: PLC0415

  big = a.model == "gemma"
  sizes = dict(layers=a.layers, width=a.width or (2048 if big else 512),
               seq=a.seq or (2048 if big else 512), vocab=a.vocab or (256000 if big else 8192),
               batch=a.batch or (32 if big else 16))
  mesh = {k: int(v) for k, v in (kv.split("=") for kv in a.mesh.split(","))}
  if a.model.endswith("_attention"):
    step, state, batch = shard_mapped(a.model, a.topology, mesh, sizes["width"],
                                      sizes["seq"], sizes["batch"])
  else:
    step, state, batch = gemma(**sizes) if big else library_case(a.model, **sizes)
  device = cost.profile_for_topology(a.topology)
  print(f"{a.model} {sizes}, mesh {mesh}, {a.topology}; predicted by our {device} profile, "
        "compiled by libtpu")
  for layout in a.layouts.split(","):
    name, _, remat = layout.partition(":")
    start = time.perf_counter()
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      plan = (tapas.search(step, state, batch, mesh=mesh, device=device) if name == "tapas"
              else baselines.baseline(name, step, state, batch, mesh=mesh, device=device,
                                      remat=remat or None))
      record = tapas.verify(plan, step, state, batch, topology=a.topology,
                            donate_argnums=0)
    predicted = plan.stats.predicted_memory_bytes
    kinds = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in record.comm_bytes.items()
                      if v and k != "total")
    print(f"  {layout:22s} predicted {predicted / 2**20:9.1f} MiB, compiled live peak "
          f"{record.live_peak_bytes / 2**20:9.1f} MiB ({record.live_ratio:.2f}); bytes sent "
          f"predicted {record.predicted_comm_bytes / 2**20:.1f} MiB, compiled "
          f"{record.comm_bytes.get('total', 0.0) / 2**20:.1f} ({record.comm_ratio:.2f}; "
          f"{kinds}); fits {record.fits}; plan and compile "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
