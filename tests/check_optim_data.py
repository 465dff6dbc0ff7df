# optim.py. Oracles: torch.optim.AdamW (param groups chosen by name), clip_grad_norm_
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import os

import pytest
import torch

import data
import optim
from model import Transformer

from tests.common import _trainer, assert_close
from tests.check_hf import HF_FIXTURES


@pytest.mark.fast
def test_functional_adamw_equals_torch_adamw_over_20_steps():
    torch.manual_seed(0)
    params = [torch.randn(8, 5), torch.randn(5), torch.randn(3, 4, 2)]
    ref = [p.clone().requires_grad_() for p in params]
    mask = [True, False, True]  # (the trainer's mask is tested by name against its rule below)
    torch_opt = torch.optim.AdamW([{"params": [ref[0], ref[2]], "weight_decay": 0.1},
                                   {"params": [ref[1]], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    state = optim.init_state(params)
    for step in range(1, 21):
        lr = optim.lr_at(step, 1e-2, 5, 20)
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        params, state = optim.adamw(params, grads, state, torch.tensor(float(step)), torch.tensor(lr),
                                    weight_decay=0.1, mask=mask)
        for mine, theirs in zip(params, ref):
            torch.testing.assert_close(mine, theirs.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("flags", [["--flavor", "qwen3_moe_debug"], ["--flavor", "qwen3_debug", "--scan"]])
def test_the_trainers_decay_mask_follows_the_rule_and_steps_like_torch_adamw(flags, corpus, tmp_path):
    """The mask the trainer really builds, checked per parameter against the modules it belongs to
    (Linear, Embedding and expert matrices decay; RMSNorm weights do not), also with --scan, where a
    norm weight is stacked to (L, D). Then one update against torch.optim.AdamW with groups by name."""
    from model import RMSNorm
    tr = _trainer(corpus, tmp_path, *flags)
    plain = Transformer(tr.model_args)  # per-layer names: layers.<i>.<path>
    norms = {n for m_name, m in plain.named_modules() if isinstance(m, RMSNorm) for n in [f"{m_name}.weight"]}
    per_layer = lambda name: name.replace("layers.", "layers.0.").replace("__", ".") if "--scan" in flags else name
    for name, decays in zip(tr.param_names, tr.opt.mask):
        assert per_layer(name) in dict(plain.named_parameters()), name
        assert decays == (per_layer(name) not in norms), name
    ref = [p.detach().clone().requires_grad_() for p in tr.params]
    names = dict(zip(tr.param_names, ref))
    torch_opt = torch.optim.AdamW([{"params": [p for n, p in names.items() if per_layer(n) not in norms], "weight_decay": 0.1},
                                   {"params": [p for n, p in names.items() if per_layer(n) in norms], "weight_decay": 0.0}],
                                  lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    grads = [torch.randn_like(p) for p in ref]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    torch_opt.step()  # lr 1.0: weight decay shrinks by 10%, a mask error is far above the tolerance
    tr.opt.step(grads, torch.tensor(1.0))
    for name, mine, theirs in zip(tr.param_names, tr.params, ref):
        assert_close(mine.detach(), theirs.detach(), name, rtol=0, atol=1e-5)


def test_adamw_is_pure():
    params, grads = [torch.ones(3, 3)], [torch.full((3, 3), 0.5)]
    state = optim.init_state(params)
    before = [params[0].clone(), state["exp_avg"][0].clone()]
    optim.adamw(params, grads, state, 1, 0.1)
    assert torch.equal(params[0], before[0]) and torch.equal(state["exp_avg"][0], before[1])


@pytest.mark.fast
@pytest.mark.parametrize("max_norm", [1.0, 1e3])  # above the norm (clipped) and below it (untouched)
def test_clipping_matches_torch(max_norm):
    torch.manual_seed(0)
    grads = [torch.randn(10, 10) * 3, torch.randn(7)]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    clipped, norm = optim.clip_by_global_norm(grads, max_norm)
    torch.testing.assert_close(norm, want_norm)
    for c, p in zip(clipped, ref):
        torch.testing.assert_close(c, p.grad)


def test_schedule_warmup_then_cosine():
    lrs = [optim.lr_at(s, 1.0, 10, 110) for s in range(1, 111)]
    assert lrs[:10] == pytest.approx([s / 10 for s in range(1, 11)])
    assert lrs[10] < 1.0 and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert optim.lr_at(60, 1.0, 10, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos = 0


# ------------------------------------------------------------------------------------------------
# data.py. Oracle: the one-process batch (rank slices concatenate to it)

@pytest.mark.fast
def test_data_is_deterministic_and_rank_dependent(corpus):
    train, val = data.load_corpus(corpus)
    assert len(train) > 0 and len(val) > 0 and len(train) > 10 * len(val)
    a, b = data.Batches(train, 4, 16, seed=1), data.Batches(train, 4, 16, seed=1)
    x1, y1 = a.get(7)
    x2, y2 = b.get(7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])            # targets are inputs shifted by one
    for world in (1, 2, 4):  # ranks read disjoint slices of B / world rows that make up the batch
        split = data.Batches(train, 4, 16, seed=1, world=world)
        parts = [split.get(7, r) for r in range(world)]
        assert all(x.shape == y.shape == (4 // world, 16) for x, y in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), x1) and torch.equal(torch.cat([y for _, y in parts]), y1)
    val = [data.eval_batches(val, 4, 16, 1, 2, rank, 2) for rank in (0, 1)]  # validation too
    assert all(x.shape == (2, 16) for batches in val for x, _ in batches)
    assert not torch.equal(val[0][0][0], val[1][0][0])
    assert not torch.equal(a.get(8)[0], x1)               # steps read different data
    assert not torch.equal(data.Batches(train, 4, 16, seed=2).get(7)[0], x1)


def test_default_corpus_is_the_stdlib_and_split_by_file(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i}\n" * 10)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")        # binary: skipped
    train, val = data.load_corpus(str(tmp_path))
    assert b"file 19" in val.tobytes() and b"file 39" in val.tobytes() and b"file 19" not in train.tobytes()
    assert b"\0" not in train.tobytes()
    assert "site-packages" not in data.stdlib_dir() and os.path.isfile(os.path.join(data.stdlib_dir(), "os.py"))


def test_a_data_dir_reads_only_regular_files_and_notes_what_it_skips(tmp_path, capsys):
    """A FIFO (a plain open() waits for a writer: forever), a dangling and a looping symlink are
    skipped with one note; the corpus is exactly the regular files' bytes in path order (written out
    here); such an entry named as --data itself is bad input (DataError: exit 2), not a hang."""
    import threading
    texts = [f"file {i}\n".encode() * 40 for i in range(3)]
    for i, text in enumerate(texts):
        (tmp_path / f"f{i}.txt").write_bytes(text)
    os.mkfifo(tmp_path / "a_fifo")
    (tmp_path / "b_dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "c_loop").symlink_to(tmp_path / "c_loop")
    (tmp_path / "d_link.txt").symlink_to(tmp_path / "f2.txt")  # a link to a regular file is read
    got = {}
    reader = threading.Thread(target=lambda: got.update(split=data.load_corpus(str(tmp_path))), daemon=True)
    reader.start()
    reader.join(timeout=15)
    if reader.is_alive():  # blocked on the FIFO: open its other end to release the thread, then fail
        os.close(os.open(tmp_path / "a_fifo", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("load_corpus blocked on a FIFO")
    train, val = got["split"]  # (fewer files than the validation stride: split by bytes, 95% / 5%)
    assert train.tobytes() + val.tobytes() == texts[2] + texts[0] + texts[1] + texts[2]
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("note:"), err
    assert all(name in err for name in ("a_fifo", "b_dangling", "c_loop")) and "f0.txt" not in err, err
    for entry, message in (("a_fifo", "not a regular file or a directory"), ("c_loop", "no such file")):
        with pytest.raises(data.DataError, match=message):
            data.load_corpus(str(tmp_path / entry))


def test_the_token_cache_is_verified_rebuilt_and_never_left_half_written(corpus, tmp_path, monkeypatch, capsys):
    """Zeros over a cached file's ids (its size and header kept), a truncated file, a lost checksum:
    each is found, named in one note and tokenized again, so the ids training reads always decode
    to the text (oracle: the tokenizers library's own decode) and equal the first tokenization. A
    write cut short by a file-size limit is an OSError naming the file, leaving no temporary file."""
    import resource
    import numpy as np
    from tokenizers import Tokenizer
    monkeypatch.setenv("MINITITAN_CACHE", str(tmp_path / "cache"))  # not the real ~/.cache
    qwen = os.path.join(HF_FIXTURES, "qwen3")
    text, val = data.load_corpus(corpus)
    first = np.array(data.tokenize(text, val, qwen)[0])
    assert Tokenizer.from_file(os.path.join(qwen, "tokenizer.json")).decode(first.tolist()) == text.tobytes().decode()
    folder = tmp_path / "cache" / "tokens"
    npy, = folder.glob("*-train.npy")
    size = npy.stat().st_size
    for damage in ("zeros", "truncated", "no checksum"):
        if damage == "zeros":
            raw = npy.read_bytes()
            head = 10 + int.from_bytes(raw[8:10], "little")  # .npy v1: magic, version, header length
            npy.write_bytes(raw[:head] + bytes(size - head))
        elif damage == "truncated":
            npy.write_bytes(npy.read_bytes()[:size // 2])
        else:
            (folder / (npy.name + ".sha256")).unlink()
        if damage == "zeros":  # through train.py: the batches read the rebuilt ids (the note printed at start)
            trainer = _trainer(corpus, tmp_path, "--tokenizer", qwen, "--set", "vocab_size=320")
            ids, err = trainer.task.batches.data, "".join(line + "\n" for line in trainer.notes)
        else:
            ids, err = data.tokenize(text, val, qwen)[0], capsys.readouterr().err
        assert np.array_equal(ids, first), damage
        assert err.count("note:") == 1 and f"the token cache {npy} " in err, (damage, err)
    for f in folder.iterdir():
        f.unlink()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))  # (Python ignores SIGXFSZ: the write fails)
    try:
        with pytest.raises(OSError) as failed:
            data.tokenize(text, val, qwen)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert failed.value.filename == str(npy) and "writing the token cache failed" in str(failed.value)
    assert list(folder.iterdir()) == []  # no .tmp left behind, and nothing unverified
