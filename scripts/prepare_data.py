"""Text to a token file for scripts/train.py, with a byte-level tokenizer (nothing downloaded).

Usage:
  python scripts/prepare_data.py TEXT_FILE [TEXT_FILE ...] OUT
  python scripts/train.py --config=configs/gpt2.py:tiny --config.data=tokens:OUT

Each byte of the files (UTF-8 text, or anything) is one token, so the vocabulary is the
256 byte values and any model with `vocab_size >= 256` reads it; several files are joined
in the order given. OUT is the format nanoGPT's `train.bin` has: the token ids as
little-endian uint16, one after another, no header (`numpy.fromfile(OUT, "<u2")` reads
it back; a byte string decodes with `bytes(ids.astype("u1"))`). An OUT ending in `.npy`
is written with `numpy.save` instead (uint16, its header says so).

A missing or unreadable input, or an OUT that cannot be written, is refused with one line
on stderr and exit status 2, and OUT is left as it was.
"""

import os
import sys
import tempfile

import numpy as np

VOCAB_SIZE = 256  # byte values


def tokenize(text: bytes) -> np.ndarray:
  """Byte-level tokens: each byte its own id in [0, 256), as uint16.

  Example:
    >>> tokenize("hé".encode()).tolist()
    [104, 195, 169]
  """
  return np.frombuffer(text, np.uint8).astype("<u2")


def write(tokens: np.ndarray, out: str) -> None:
  """Writes `tokens` to `out` through a temporary file and a rename: never half a file."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)), prefix=".tmp-")
  try:
    with os.fdopen(fd, "wb") as f:
      if out.endswith(".npy"):
        np.save(f, tokens)
      else:
        tokens.tofile(f)
    os.replace(tmp, out)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def main(argv: list[str]) -> int:
  if len(argv) < 3 or any(a.startswith("-") for a in argv[1:]):
    print("prepare_data.py: error: usage: prepare_data.py TEXT_FILE [TEXT_FILE ...] OUT",
          file=sys.stderr)
    return 2
  *inputs, out = argv[1:]
  parts = []
  for path in inputs:
    try:
      with open(path, "rb") as f:
        parts.append(f.read())
    except OSError as e:
      print(f"prepare_data.py: error: cannot read {path} ({e.strerror or e}); give a "
            "readable text file", file=sys.stderr)
      return 2
  tokens = tokenize(b"".join(parts))
  try:
    write(tokens, out)
  except OSError as e:
    print(f"prepare_data.py: error: cannot write {out} ({e.strerror or e}); give a path in "
          "a writable directory", file=sys.stderr)
    return 2
  print(f"{out}: {tokens.size:,} tokens (byte-level, vocab {VOCAB_SIZE}, uint16) from "
        f"{len(inputs)} file(s)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
