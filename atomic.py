"""atomic.py: a file or directory is written whole or not at all, and a file's digest verifies it.

Every writer of minititan (checkpoints, the token cache, Hugging Face exports, the loss plot, FLUX's
latents and samples, the arithmetic corpus, benchmark tables) writes the same way: into a temporary
name beside the target, then one rename, which POSIX makes atomic. A reader, a concurrent run or a
crash therefore sees the old file or the new one, never half of one; a failed write removes its
temporary and leaves the target as it was. `durable` adds fsync before the rename, for what must
survive a power cut too (checkpoints, exports). A file's sha256 is what a checkpoint's meta.json, the
token cache and FLUX's prepared latents record, and check on every read.

The temporary name carries the process id, so two processes writing the same target never share one.
Below everything but errors.py: it imports nothing of ours.
"""
import contextlib
import hashlib
import os
import shutil


def sha256_of(path):
    """The hex sha256 of a file's bytes (read in chunks: a checkpoint shard may be larger than memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync(path):
    """Flush a file, or a directory's entries (a rename is only durable once its directory is), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def written(path, durable=False):
    """`with written(path) as tmp:` write the file `tmp`; when the block ends it is renamed to `path`.
    Any failure, an interrupt included, removes `tmp` and re-raises: `path` is as it was."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        yield tmp
        if durable:
            fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write(path, data, durable=False):
    """`path` holds `data` (str or bytes), atomically."""
    with written(path, durable) as tmp, open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def replace_dir(tmp, path):
    """Rename the finished directory `tmp` to `path`, durably. An existing non-empty `path` is set aside
    until the new one is in place (put back if the rename fails), then removed: no file of the old
    directory survives beside the new ones. A failure removes `tmp`."""
    old = f"{tmp}.old"
    try:
        if os.path.isdir(path) and os.listdir(path):
            os.rename(path, old)
        os.rename(tmp, path)  # (rename replaces an empty directory atomically)
    except BaseException:
        if os.path.isdir(old) and not os.path.exists(path):
            os.rename(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    fsync(os.path.dirname(os.path.abspath(path)))
