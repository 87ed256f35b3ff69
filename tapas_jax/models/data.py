"""Real data in the zoo's batch layouts: token files and `.npy` images, read through grain.

Files:

- A token file: a flat array of token ids with no header, uint16 or uint32 little-endian
  (nanoGPT's `train.bin`, levanter's raw id caches), or a `.npy` file of integer ids
  (its dtype read from its header). `scripts/prepare_data.py` writes one from any text
  with a byte-level tokenizer (vocab 256, uint16).
- Images: an `.npy` of shape (N, H, W, C) and an `.npy` of N integer labels.

Examples: a token file is cut into windows, the model's batch layout says how. For
`inputs`+`targets` (gpt, llama, moe) a window is `seq_len + 1` tokens, a new one every
`seq_len` tokens (inputs are its first `seq_len`, targets its last); for
`inputs`+`decoder_inputs`+`targets` (t5) a window is `enc_len + dec_len` tokens, the
targets continuing the encoder's stream and the decoder reading them shifted right after
a 0 start token. The last `num_eval` examples are held out; the training split is the
examples before them (with no token in common), shuffled with the seed and reshuffled
every epoch (grain's `MapDataset.shuffle` then `repeat`).

Per host: `loader(..., rows=process_rows(batch_sharding, spec))` reads only the rows of
each global batch that this process's devices hold, and `global_batch` assembles them
with `jax.make_array_from_process_local_data`. Global batch `k` is examples
`k * batch_size ... (k + 1) * batch_size - 1` of the shuffled stream whatever the number
of processes, so one process and several compute the same steps. The loader's position
(`iterator.get_state()`, the batches read) is what a checkpoint saves.

Example:
  >>> import numpy as np, jax
  >>> from tapas_jax import models
  >>> from tapas_jax.models import data
  >>> m = models.get_model("gpt", "tiny")
  >>> spec = m.batch_spec(4)
  >>> ds = data.from_tokens(np.arange(1000) % 256, spec, num_eval=4, vocab_size=256)
  >>> ds.num_train, ds.num_eval
  (26, 4)
  >>> it = iter(data.loader(ds.train, batch_size=4, rows=np.arange(4), seed=0))
  >>> batch = next(it)
  >>> batch["inputs"].shape, it.get_state()
  ((4, 32), {'next_index': 1})
  >>> bool((batch["inputs"][:, 1:] == batch["targets"][:, :-1]).all())
  True
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Mapping

import grain
import jax
import numpy as np

from tapas_jax.errors import TapasError

__all__ = ["DataError", "Dataset", "from_images", "from_tokens", "global_batch", "loader",
           "open_data", "process_rows", "read_images", "read_tokens"]

TOKEN_DTYPES = ("uint16", "uint32")
_SCAN_CHUNK = 1 << 24  # tokens per chunk when checking ids against the vocab


class DataError(TapasError, ValueError):
  """A data file that cannot be trained on; the message names the file and the fix."""


class _Windows:
  """grain random-access source: example `i` of a token array, in the batch layout."""

  def __init__(self, tokens: np.ndarray, start: int, count: int, length: int, stride: int,
               layout: Callable[[np.ndarray], dict]):
    self.tokens, self.start, self.count = tokens, start, count
    self.length, self.stride, self.layout = length, stride, layout

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, i: int) -> dict:
    if not 0 <= i < self.count:
      raise IndexError(f"example {i} of {self.count}")
    at = (self.start + i) * self.stride
    return self.layout(np.asarray(self.tokens[at:at + self.length]))


class _Images:
  """grain random-access source: example `i` of an images array and its labels."""

  def __init__(self, images: np.ndarray, labels: np.ndarray, start: int, count: int,
               dtypes: tuple):
    self.images, self.labels, self.start, self.count = images, labels, start, count
    self.dtypes = dtypes

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, i: int) -> dict:
    if not 0 <= i < self.count:
      raise IndexError(f"example {i} of {self.count}")
    image_dtype, label_dtype = self.dtypes
    return {"images": np.asarray(self.images[self.start + i], image_dtype),
            "labels": np.asarray(self.labels[self.start + i], label_dtype)}


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """A file's examples in a model's batch layout, split into training and held out.

  Attributes:
    name: the file(s), as messages name them.
    train: grain random-access source of the training examples (dicts of numpy rows).
    eval: the same for the held-out examples (possibly empty).
  """

  name: str
  train: Any
  eval: Any

  @property
  def num_train(self) -> int:
    return len(self.train)

  @property
  def num_eval(self) -> int:
    return len(self.eval)


# -- token files -----------------------------------------------------------------------


def read_tokens(path: str, dtype: str = "uint16") -> np.ndarray:
  """The token ids of a file, memory-mapped (nothing read until used).

  Args:
    path: a raw file of `dtype` ids, or a `.npy` file of integer ids (its own dtype).
    dtype: uint16 or uint32, for raw files.

  Raises:
    DataError: the file is missing or unreadable, holds no integers, or its size is not
      a whole number of `dtype` tokens.

  Example:
    >>> import numpy as np, os, tempfile
    >>> from tapas_jax.models import data
    >>> path = os.path.join(tempfile.mkdtemp(), "tokens.bin")
    >>> np.arange(5, dtype=np.uint16).tofile(path)
    >>> data.read_tokens(path).tolist()
    [0, 1, 2, 3, 4]
  """
  if dtype not in TOKEN_DTYPES:
    raise DataError(f"token dtype {dtype!r}: choose one of {', '.join(TOKEN_DTYPES)}")
  try:
    if path.endswith(".npy"):
      tokens = np.load(path, mmap_mode="r")
    else:
      size = os.path.getsize(path)
      itemsize = np.dtype(dtype).itemsize
      if size % itemsize:
        fits = [d for d in TOKEN_DTYPES if size % np.dtype(d).itemsize == 0]
        fix = f"read it as {fits[0]} (--config.token_dtype={fits[0]})" if fits else \
            "it holds no whole number of tokens of any dtype"
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens "
                        f"({itemsize} bytes each); {fix}, or write it again with "
                        "scripts/prepare_data.py")
      with open(path, "rb"):  # an unreadable file fails here, not in a reader thread
        pass
      tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r") \
          if size else np.zeros((0,), dtype)
  except (OSError, ValueError) as e:
    if isinstance(e, DataError):
      raise
    raise DataError(f"{path}: cannot read the token file ({_reason(e)}); give a readable "
                    "file (scripts/prepare_data.py TEXT_FILE OUT writes one)") from None
  if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
    raise DataError(f"{path}: holds a {tokens.dtype} array of shape {tokens.shape}; a token "
                    "file is one flat array of integer ids (scripts/prepare_data.py writes "
                    "one)")
  return tokens


def _token_layout(spec: Mapping[str, Any], name: str) -> tuple[int, int, Callable]:
  """`(window length, stride, window -> example)` for a token batch layout."""
  keys = set(spec)
  dtype = spec["inputs"].dtype if "inputs" in spec else None
  if keys == {"inputs", "targets"}:
    seq_len = spec["inputs"].shape[1]
    return seq_len + 1, seq_len, lambda w: {"inputs": w[:-1].astype(dtype),
                                            "targets": w[1:].astype(dtype)}
  if keys == {"inputs", "decoder_inputs", "targets"}:
    enc_len, dec_len = spec["inputs"].shape[1], spec["targets"].shape[1]

    def encoder_decoder(w):
      targets = w[enc_len:].astype(dtype)
      return {"inputs": w[:enc_len].astype(dtype),
              "decoder_inputs": np.concatenate([np.zeros(1, dtype), targets[:-1]]),
              "targets": targets}

    return enc_len + dec_len, enc_len + dec_len, encoder_decoder
  raise DataError(f"{name}: a token file feeds batches of inputs+targets or inputs+decoder_inputs+"
                  f"targets; this model's batch holds {sorted(keys)}: give it images "
                  "(images:IMAGES.npy,LABELS.npy) or synthetic data (learnable)")


def _check_ids(name: str, values: np.ndarray, limit: int, what: str, fix: str) -> None:
  """Refuses ids outside [0, limit), scanning memory-mapped arrays a chunk at a time."""
  if values.size == 0 or (values.dtype.kind == "u" and np.iinfo(values.dtype).max < limit):
    return
  low, high = 0, 0
  for at in range(0, values.size, _SCAN_CHUNK):
    chunk = np.asarray(values[at:at + _SCAN_CHUNK])
    low, high = min(low, int(chunk.min())), max(high, int(chunk.max()))
  if low < 0:
    raise DataError(f"{name}: holds {what} {low}; {what}s are >= 0")
  if high >= limit:
    raise DataError(f"{name}: holds {what} {high}, at or above the model's {fix}")


def from_tokens(tokens: np.ndarray, spec: Mapping[str, Any], *, num_eval: int,
                vocab_size: int, name: str = "tokens") -> Dataset:
  """Cuts a token array into the examples of batch layout `spec` (see the module doc).

  Args:
    tokens: flat integer ids (a `read_tokens` memmap, or any array).
    spec: the model's batch (`ZooModel.batch_spec(batch_size)`): its keys and shapes
      give the layout, its leading dim the global batch size.
    num_eval: examples to hold out, from the end.
    vocab_size: the model's vocabulary; every id must be below it.
    name: the file, for messages.

  Raises:
    DataError: ids outside the vocab, fewer tokens than one global batch, or a held-out
      split that leaves less than one global batch to train on.
  """
  length, stride, layout = _token_layout(spec, name)
  batch_size = next(iter(spec.values())).shape[0]
  _check_ids(name, tokens, vocab_size, "token id",
             f"vocab_size {vocab_size}: set --config.model.vocab_size above it, or "
             "tokenize for this model's vocab")
  total = (tokens.size - (length - stride)) // stride if tokens.size >= length else 0
  if total < batch_size:
    need = batch_size * stride + length - stride
    raise DataError(f"{name}: {tokens.size} tokens make {total} windows of {length}, fewer "
                    f"than one global batch of {batch_size} ({need} tokens); give a larger "
                    "file or a smaller --batch_size")
  gap = 1 if length > stride else 0  # the last train window would share a token with eval
  num_train = total - num_eval - gap if num_eval else total
  if num_train < batch_size:
    raise DataError(f"{name}: the held-out split ({num_eval} windows) leaves "
                    f"{max(num_train, 0)} of its {total} windows of {length} tokens to train "
                    f"on, fewer than one global batch of {batch_size}; lower "
                    "--config.eval_steps or give a larger file")
  return Dataset(name=name,
                 train=_Windows(tokens, 0, num_train, length, stride, layout),
                 eval=_Windows(tokens, total - num_eval, num_eval, length, stride, layout))


# -- images ----------------------------------------------------------------------------


def read_images(images_path: str, labels_path: str) -> tuple[np.ndarray, np.ndarray]:
  """`(images, labels)` from two `.npy` files, memory-mapped.

  Raises:
    DataError: a file missing or unreadable, or the two of different lengths.
  """
  arrays = []
  for path, what in ((images_path, "images"), (labels_path, "labels")):
    try:
      arrays.append(np.load(path, mmap_mode="r"))
    except (OSError, ValueError) as e:
      raise DataError(f"{path}: cannot read the {what} .npy file ({_reason(e)}); give "
                      f"images:IMAGES.npy,LABELS.npy, both written with numpy.save") from None
  images, labels = arrays
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or \
      images.shape[:1] != labels.shape:
    raise DataError(f"{labels_path}: holds {labels.dtype} labels of shape {labels.shape} for "
                    f"{images.shape[0] if images.ndim else 0} images in {images_path}; give "
                    "one integer label per image")
  return images, labels


def from_images(images: np.ndarray, labels: np.ndarray, spec: Mapping[str, Any], *,
                num_eval: int, num_classes: int, name: str = "images") -> Dataset:
  """The examples of an `images`+`labels` batch layout `spec`; the last `num_eval` held out.

  Raises:
    DataError: images of another shape than the model's, labels outside the classes, or
      too few examples for one global batch (after the held-out split).
  """
  if set(spec) != {"images", "labels"}:
    raise DataError(f"{name}: images feed batches of images+labels; this model's batch "
                    f"holds {sorted(spec)}: give it a token file (tokens:PATH)")
  want = spec["images"].shape[1:]
  if images.shape[1:] != want:
    raise DataError(f"{name}: images of shape {images.shape[1:]}, the model takes {want}; "
                    "resize them, or set the model's image size (--config.model.image_size)")
  _check_ids(name, labels, num_classes, "label",
             f"num_classes {num_classes}: set --config.model.num_classes above it")
  batch_size = spec["images"].shape[0]
  num_train = len(images) - num_eval
  if len(images) < batch_size or num_train < batch_size:
    raise DataError(f"{name}: {len(images)} images, {num_eval} held out, leave {num_train} "
                    f"to train on, fewer than one global batch of {batch_size}; give more "
                    "images, a smaller --batch_size or a lower --config.eval_steps")
  dtypes = (spec["images"].dtype, spec["labels"].dtype)
  return Dataset(name=name, train=_Images(images, labels, 0, num_train, dtypes),
                 eval=_Images(images, labels, num_train, num_eval, dtypes))


def open_data(text: str, spec: Mapping[str, Any], *, num_eval: int, model_config: Any,
              token_dtype: str = "uint16") -> Dataset:
  """The dataset `text` names: `tokens:PATH` or `images:IMAGES.npy,LABELS.npy`.

  Args:
    text: the launcher's `--config.data` (without its synthetic choices).
    spec: the model's batch spec at the global batch size.
    num_eval: held-out examples.
    model_config: the model's config: its `vocab_size` or `num_classes` bounds the ids.
    token_dtype: dtype of a raw token file.

  Raises:
    DataError: see `read_tokens`, `from_tokens`, `read_images` and `from_images`.
  """
  kind, _, path = text.partition(":")
  if kind == "tokens" and path:
    return from_tokens(read_tokens(path, token_dtype), spec, num_eval=num_eval,
                       vocab_size=int(getattr(model_config, "vocab_size", 0)), name=path)
  if kind == "images" and path.count(",") == 1:
    images_path, labels_path = path.split(",")
    images, labels = read_images(images_path, labels_path)
    return from_images(images, labels, spec, num_eval=num_eval,
                       num_classes=int(getattr(model_config, "num_classes", 0)),
                       name=images_path)
  raise DataError(f"{text!r}: give tokens:PATH or images:IMAGES.npy,LABELS.npy")


def _reason(error: BaseException) -> str:
  return getattr(error, "strerror", None) or str(error).splitlines()[0]


# -- reading, per host -----------------------------------------------------------------


def _process_index(sharding, shape: tuple) -> tuple[np.ndarray, ...]:
  """Per dim, the global indices this process's devices hold, in local-data order.

  `jax.make_array_from_process_local_data` takes a process's data as the blocks of its
  devices' distinct shard starts, sorted, laid end to end; these are those indices.
  """
  starts: list[set] = [set() for _ in shape]
  sizes = list(shape)
  for index in sharding.addressable_devices_indices_map(shape).values():
    for d, sl in enumerate(index):
      begin, stop, _ = sl.indices(shape[d])
      starts[d].add(begin)
      sizes[d] = stop - begin
  return tuple(np.concatenate([np.arange(s, s + n) for s in sorted(ss)])
               for ss, n in zip(starts, sizes))


def process_rows(shardings: Mapping[str, Any], spec: Mapping[str, Any]) -> np.ndarray:
  """The rows of the global batch this process's devices hold (sorted, every key's).

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from tapas_jax.models import data
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> spec = {"x": jax.ShapeDtypeStruct((16, 4), np.float32)}
    >>> data.process_rows({"x": NamedSharding(mesh, P("data"))}, spec).size  # one process
    16
  """
  rows = [_process_index(shardings[k], spec[k].shape)[0] for k in spec]
  return np.unique(np.concatenate(rows))


def loader(source: Any, *, batch_size: int, rows: np.ndarray, seed: int,
           shuffle: bool = True, read_threads: int = 2, prefetch: int = 2):
  """A grain `IterDataset` of this process's part of each global batch.

  Global batch `k` is examples `k * batch_size + r` of the stream (shuffled with `seed`
  and repeated forever when `shuffle`, else read once in order), for `r` in `rows`; the
  process reads only those. Each element is a dict of numpy arrays of `len(rows)` rows.
  `iter(...)` gives an iterator whose `get_state()`/`set_state()` are its position.

  Args:
    source: a `Dataset`'s `train` or `eval`.
    batch_size: rows of a global batch.
    rows: the global rows this process reads (`process_rows`).
    seed: the shuffle seed.
    shuffle: shuffle and repeat (training), or one ordered pass (evaluation).
    read_threads: grain threads reading examples.
    prefetch: local batches read ahead.
  """
  order = grain.MapDataset.range(len(source))
  if shuffle:
    order = order.shuffle(seed=seed).repeat()  # each epoch shuffled anew
  rows = np.asarray(rows)
  per_batch = rows.size
  num_batches = len(order) // batch_size if len(order) < sys.maxsize else \
      sys.maxsize // batch_size // per_batch

  def example(j: int) -> dict:
    k, r = divmod(j, per_batch)
    return source[order[k * batch_size + int(rows[r])]]

  local = grain.MapDataset.range(num_batches * per_batch).map(example).batch(per_batch)
  return local.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                                 prefetch_buffer_size=prefetch))


def global_batch(local: Mapping[str, np.ndarray], shardings: Mapping[str, Any],
                 spec: Mapping[str, Any], rows: np.ndarray) -> dict:
  """The global batch from this process's rows, laid out in `shardings`.

  Args:
    local: a `loader` element: `len(rows)` rows of each key.
    shardings: the batch's `NamedSharding` per key (the plan's batch `in_specs`).
    spec: the global batch spec.
    rows: the rows `local` holds (`process_rows` of the same shardings).

  Returns:
    A dict of `jax.Array`s of the spec's shapes, built with
    `jax.make_array_from_process_local_data`.
  """
  out = {}
  for key, sds in spec.items():
    index = _process_index(shardings[key], sds.shape)
    part = np.asarray(local[key])[np.searchsorted(rows, index[0])]
    for d in range(1, part.ndim):
      if index[d].size != part.shape[d]:  # this process holds part of that dim too
        part = np.take(part, index[d], axis=d)
    out[key] = jax.make_array_from_process_local_data(shardings[key], part, sds.shape)
  return out
