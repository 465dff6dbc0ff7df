"""data.py: byte-level text data with a deterministic split and a resumable, per-rank batch order.

Tokens are raw bytes (vocab 256): no tokenizer to download, any text trains. The default corpus is
one every machine with Python has: the running interpreter's standard-library sources (~37 MB of real
code and docstrings), found through sysconfig, without site-packages.

Global batch `i` is a pure function of (seed, i): random windows drawn by a generator seeded with
exactly those numbers; data-parallel rank `r` of `w` reads rows [r*B/w, (r+1)*B/w) of it. So the
data position is just the step counter, resuming is exact, ranks read different data without
coordinating, and N ranks together see exactly what one process would (the oracle of the FSDP tests).
"""
import hashlib
import os
import sysconfig

import numpy as np
import torch


BYTE_VOCAB = 256  # one token per byte value


class DataError(ValueError):
    pass


def fingerprint(*arrays):
    """A short content hash of the corpus (a resumed run must read the same data)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        h.update(len(a).to_bytes(8, "little"))
        h.update(a.tobytes())
    return h.hexdigest()


def stdlib_dir():
    return sysconfig.get_paths()["stdlib"]


def _text_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


def _read_text(path):
    with open(path, "rb") as f:
        data = f.read()
    return None if b"\0" in data else data  # NUL bytes: a binary file (.so, .pyc), skip


def load_corpus(path=None, val_fraction=0.05):
    """(train, val) uint8 arrays. A directory: every `1/val_fraction`-th text file (sorted) is held
    out for validation. A single file: its last val_fraction of bytes."""
    path = path or stdlib_dir()
    if not os.path.exists(path):
        raise DataError(f"--data {path}: no such file or directory")
    if os.path.isfile(path):
        data = _read_text(path) or b""
        cut = int(len(data) * (1 - val_fraction))
        train, val = data[:cut], data[cut:]
    else:
        texts = [t for t in map(_read_text, _text_files(path)) if t]
        every = max(2, round(1 / val_fraction))
        if len(texts) >= every:
            train = b"".join(t for i, t in enumerate(texts) if i % every != every - 1)
            val = b"".join(t for i, t in enumerate(texts) if i % every == every - 1)
        else:
            data = b"".join(texts)
            cut = int(len(data) * (1 - val_fraction))
            train, val = data[:cut], data[cut:]
    if not train:
        raise DataError(f"--data {path}: no text found (empty, or only binary files)")
    return np.frombuffer(train, dtype=np.uint8), np.frombuffer(val, dtype=np.uint8)


class Batches:
    """Random windows of seq_len + 1 bytes -> (inputs, targets), each (B / world, S) int64."""

    def __init__(self, data, batch_size, seq_len, seed, world=1):
        if len(data) < seq_len + 2:
            raise DataError(f"corpus split has {len(data)} bytes, fewer than seq_len + 2 = {seq_len + 2}")
        self.data, self.batch_size, self.seq_len, self.seed, self.world = data, batch_size, seq_len, seed, world

    def get(self, index, rank=0):
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch_size)
        per_rank = self.batch_size // self.world
        starts = starts[rank * per_rank:(rank + 1) * per_rank]
        windows = np.stack([self.data[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        chunk = torch.from_numpy(windows)
        return chunk[:, :-1], chunk[:, 1:]


def eval_batches(val, batch_size, seq_len, seed, count, rank=0, world=1):
    """A fixed list of validation batches (the same at every evaluation, so losses compare)."""
    if count <= 0 or len(val) < seq_len + 2:
        return []
    batches = Batches(val, batch_size, seq_len, seed + 1_000_003, world)
    return [batches.get(i, rank) for i in range(count)]
