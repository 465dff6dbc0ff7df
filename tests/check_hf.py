# interop/hf.py + generate.py. Oracles: transformers' logits and greedy generate() on tiny random
# checkpoints (fixtures/make_hf_fixtures.py), full recomputation (KV cache), sort-based filters
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import json
import os
import re
import resource

import pytest
import torch

import data
from model import FLAVORS, ModelArgs, Transformer

from tests import launch
from tests.common import HERE, TINY, _full_params, _main, _near, _records, background, run_train, torchrun


HF_FIXTURES = os.path.join(HERE, "fixtures", "hf")


def _expected(name):
    from safetensors.torch import load_file
    return load_file(os.path.join(HF_FIXTURES, name, "expected.safetensors"))


@pytest.mark.fast
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe"])
def test_hf_checkpoint_logits_and_greedy_text_equal_transformers(name, tmp_path):
    """Every module's arithmetic (norms, llama3 rope scaling, q/k norm, tied embeddings, MoE routing)
    against transformers' own forward and generate(); export -> import is bit for bit."""
    import generate
    from interop import hf
    want = _expected(name)
    model = hf.load(os.path.join(HF_FIXTURES, name))
    with torch.no_grad():
        got = model(want["input_ids"])
    scale = want["logits"].abs().max().item()
    torch.testing.assert_close(got, want["logits"], rtol=1e-4, atol=1e-4 * scale)
    assert generate.generate(model, want["prompt"][0].tolist(), 16) == want["greedy"][0].tolist()
    out = hf.save(model, str(tmp_path / "export"), max_shard_bytes=200_000)  # small: a sharded index
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    again = hf.load(out)
    for (n, p), (m, q) in zip(model.named_parameters(), again.named_parameters()):
        assert n == m and torch.equal(p, q), n
    from safetensors.torch import load_file
    original = load_file(os.path.join(HF_FIXTURES, name, "model.safetensors"))
    exported = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(os.path.join(out, f)).items()}
    assert exported.keys() == original.keys() - {"lm_head.weight"} if model.args.tie_embeddings else exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in exported)


def test_hf_bf16_checkpoints_load_converted_and_generation_stops_at_eos(tmp_path):
    import generate
    from interop import hf
    from safetensors.torch import load_file, save_file
    src = os.path.join(HF_FIXTURES, "qwen3_moe")
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    save_file({k: v.bfloat16() for k, v in load_file(os.path.join(src, "model.safetensors")).items()},
              str(bf16 / "model.safetensors"))
    full, half = hf.load(src), hf.load(str(bf16))
    for (name, p), (_, q) in zip(full.named_parameters(), half.named_parameters()):
        assert q.dtype == torch.float32 and torch.equal(q, p.bfloat16().float()), name
    prompt = _expected("qwen3_moe")["prompt"][0].tolist()
    first = generate.generate(full, prompt, 5)
    assert generate.generate(full, prompt, 5, eos_id=first[1]) == first[:2]  # stops after the EOS token


@pytest.mark.parametrize("flavor", ["llama3_debug", "qwen3_debug", "qwen3_moe_debug"])
def test_kv_cache_decoding_equals_full_recomputation(flavor):
    import generate
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(FLAVORS[flavor], n_layers=2))
    tokens = torch.randint(0, 256, (1, 20))
    cache = generate.KVCache(model.args, 1, 20, "cpu")
    with torch.no_grad():
        full = model(tokens)[0]
        steps = [model(tokens[:, :8], sequence=cache)[0]]  # prefill 8, then one token at a time
        cache.pos += 8
        for t in range(8, 20):
            steps.append(model(tokens[:, t:t + 1], sequence=cache)[0])
            cache.pos += 1
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-5, atol=1e-5)
    ids = generate.generate(model, tokens[0, :5].tolist(), 10)  # greedy with the cache == argmax of full recompute
    seq = tokens[0, :5].tolist()
    for _ in range(10):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert ids == seq[5:]


def test_top_k_and_top_p_filters_match_a_sort_based_reference():
    import generate
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50) * 3
        k, p = int(torch.randint(1, 50, ())), float(torch.rand(()))
        kept = set(torch.argsort(logits, descending=True)[:k].tolist())
        assert set(torch.isfinite(generate.top_k_filter(logits, k)).nonzero().flatten().tolist()) == kept
        order = torch.argsort(logits, descending=True).tolist()
        probs, total, nucleus = torch.softmax(logits, -1), 0.0, set()
        for i in order:  # the smallest prefix of the sorted tokens whose mass reaches p
            nucleus.add(i)
            total += float(probs[i])
            if total >= p:
                break
        assert set(torch.isfinite(generate.top_p_filter(logits, p)).nonzero().flatten().tolist()) == nucleus


def test_sampling_same_seed_same_text_and_the_cli(tmp_path, capsys):
    import generate
    from interop import hf
    model = hf.load(os.path.join(HF_FIXTURES, "qwen3"))
    draw = lambda seed: generate.generate(model, [5, 6, 7], 24, temperature=1.0, top_k=40, top_p=0.9, seed=seed)
    assert draw(1) == draw(1) and draw(1) != draw(2)
    assert generate.main(["--hf", os.path.join(HF_FIXTURES, "qwen3"), "def main(", "--max-new-tokens", "8",
                          "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("def main(")


def test_bad_hf_and_generation_inputs_are_one_line(tmp_path, capsys):
    import shutil
    import generate
    from interop import hf
    broken = {}
    for label, edit in [("model_type", {"model_type": "gpt2"}), ("norm_topk_prob", {"norm_topk_prob": False}),
                        ("attention_bias", {"attention_bias": True}), ("shape", {"moe_intermediate_size": 30})]:
        d = tmp_path / label
        shutil.copytree(os.path.join(HF_FIXTURES, "qwen3_moe"), d)
        (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **edit}))
        broken[label] = str(d)
    for label, message in [("model_type", "model_type 'gpt2' is not supported"),
                           ("norm_topk_prob", "norm_topk_prob=false is not implemented"),
                           ("attention_bias", "attention_bias=True is not implemented"),
                           ("shape", "gate_proj.weight has shape [32, 64], config.json implies [30, 64]")]:
        with pytest.raises(hf.HFError, match=re.escape(message)):
            hf.load(broken[label])
    with pytest.raises(hf.HFError, match="config.json: missing or unreadable"):
        hf.load(str(tmp_path))
    run_dir = tmp_path / "run"  # (a train.py run's layout, given where a HF directory belongs)
    (run_dir / "checkpoints").mkdir(parents=True)
    mixed = tmp_path / "mixed"  # a 300-token tokenizer on a 256-token model
    shutil.copytree(os.path.join(HF_FIXTURES, "llama"), mixed)
    shutil.copy(os.path.join(HF_FIXTURES, "qwen3", "tokenizer.json"), mixed / "tokenizer.json")
    for argv, message in [(["--hf", str(mixed), "x"], "the tokenizer has 300 tokens, the model only 256"),
                          (["--hf", os.path.join(HF_FIXTURES, "qwen3"), ""], "the prompt is empty"),
                          (["--run", str(tmp_path), "x"], "holds no checkpoint to read"),
                          (["--hf", str(run_dir), "x"], "is a train.py run, not a Hugging Face directory: `python -m interop.hf export")]:
        assert generate.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err


def test_generate_on_a_tokenizer_run_picks_its_tokenizer_and_checkpoint_and_refuses_in_one_line(
        corpus, tmp_path, monkeypatch, capsys):
    """A run trained with --tokenizer records it, and generate.py --run writes that tokenizer's text
    (oracle: the tokenizers library's encode / decode around a greedy argmax over the full sequence,
    on weights DCP loads straight from the checkpoint). A broken newest checkpoint names the good
    one to pass instead, which generate and python -m interop.hf export both accept; a model_args key from another
    version, a NaN or infinite temperature and a vanished tokenizer are one line; an error after
    the prompt was echoed starts on its own line; a character split between tokens prints whole."""
    import shutil
    import generate
    from interop import hf
    from interop import tokenizer
    import train
    from tokenizers import Tokenizer
    monkeypatch.setenv("MINITITAN_CACHE", str(tmp_path / "cache"))
    tok_dir, run = tmp_path / "tok", tmp_path / "run"
    tok_dir.mkdir()
    shutil.copy(os.path.join(HF_FIXTURES, "qwen3", "tokenizer.json"), tok_dir)
    args = [*TINY, "--set", "vocab_size=320"]
    assert _main([*args, "--data", corpus, "--tokenizer", str(tok_dir), "--steps", "2", "--ckpt-interval", "1",
                  "--eval-batches", "0", "--out-dir", str(run)]) == 0
    tok, prompt = Tokenizer.from_file(str(tok_dir / "tokenizer.json")), "def main("
    split = [tok.token_to_id("Ã"), tok.token_to_id("©")]  # "é" as its two byte tokens: printed whole
    show = tokenizer.HFTokenizer(str(tok_dir)).stream()
    assert "".join(map(show, split)) + show(None) == tok.decode(split) == "é"

    def greedy_text(step_name):  # 6 tokens by argmax over the whole sequence, no KV cache
        model = Transformer(train.model_args(train.parse_config(args)))
        model.load_state_dict(_full_params(str(run / "checkpoints"), args, step_name))
        seq = tok.encode(prompt, add_special_tokens=False).ids
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        return prompt + tok.decode(seq[-6:]) + "\n"

    def one_line(argv, message, tool=generate.main):
        assert tool(argv) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
        return captured.out

    sample = ["--max-new-tokens", "6", "--temperature", "0"]
    capsys.readouterr()
    assert generate.main(["--run", str(run), prompt, *sample]) == 0
    assert capsys.readouterr().out == greedy_text("step_000002")
    future = tmp_path / "future"  # the same run, its meta.json as a later version might write it
    shutil.copytree(run, future)
    meta_file = future / "checkpoints" / "step_000002" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["model_args"]["attn_logit_softcap"] = 50.0
    meta_file.write_text(json.dumps(meta))
    one_line(["--run", str(future), "x"], "model_args attn_logit_softcap unknown to this version")
    one_line(["export", str(future), str(tmp_path / "exported")], "model_args attn_logit_softcap unknown", hf.main)
    for bad in ("nan", "inf"):
        one_line(["--run", str(run), "x", "--temperature", bad], f"--temperature {bad}: must be finite and >= 0")
    out = one_line(["--run", str(run), "hi", "--max-new-tokens", "100000"], "exceeds the model's max_seq_len")
    assert out == "hi\n"  # (the echoed prompt, then the error on a line of its own)
    newest, good = run / "checkpoints" / "step_000002", run / "checkpoints" / "step_000001"
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-8])
    hint = f"the newest good one is {good}: pass it in place of {run}"
    for argv, tool in ((["--run", str(run), "x"], generate.main), (["export", str(run), str(tmp_path / "e")], hf.main)):
        one_line(argv, hint, tool)
    assert generate.main(["--run", str(good), prompt, *sample]) == 0
    assert capsys.readouterr().out == greedy_text("step_000001")
    assert hf.main(["export", str(good), str(tmp_path / "exported")]) == 0  # (its tokenizer's file, as it is)
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    shutil.rmtree(tok_dir)
    one_line(["--run", str(good), "x"], f"this run trained on the tokenizer in {tok_dir}, which is gone")
    one_line(["export", str(good), str(tmp_path / "e")], f"the tokenizer in {tok_dir}, whose tokenizer.json is gone",
             hf.main)
    assert not os.path.exists(tmp_path / "e")


# config.json key -> (ModelArgs field, the value model.py must get), written out from HF's documentation
HF_FIELDS = {"rope_theta": ("rope_theta", float), "rms_norm_eps": ("norm_eps", float), "head_dim": ("head_dim", int),
             "max_position_embeddings": ("max_seq_len", int), "tie_word_embeddings": ("tie_embeddings", bool),
             "num_key_value_heads": ("n_kv_heads", int),
             "rope_scaling": ("rope_scaling", lambda r: r and (r["factor"], r["low_freq_factor"], r["high_freq_factor"],
                                                         r["original_max_position_embeddings"])),
             "num_experts": ("n_experts", int), "num_experts_per_tok": ("top_k", int),
             "moe_intermediate_size": ("moe_ffn_dim", int), "router_aux_loss_coef": ("aux_loss_coef", float)}


def test_every_config_field_reaches_the_model():
    """Each config.json field interop/hf.py reads is set in some fixture away from the value a loader that
    ignored it would use (ModelArgs' default, HF's num_key_value_heads = heads), and arrives in
    ModelArgs. The logits test above then shows each one is also used as transformers uses it."""
    from interop import hf
    shown = set()
    for name in ("llama", "qwen3", "qwen3_moe"):
        cfg = json.load(open(os.path.join(HF_FIXTURES, name, "config.json")))
        args = hf.args_from_config(hf.read_config(os.path.join(HF_FIXTURES, name)))
        for key, (field, value) in HF_FIELDS.items():
            if key in cfg:
                assert getattr(args, field) == value(cfg[key]), (name, key)
                fallback = cfg["num_attention_heads"] if key == "num_key_value_heads" else getattr(ModelArgs(), field)
                shown |= {key} if value(cfg[key]) != fallback else set()
        shown |= {f"rope_scaling.{k}" for k, v in (cfg.get("rope_scaling") or {}).items()
                  if k != "rope_type" and v != dict(zip(["factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings"], (8.0, 1.0, 4.0, 8192)))[k]}
    assert shown == {*HF_FIELDS, "rope_scaling.factor", "rope_scaling.low_freq_factor",
                     "rope_scaling.high_freq_factor", "rope_scaling.original_max_position_embeddings"}, shown


def _hf_copy(tmp_path, label, name, tensors=None, drop=()):
    """A copy of fixture `name` with tensors added / replaced (`tensors(weights)`) or dropped."""
    from safetensors.torch import load_file, save_file
    import shutil
    d = tmp_path / label
    d.mkdir()
    shutil.copy(os.path.join(HF_FIXTURES, name, "config.json"), d / "config.json")
    weights = load_file(os.path.join(HF_FIXTURES, name, "model.safetensors"))
    save_file({**{k: v for k, v in weights.items() if k not in drop}, **(tensors(weights) if tensors else {})},
              str(d / "model.safetensors"))
    if os.path.exists(os.path.join(HF_FIXTURES, name, "tokenizer.json")):
        os.symlink(os.path.join(HF_FIXTURES, name, "tokenizer.json"), d / "tokenizer.json")
    return str(d)


def test_hf_config_of_the_wrong_type_is_one_line_in_train_and_generate(corpus, tmp_path, capsys):
    """JSON has one number type and `true` is not a layer count: each wrong type is refused naming the
    field (never a 1-layer model from `true`, never a traceback), in train.py --init-from and generate --hf."""
    import generate
    import train
    cases = [({"num_hidden_layers": True}, "num_hidden_layers must be an integer, got true"),
             ({"hidden_size": "64"}, 'hidden_size must be an integer, got "64"'),
             ({"num_hidden_layers": 4.5}, "num_hidden_layers must be an integer, got 4.5"),
             ({"hidden_size": None}, "hidden_size must be an integer, got null"),
             ({"rope_scaling": "llama3"}, 'rope_scaling must be an object or null, got "llama3"'),
             ({"rms_norm_eps": "1e-5"}, 'rms_norm_eps must be a number, got "1e-5"'),
             ({"tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false, got "false"'),
             ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}}, 'rope_scaling: factor must be a number'),
             ({"head_dim": 0}, "head_dim must be positive"),
             (lambda cfg: [cfg], "config.json must be a JSON object, got list")]
    for i, (edit, message) in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        cfg = json.load(open(os.path.join(HF_FIXTURES, "qwen3", "config.json")))
        (d / "config.json").write_text(json.dumps(edit(cfg) if callable(edit) else {**cfg, **edit}))
        for f in ("model.safetensors", "tokenizer.json"):
            os.symlink(os.path.join(HF_FIXTURES, "qwen3", f), d / f)
        out_dir = str(tmp_path / f"run{i}")
        for main, argv in [(train.main, ["--init-from", str(d), "--data", corpus, "--seq-len", "32", "--out-dir", out_dir]),
                           (generate.main, ["--hf", str(d), "x"])]:
            assert main(argv) == 2, (edit, main)
            err = capsys.readouterr().err.strip()
            assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, (edit, err)
        assert not os.path.exists(out_dir)


def test_hf_loader_uses_every_tensor_and_finds_every_one_it_needs(tmp_path, capsys):
    """A weight the config does not describe would be dropped silently, a missing one left at its
    initialization, an int8 one cast to a meaningless float: each refused naming the tensors. Floats
    of any width convert; a tied model may carry its head if it is the embedding; a directory with
    both a model.safetensors and an index is ambiguous. Oracle for the TP / FSDP reads: any block of
    any parameter, read alone, is that block of the whole parameter."""
    import generate
    from interop import hf
    layer = lambda w, i, j: {k.replace(f"layers.{i}.", f"layers.{j}."): v.clone() for k, v in w.items() if f"layers.{i}." in k}
    bad = [("four_layers", "llama", lambda w: {**layer(w, 0, 2), **layer(w, 1, 3)}, (),
            "the checkpoint holds 18 tensors config.json does not describe (they would be dropped): "
            "model.layers.2.*, model.layers.3.*"),
           ("stray", "llama", lambda w: {"model.layers.7.mlp.up_proj.weight": w["model.layers.0.mlp.up_proj.weight"].clone()}, (),
            "does not describe (they would be dropped): model.layers.7.mlp.up_proj.weight"),
           ("missing", "qwen3_moe", None, ("model.layers.1.mlp.experts.3.down_proj.weight",),
            "the checkpoint lacks 1 tensors config.json implies: model.layers.1.mlp.experts.3.down_proj.weight"),
           ("int8", "llama", lambda w: {"model.norm.weight": w["model.norm.weight"].to(torch.int8)}, (),
            "model.norm.weight is I8: only floating-point weights load"),
           ("untied_head", "qwen3", lambda w: {"lm_head.weight": w["model.embed_tokens.weight"] + 1}, (),
            "does not describe (they would be dropped): lm_head.weight")]
    for label, name, tensors, drop, message in bad:
        with pytest.raises(hf.HFError, match=re.escape(message)):
            hf.load(_hf_copy(tmp_path, label, name, tensors, drop))
    assert generate.main(["--hf", str(tmp_path / "untied_head"), "x"]) == 2  # the CLI: one line
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("dropped): lm_head.weight"), err
    want = hf.load(os.path.join(HF_FIXTURES, "qwen3"))
    half = hf.load(_hf_copy(tmp_path, "f16", "qwen3", tensors=lambda w: {k: v.half() for k, v in w.items()}))
    tied = hf.load(_hf_copy(tmp_path, "tied", "qwen3", tensors=lambda w: {"lm_head.weight": w["model.embed_tokens.weight"].clone()}))
    for (n, p), (_, q), (_, r) in zip(want.named_parameters(), half.named_parameters(), tied.named_parameters()):
        assert q.dtype == torch.float32 and torch.equal(q, p.half().float()) and torch.equal(r, p), n
    both = tmp_path / "both"  # a sharded export, then an unsharded one beside it (made by hand: hf.save refuses)
    hf.save(want, str(both), max_shard_bytes=200_000)
    os.symlink(os.path.join(HF_FIXTURES, "qwen3", "model.safetensors"), both / "model.safetensors")
    with pytest.raises(hf.HFError, match="holds both model.safetensors and model.safetensors.index.json"):
        hf.load(str(both))
    os.remove(both / "model.safetensors")
    index = json.loads((both / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]  # its shard still holds it: the index leaves it out
    (both / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf.HFError, match="and model.safetensors.index.json disagree on model.norm.weight"):
        hf.load(str(both))
    for name in ("llama", "qwen3_moe"):  # each parameter's blocks: 2 pieces per dim, as TP x FSDP cut them
        path = os.path.join(HF_FIXTURES, name)
        full, reader = hf.load(path), hf.Reader(path)
        for pname, p in full.named_parameters():
            for corner in range(2 ** p.dim()):
                box = [(0, n // 2) if corner >> d & 1 else (n // 2, n) for d, n in enumerate(p.shape)]
                piece = hf.read_param(reader, pname, tuple(p.shape), box)
                assert torch.equal(piece, p[tuple(slice(a, b) for a, b in box)]), (pname, box)


def test_export_never_clobbers_and_a_failed_write_keeps_the_old_files(corpus, tmp_path, capsys):
    """python -m interop.hf export writes a whole directory or nothing: a non-empty target is refused (a user's files
    there stay), --overwrite replaces it whole (an old sharded export's index does not survive to be
    loaded instead) but never the run it reads, and a write that fails (a 256 KiB file-size limit)
    leaves the previous export bit for bit, no temporary directory behind, one line, exit 5. Oracle:
    the run's own weights."""
    from run import checkpoint
    from interop import hf
    run = str(tmp_path / "run")
    assert _main([*TINY, "--data", corpus, "--steps", "1", "--eval-batches", "0", "--sample-tokens", "0",
                  "--out-dir", run]) == 0
    model, _ = checkpoint.load_run(run)
    hf.save(Transformer(model.args), str(tmp_path / "out"), max_shard_bytes=100_000)  # an older export: other
    # weights, sharded with an index that a loader would prefer to a new model.safetensors beside it
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_text("mine")
    (tmp_path / "file").write_text("mine")
    capsys.readouterr()
    for target, message in [(user, "is not empty (config.json); an export writes a whole directory: pass --overwrite"),
                            (tmp_path / "out", "is not empty"), (tmp_path / "file", "exists and is not a directory"),
                            (tmp_path / "file" / "sub", "cannot write")]:
        assert hf.main(["export", run, str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert (user / "config.json").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    kept = sorted(os.listdir(os.path.join(run, "checkpoints")))
    for target in (run, str(tmp_path), os.path.join(run, "checkpoints"),  # (each replaced the run's checkpoints)
                   os.path.join(run, "checkpoints", "step_000001")):
        assert hf.main(["export", run, target, "--overwrite"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: {target} overlaps the run it would export ({run}): an export there would replace the " \
                      "run's checkpoints; choose a directory outside the run", err
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == kept
    assert hf.main(["export", run, str(tmp_path / "out"), "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    for (n, p), (_, q) in zip(model.named_parameters(), hf.load(str(tmp_path / "out")).named_parameters()):
        assert torch.equal(p, q), n
    before = {f: checkpoint.sha256_of(tmp_path / "out" / f) for f in os.listdir(tmp_path / "out")}
    rc, _, err = launch.python(["-m", "interop.hf", "export", run, str(tmp_path / "out"), "--overwrite"],
                               limits={resource.RLIMIT_FSIZE: 256 * 1024})
    err = err.strip()
    assert rc == 5 and len(err.splitlines()) == 1 and err.startswith("error: a write failed"), err
    assert {f: checkpoint.sha256_of(tmp_path / "out" / f) for f in os.listdir(tmp_path / "out")} == before
    assert sorted(os.listdir(tmp_path)) == ["file", "out", "run", "user"]  # no temporary directory left


@pytest.mark.fast
def test_a_byte_runs_export_reads_in_transformers_as_its_tokenizer_and_model(corpus, tmp_path, capsys):
    """python -m interop.hf export writes a byte run's tokenizer beside the weights. Oracles, none of them ours:
    transformers' AutoTokenizer turns text in several scripts into exactly its UTF-8 bytes and back, its
    vocabulary is the 256 byte values, and transformers' model on those ids gives our model's logits
    (within 1e-4 of their scale, as for the HF fixtures). generate.py --hf on the export then writes
    what generate.py --run writes on the run. Before, an export had no tokenizer: AutoTokenizer and
    generate.py --hf both failed on it."""
    from run import checkpoint
    import generate
    from interop import hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    assert _main([*TINY, "--data", corpus, "--steps", "2", "--eval-batches", "0", "--sample-tokens", "0",
                  "--out-dir", run]) == 0
    assert hf.main(["export", run, out]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n\treturn 'h\u00e9llo', \u20ac5, \u65e5\u672c, \U0001f642 \x00\x7f  end"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text, (ids, list(text.encode()))
    assert sorted(tok.get_vocab().values()) == list(range(256))
    model, _ = checkpoint.load_run(run)
    theirs = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        ours, want = model(torch.tensor([ids])), theirs(torch.tensor([ids])).logits
    scale = want.abs().max().item()
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4 * scale)
    sample = ["h\u00e9llo", "--max-new-tokens", "12", "--temperature", "0"]
    capsys.readouterr()
    assert generate.main(["--run", run, *sample]) == 0
    from_run = capsys.readouterr().out
    assert generate.main(["--hf", out, *sample]) == 0
    assert capsys.readouterr().out == from_run


def test_fine_tuning_starts_from_the_hf_weights_on_one_process_and_under_a_mesh(corpus, tmp_path):
    """--init-from: the step-0 validation loss is the HF model's own loss on that batch (one process),
    and 2 ranks, each reading only its own piece (FSDP rows; under tp=2 column blocks too), train
    exactly like one process. The run also draws its loss plot and ends with a sample."""
    from interop import hf
    llama = os.path.join(HF_FIXTURES, "llama")
    common = ["--init-from", llama, "--data", corpus, "--steps", "4", "--batch-size", "4", "--seq-len", "32",
              "--eval-batches", "1", "--log-interval", "1", "--ckpt-interval", "0"]
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    rc, out, err = run_train([*common, "--out-dir", single])
    assert rc == 0, err
    _, val = data.load_corpus(corpus)
    (x, y), = data.eval_batches(val, 4, 32, 0, 1)
    with torch.no_grad():
        want = hf.load(llama)(x, y)[0].item()
    assert abs(_records(single, "val_loss")[0] - want) < 1e-5
    assert "sample (64 bytes" in out
    assert open(os.path.join(single, "loss.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    layouts = [("ici=2", multi), ("ici=1,tp=2", str(tmp_path / "tp"))]
    launched = [background(torchrun, 2, [*common, "--out-dir", out_dir, "--mesh", mesh]) for mesh, out_dir in layouts]
    for (mesh, out_dir), run in zip(layouts, launched):
        rc, _, err = run.result()
        assert rc == 0, err[-3000:]
        for key in ("loss", "val_loss", "grad_norm"):
            _near(_records(single, key), _records(out_dir, key), atol=1e-5)


def test_training_on_a_hf_tokenizer_caches_its_ids_and_writes_tensorboard(corpus, tmp_path, monkeypatch, capsys):
    """--tokenizer: the corpus becomes the tokenizer's ids (decoding them gives the text back), made
    once and cached by content; the model's vocab must hold them; --tensorboard writes the scalars."""
    from tokenizers import Tokenizer
    monkeypatch.setenv("MINITITAN_CACHE", str(tmp_path / "cache"))  # not the real ~/.cache/minititan
    qwen = os.path.join(HF_FIXTURES, "qwen3")
    common = [*TINY, "--data", corpus, "--tokenizer", qwen, "--set", "vocab_size=320", "--steps", "3"]
    assert _main([*common, "--out-dir", str(tmp_path / "a"), "--tensorboard"]) == 0
    cached = sorted((tmp_path / "cache" / "tokens").iterdir())
    assert len(cached) == 4  # train and val ids, each with its checksum
    train_ids = data.np.load(next(p for p in cached if p.name.endswith("train.npy")))
    text, _ = data.load_corpus(corpus)
    assert Tokenizer.from_file(os.path.join(qwen, "tokenizer.json")).decode(train_ids.tolist()) == text.tobytes().decode()
    assert len(train_ids) < 0.8 * len(text)  # real merges: fewer tokens than bytes
    mtimes = [p.stat().st_mtime_ns for p in cached]
    assert _main([*common, "--out-dir", str(tmp_path / "b")]) == 0  # second run: from the cache
    assert [p.stat().st_mtime_ns for p in cached] == mtimes and _records(str(tmp_path / "a"), "loss") == _records(str(tmp_path / "b"), "loss")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "a" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([v for _, v in sorted(_records(str(tmp_path / "a"), "loss").items())])
    capsys.readouterr()
    assert _main([*common[:-4], "--set", "vocab_size=256", "--steps", "3", "--out-dir", str(tmp_path / "c")]) == 2
    assert "--tokenizer has 300 tokens, the model's vocab_size is 256" in capsys.readouterr().err


def child_xla_generate():
    """(child process) Greedy generation on XLA:CPU: ids, and compile counts after each token."""
    import torch_xla
    import torch_xla.debug.metrics as met
    import generate
    xla = torch_xla.device()
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(FLAVORS["qwen3_debug"], n_layers=2)).to(xla)
    counts = []
    ids = generate.generate(model, [1, 2, 3, 4, 5], 12, on_token=lambda t: counts.append(met.metric_data("CompileTime")[0]))
    print(json.dumps({"ids": ids, "compiles": counts}))


def test_decoding_on_xla_compiles_the_step_once_and_equals_cpu():
    rc, out, err = launch.python(["test_all.py", "child_xla_generate"], env={"PJRT_DEVICE": "CPU"})
    assert rc == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    # token 1 comes from the prefill program, token 2 from the first decode step: no compile after it
    assert res["compiles"][1] == res["compiles"][-1], res["compiles"]
    import generate
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(FLAVORS["qwen3_debug"], n_layers=2))
    assert generate.generate(model, [1, 2, 3, 4, 5], 12) == res["ids"]
