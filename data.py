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


def tokenize(train, val, tokenizer_dir):
    """(train, val) token ids (uint32, memory-mapped) of the byte arrays through a Hugging Face
    tokenizer.json, and the tokenizer's vocabulary size. Tokenized once: cached as .npy files in
    ~/.cache/minititan/tokens, keyed by the tokenizer's and the text's hashes (a changed file or
    tokenizer is a new key; the default corpus's directory is not ours to write into)."""
    from tokenizers import Tokenizer
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    try:
        with open(path, "rb") as f:
            spec = f.read()
        tok = Tokenizer.from_str(spec.decode("utf-8"))
    except Exception as e:  # missing, unreadable, not a tokenizer
        raise DataError(f"--tokenizer {path}: missing or unreadable ({type(e).__name__})") from None
    key = fingerprint(np.frombuffer(spec, dtype=np.uint8), train, val)
    cache = os.path.join(os.path.expanduser("~"), ".cache", "minititan", "tokens")
    os.makedirs(cache, exist_ok=True)
    out = []
    for name, text in (("train", train), ("val", val)):
        file = os.path.join(cache, f"{key}-{name}.npy")
        if not os.path.exists(file):
            lines = text.tobytes().decode("utf-8", errors="replace").splitlines(keepends=True)
            chunks = ["".join(lines[i:i + 512]) for i in range(0, len(lines), 512)]  # whole lines
            ids = [i for enc in tok.encode_batch(chunks, add_special_tokens=False) for i in enc.ids]
            tmp = f"{file}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                np.save(f, np.asarray(ids, dtype=np.uint32))
            os.replace(tmp, file)  # atomic: a concurrent or crashed run never reads half a file
        out.append(np.load(file, mmap_mode="r"))
    return out[0], out[1], tok.get_vocab_size()


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
