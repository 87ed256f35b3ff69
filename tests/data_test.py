"""Token files and .npy images in the zoo's batch layouts, read per host through grain."""

import itertools
import json

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tapas_jax as tapas
from tapas_jax import models
from tapas_jax.models import data

GPT = models.get_model("gpt", "tiny")  # seq_len 32, vocab 256
B = 8


def _tokens(n, seed=0):
  return np.random.default_rng(seed).integers(0, 256, n).astype(np.uint16)


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def test_windows_follow_the_file_and_eval_shares_no_token_with_train():
  tokens = np.arange(40 * 32 + 1) % 251
  ds = data.from_tokens(tokens, GPT.batch_spec(B), num_eval=8, vocab_size=256)
  assert (ds.num_train, ds.num_eval) == (40 - 8 - 1, 8)
  for split, first in ((ds.train, 0), (ds.eval, 32)):
    for i in (0, len(split) - 1):
      window = tokens[(first + i) * 32:(first + i) * 32 + 33]
      np.testing.assert_array_equal(split[i]["inputs"], window[:-1])
      np.testing.assert_array_equal(split[i]["targets"], window[1:])
      assert split[i]["inputs"].dtype == GPT.batch_spec(1)["inputs"].dtype
  last_train_token = (ds.num_train - 1) * 32 + 32
  assert last_train_token < 32 * 32  # the first eval window starts at token 32 * 32


def test_encoder_decoder_windows():
  t5 = models.get_model("t5", "tiny")  # enc_len 32, dec_len 16
  tokens = np.arange(10 * 48) % 200 + 1
  ds = data.from_tokens(tokens, t5.batch_spec(4), num_eval=0, vocab_size=256)
  assert ds.num_train == 10 and ds.num_eval == 0
  ex = ds.train[2]
  np.testing.assert_array_equal(ex["inputs"], tokens[96:128])
  np.testing.assert_array_equal(ex["targets"], tokens[128:144])
  np.testing.assert_array_equal(ex["decoder_inputs"], np.r_[0, tokens[128:143]])


def test_training_stream_is_a_seeded_shuffle_of_each_epoch():
  ds = data.from_tokens(np.arange(32 * 32 + 1) // 32, GPT.batch_spec(B), num_eval=0,
                        vocab_size=256)
  assert ds.num_train == 32  # four batches an epoch

  def first_tokens(seed, n=8):
    it = iter(data.loader(ds.train, batch_size=B, rows=np.arange(B), seed=seed))
    return [b["inputs"][:, 0].tolist() for b in _take(it, n)]

  a, again, other = first_tokens(0), first_tokens(0), first_tokens(1)
  assert a == again and a != other
  windows = list(range(32))  # window i starts with token i
  for epoch in (a[:4], a[4:]):  # every epoch holds every window once
    assert sorted(itertools.chain(*epoch)) == windows
  assert a[:4] != a[4:]  # and is shuffled anew


@pytest.mark.parametrize("parts", [[range(0, 4), range(4, 8)], [range(0, 2), range(2, 8)],
                                   [[0, 3, 5], [1, 2, 4, 6, 7]]])
def test_hosts_reading_their_rows_make_the_global_batch(parts):
  """What each process reads, put together, is what one process reads alone."""
  ds = data.from_tokens(_tokens(5000), GPT.batch_spec(B), num_eval=0, vocab_size=256)
  whole = _take(iter(data.loader(ds.train, batch_size=B, rows=np.arange(B), seed=3)), 5)
  pieces = [_take(iter(data.loader(ds.train, batch_size=B, rows=np.asarray(list(rows)),
                                   seed=3)), 5) for rows in parts]
  for k in range(5):
    for rows, piece in zip(parts, pieces):
      np.testing.assert_array_equal(piece[k]["inputs"], whole[k]["inputs"][list(rows)])


def test_position_restores_the_same_batches():
  """A loader stopped after 3 batches, its state saved (as JSON, as the checkpoint holds
  it) and restored into a fresh loader, goes on with the batches of one never stopped."""
  ds = data.from_tokens(_tokens(3000), GPT.batch_spec(B), num_eval=0, vocab_size=256)
  make = lambda: iter(data.loader(ds.train, batch_size=B, rows=np.arange(B), seed=7))  # noqa: E731
  straight = _take(make(), 12)  # past the end of the first epoch (11 batches)
  stopped = make()
  _take(stopped, 3)
  saved = json.loads(json.dumps(stopped.get_state()))
  resumed = make()
  resumed.set_state(saved)
  for want, got in zip(straight[3:], _take(resumed, 9)):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
  fresh = _take(make(), 1)[0]
  assert not np.array_equal(fresh["inputs"], straight[3]["inputs"])  # the state mattered


def test_eval_reads_the_held_out_split_once_in_order():
  ds = data.from_tokens(_tokens(3000), GPT.batch_spec(B), num_eval=2 * B, vocab_size=256)
  batches = list(data.loader(ds.eval, batch_size=B, rows=np.arange(B), seed=0, shuffle=False))
  assert len(batches) == 2
  np.testing.assert_array_equal(batches[1]["targets"][3], ds.eval[B + 3]["targets"])


@pytest.mark.parametrize("spec", [P("data"), P(("data", "model")), P(None, "model"), P()])
def test_global_batch_lies_in_the_plan_sharding(spec):
  mesh = tapas.make_mesh({"data": 2, "model": 4})
  batch_spec = GPT.batch_spec(B)
  shardings = {k: NamedSharding(mesh, spec) for k in batch_spec}
  rows = data.process_rows(shardings, batch_spec)
  np.testing.assert_array_equal(rows, np.arange(B))  # one process holds every row
  ds = data.from_tokens(_tokens(3000), batch_spec, num_eval=0, vocab_size=256)
  local = next(iter(data.loader(ds.train, batch_size=B, rows=rows, seed=0)))
  batch = data.global_batch(local, shardings, batch_spec, rows)
  for k, sds in batch_spec.items():
    assert batch[k].shape == sds.shape and batch[k].dtype == sds.dtype
    assert batch[k].sharding == shardings[k]
    np.testing.assert_array_equal(np.asarray(batch[k]), local[k])


def test_images_and_labels():
  vit = models.get_model("vit", "tiny")  # 32x32x3, 10 classes
  spec = vit.batch_spec(4)
  rng = np.random.default_rng(0)
  images = rng.random((20, 32, 32, 3), np.float32)
  labels = rng.integers(0, 10, 20)
  ds = data.from_images(images, labels, spec, num_eval=4, num_classes=10)
  assert (ds.num_train, ds.num_eval) == (16, 4)
  np.testing.assert_array_equal(ds.eval[1]["images"], images[17])
  assert ds.eval[1]["labels"] == labels[17] and ds.eval[1]["labels"].dtype == np.int32
  batch = next(iter(data.loader(ds.train, batch_size=4, rows=np.arange(4), seed=0)))
  assert batch["images"].shape == (4, 32, 32, 3)
  for image, label in zip(batch["images"], batch["labels"]):
    (i,) = np.flatnonzero((images == image).all(axis=(1, 2, 3)))
    assert labels[i] == label


def test_read_tokens_raw_and_npy(tmp_path):
  ids = np.array([1, 300, 65535], np.uint32)
  ids.astype(np.uint16).tofile(tmp_path / "a.bin")
  ids.tofile(tmp_path / "b.bin")
  np.save(tmp_path / "c.npy", ids.astype(np.int64))
  assert data.read_tokens(str(tmp_path / "a.bin")).tolist() == ids.tolist()
  assert data.read_tokens(str(tmp_path / "b.bin"), "uint32").tolist() == ids.tolist()
  assert data.read_tokens(str(tmp_path / "c.npy")).tolist() == ids.tolist()


def test_a_raw_file_of_another_dtype_is_named(tmp_path):
  path = _write(tmp_path, "t.bin", np.zeros(3001, np.uint16))
  with pytest.raises(data.DataError, match="read it as uint16 \\(--config.token_dtype=uint16"):
    data.read_tokens(path, "uint32")


def _write(tmp_path, name, array):
  path = str(tmp_path / name)
  if name.endswith(".npy"):
    np.save(path, array)
  else:
    np.asarray(array).tofile(path)
  return path


BAD = [  # (name, files to write, data text, num_eval, message)
    ("missing", {}, "tokens:{d}/none.bin", 0, "cannot read the token file"),
    ("odd_size", {"t.bin": np.zeros(3001, np.uint8)}, "tokens:{d}/t.bin", 0,
     "3001 bytes is not a whole number of uint16 tokens (2 bytes each); it holds no whole"),
    ("not_integers", {"t.npy": np.zeros(3000, np.float32)}, "tokens:{d}/t.npy", 0,
     "a token file is one flat array of integer ids"),
    ("id_over_vocab", {"t.bin": np.full(3000, 256, np.uint16)}, "tokens:{d}/t.bin", 0,
     "token id 256, at or above the model's vocab_size 256"),
    ("negative_id", {"t.npy": np.full(3000, -1, np.int32)}, "tokens:{d}/t.npy", 0,
     "token id -1"),
    ("under_one_batch", {"t.bin": np.zeros(200, np.uint16)}, "tokens:{d}/t.bin", 0,
     "fewer than one global batch of 8"),
    ("eval_too_large", {"t.bin": np.zeros(3000, np.uint16)}, "tokens:{d}/t.bin", 88,
     "the held-out split (88 windows) leaves 4"),
    ("bad_form", {}, "parquet:{d}/x", 0, "give tokens:PATH or images:"),
    ("images_for_gpt", {"i.npy": np.zeros((9, 32, 32, 3)), "l.npy": np.zeros(9, int)},
     "images:{d}/i.npy,{d}/l.npy", 0, "images feed batches of images+labels"),
]


@pytest.mark.parametrize("name,files,text,num_eval,message", BAD, ids=[b[0] for b in BAD])
def test_bad_data_names_the_file_and_the_fix(tmp_path, name, files, text, num_eval, message):
  for fname, array in files.items():
    _write(tmp_path, fname, array)
  with pytest.raises(data.DataError) as e:
    data.open_data(text.format(d=tmp_path), GPT.batch_spec(B), num_eval=num_eval,
                   model_config=GPT.config)
  assert message in str(e.value)
  assert "\n" not in str(e.value)
  if files or name == "missing":
    assert str(tmp_path) in str(e.value)


BAD_IMAGES = [
    ("wrong_shape", np.zeros((9, 28, 28, 1), np.float32), np.zeros(9, int), "the model takes"),
    ("label_count", np.zeros((9, 32, 32, 3), np.float32), np.zeros(8, int),
     "one integer label per image"),
    ("label_over_classes", np.zeros((9, 32, 32, 3), np.float32), np.full(9, 10),
     "label 10, at or above the model's num_classes 10"),
    ("too_few", np.zeros((5, 32, 32, 3), np.float32), np.zeros(5, int),
     "fewer than one global batch of 8"),
]


@pytest.mark.parametrize("name,images,labels,message", BAD_IMAGES,
                         ids=[b[0] for b in BAD_IMAGES])
def test_bad_images(tmp_path, name, images, labels, message):
  del name
  vit = models.get_model("vit", "tiny")
  text = (f"images:{_write(tmp_path, 'i.npy', images)},"
          f"{_write(tmp_path, 'l.npy', labels)}")
  with pytest.raises(data.DataError) as e:
    data.open_data(text, vit.batch_spec(B), num_eval=0, model_config=vit.config)
  assert message in str(e.value) and str(tmp_path) in str(e.value)

