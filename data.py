"""data.py: byte-level text data with a deterministic split and a resumable, per-rank batch order.

Tokens are raw bytes (vocab 256): no tokenizer to download, any text trains. The default corpus is
one every machine with Python has: the running interpreter's standard-library sources (~37 MB of real
code and docstrings), found through sysconfig, without site-packages.

Global batch `i` is a pure function of (seed, i): random windows drawn by a generator seeded with
exactly those numbers; data-parallel rank `r` of `w` reads rows [r*B/w, (r+1)*B/w) of it. So the
data position is just the step counter, resuming is exact, ranks read different data without
coordinating, and N ranks together see exactly what one process would (the oracle of the FSDP tests).

Only regular files are read (a FIFO in a data directory would block a plain read forever); entries
that cannot be read (a dangling symlink, no permission) are skipped with one `note:` line. Token ids
(--tokenizer) are cached beside a sha256 of their file, verified on every load and rebuilt on a
mismatch (bit rot, a truncated or overwritten file), with a note: a cache must never change what
trains. `notes`: a list that collects those lines for the caller, or None to print them on stderr.
"""
import hashlib
import os
import stat
import sys
import sysconfig

import numpy as np

import atomic
from errors import BadInput
import torch


BYTE_VOCAB = 256  # one token per byte value


class DataError(BadInput):
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


def _say(line, notes):
    if notes is None:
        print(line, file=sys.stderr, flush=True)
    else:
        notes.append(line)


def _read_regular(path):
    """The bytes of `path` if it is (or links to) a regular file, else None (a FIFO, socket, device).
    Opened non-blocking and checked after opening: open() of a FIFO waits for a writer, and a check
    before opening could race with a rename."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (no effect on a regular file's reads)
    with open(fd, "rb") as f:
        return f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else None


def _read_texts(root, notes):
    """Every text file under `root`, sorted by path; what is not a readable regular file is skipped
    and named in one note (binary files, holding NUL bytes, are skipped silently)."""
    texts, skipped = [], []
    for path in _text_files(root):
        try:
            data = _read_regular(path)
            why = None if data is not None else "not a regular file"
        except OSError as e:  # a dangling or looping symlink, no permission, an I/O error
            data, why = None, e.strerror or type(e).__name__
        if why:
            skipped.append(f"{os.path.relpath(path, root)} ({why})")
        elif data and b"\0" not in data:  # (empty files hold no text either)
            texts.append(data)
    if skipped:
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        _say(f"note: --data {root}: skipped {len(skipped)} entries that are not readable regular files: "
             f"{', '.join(skipped[:3])}{more}", notes)
    return texts


def load_corpus(path=None, val_fraction=0.05, notes=None):
    """(train, val) uint8 arrays. A directory: every `1/val_fraction`-th text file (sorted) is held
    out for validation. A single file: its last val_fraction of bytes."""
    path = path or stdlib_dir()
    if not os.path.exists(path):
        raise DataError(f"--data {path}: no such file or directory")
    if not os.path.isdir(path):
        try:
            data = _read_regular(path)
        except OSError as e:
            raise DataError(f"--data {path}: cannot be read ({e.strerror or type(e).__name__})") from None
        if data is None:
            raise DataError(f"--data {path}: not a regular file or a directory")
        data = b"" if b"\0" in data else data
        cut = int(len(data) * (1 - val_fraction))
        train, val = data[:cut], data[cut:]
    else:
        texts = _read_texts(path, notes)
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


def cache_dir():
    """Where minititan caches what it derives: $MINITITAN_CACHE, else ~/.cache/minititan."""
    return os.environ.get("MINITITAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minititan")


def _write_atomic(path, write):
    """write(f) into `path` atomically (a concurrent or crashed run never reads half a file); a failed
    write is an OSError naming `path` (np.save's short write carries no errno or name)."""
    try:
        with atomic.written(path) as tmp, open(tmp, "wb") as f:
            write(f)
    except OSError as e:
        why = e.strerror or f"a short write, {e}: the disk is full or a file-size limit was hit"
        raise OSError(e.errno, f"writing the token cache failed ({why})", path) from None


def _read_cached(path):
    """(ids, None) if `path` holds the ids its `.sha256` file vouches for; (None, why) if not; (None,
    None) if there is no such cache entry yet."""
    if not os.path.exists(path):
        return None, None
    try:
        with open(path + ".sha256", encoding="ascii") as f:
            want = f.read().strip()
    except (OSError, ValueError):  # (written by a version without checksums, or lost)
        return None, "has no readable checksum file"
    try:
        if atomic.sha256_of(path) != want:
            return None, "does not match its checksum (corrupt or truncated)"
        ids = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        return None, f"is unreadable ({getattr(e, 'strerror', None) or type(e).__name__})"
    if ids.dtype != np.uint32 or ids.ndim != 1:
        return None, f"holds {ids.dtype} {ids.shape}, not a list of token ids"
    return ids, None


def _encode(tok, text):
    lines = text.tobytes().decode("utf-8", errors="replace").splitlines(keepends=True)
    chunks = ["".join(lines[i:i + 512]) for i in range(0, len(lines), 512)]  # whole lines
    return np.asarray([i for enc in tok.encode_batch(chunks, add_special_tokens=False) for i in enc.ids],
                      dtype=np.uint32)


def tokenize(train, val, tokenizer_dir, cache=None, notes=None):
    """(train, val) token ids (uint32, memory-mapped) of the byte arrays through a Hugging Face
    tokenizer.json, and the tokenizer's vocabulary size. Tokenized once: cached as .npy files (each
    with a .sha256 beside it) in `cache`/tokens (default cache_dir()), keyed by the tokenizer's and
    the text's hashes (a changed file or tokenizer is a new key; the default corpus's directory is
    not ours to write into). A cached file that does not verify is tokenized again, with a note."""
    from tokenizers import Tokenizer
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    try:
        with open(path, "rb") as f:
            spec = f.read()
        tok = Tokenizer.from_str(spec.decode("utf-8"))
    except Exception as e:  # missing, unreadable, not a tokenizer
        raise DataError(f"--tokenizer {path}: missing or unreadable ({type(e).__name__})") from None
    key = fingerprint(np.frombuffer(spec, dtype=np.uint8), train, val)
    folder = os.path.join(cache or cache_dir(), "tokens")
    os.makedirs(folder, exist_ok=True)
    out = []
    for name, text in (("train", train), ("val", val)):
        file = os.path.join(folder, f"{key}-{name}.npy")
        ids, problem = _read_cached(file)
        if ids is None:
            if problem:
                _say(f"note: the token cache {file} {problem}; tokenizing again", notes)
            fresh = _encode(tok, text)
            # the checksum is written second: a crash between the two renames is a mismatch, not trust
            _write_atomic(file, lambda f: np.save(f, fresh))
            _write_atomic(file + ".sha256", lambda f: f.write(atomic.sha256_of(file).encode()))
            ids = np.load(file, mmap_mode="r")
        out.append(ids)
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
