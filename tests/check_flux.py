# flux/model.py + flux/sample.py + flux/hf.py + flux/digits.py + flux/task.py. Oracles: diffusers' FluxTransformer2DModel outputs on
# tiny random checkpoints (fixtures/make_flux_fixtures.py), the published FLUX.1 config counted tensor by
# tensor, torch's FlopCounterMode, the flow formulas and the Euler loop written out here, sklearn's raw digits
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import json
import math
import os

import torch.nn.functional as F
import pytest
import torch

from tests.common import HERE


FLUX_FIXTURES = os.path.join(HERE, "fixtures", "flux")
# FLUX.1-dev's published transformer/config.json (schnell: the same with guidance_embeds false)
FLUX_DEV_CONFIG = {"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0.dev0", "attention_head_dim": 128,
                   "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096, "num_attention_heads": 24,
                   "num_layers": 19, "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768,
                   "axes_dims_rope": [16, 56, 56]}


def _flux_expected(name):
    from safetensors.torch import load_file
    return load_file(os.path.join(FLUX_FIXTURES, name, "expected.safetensors"))


def _flux_call(model, e):
    B = e["hidden_states"].shape[0]
    return model(e["hidden_states"], e["img_ids"].expand(B, -1, -1), e["encoder_hidden_states"],
                 e["txt_ids"].expand(B, -1, -1), e["timestep"], e["pooled_projections"], e.get("guidance"))


@pytest.mark.fast
@pytest.mark.parametrize("name", ["guidance", "plain"])
def test_flux_output_equals_diffusers_and_export_import_is_bit_for_bit(name, tmp_path):
    """Every module (embedders, 3-axis RoPE, joint attention, q/k RMSNorm, modulation order, fused
    single-block linear1, the final adaLN's swapped halves) against diffusers' own forward."""
    from flux import hf as flux_hf
    from safetensors.torch import load_file
    want = _flux_expected(name)
    model = flux_hf.load(os.path.join(FLUX_FIXTURES, name))
    with torch.no_grad():
        got = _flux_call(model, want)
    scale = want["sample"].abs().max().item()
    torch.testing.assert_close(got, want["sample"], rtol=1e-4, atol=1e-4 * scale)
    out = flux_hf.save(model, str(tmp_path / "export"))
    original = load_file(os.path.join(FLUX_FIXTURES, name, "diffusion_pytorch_model.safetensors"))
    exported = load_file(os.path.join(out, "diffusion_pytorch_model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in exported)
    again = flux_hf.load(out)
    assert again.args == model.args
    for (n, p), (m, q) in zip(model.named_parameters(), again.named_parameters()):
        assert n == m and torch.equal(p, q), n


def test_flux_published_sizes_parameter_count_and_flops():
    """flux-dev / flux-schnell on the meta device: the parameter count equals the published config's
    tensors counted one by one (11,901,408,320 for dev: "12B"); torchtitan's FLOP formula is within 1%
    of torch's FlopCounterMode over a real forward + backward at 1024x1024 (4096 image + 512 text tokens)."""
    from flux import model as flux
    from flux import hf as flux_hf
    from torch.utils.flop_counter import FlopCounterMode
    c = FLUX_DEV_CONFIG
    h = c["num_attention_heads"] * c["attention_head_dim"]
    lin = lambda i, o: i * o + o  # a Linear with bias
    embed = lin(256, h) + lin(h, h)  # timestep / guidance MLP
    double = 2 * (lin(h, 6 * h) + 3 * lin(h, h) + 2 * c["attention_head_dim"] + lin(h, h) + lin(h, 4 * h) + lin(4 * h, h))
    single = lin(h, 3 * h) + 3 * lin(h, h) + lin(h, 4 * h) + 2 * c["attention_head_dim"] + lin(5 * h, h)
    schnell = (lin(c["in_channels"], h) + lin(c["joint_attention_dim"], h) + embed + lin(c["pooled_projection_dim"], h)
               + lin(h, h) + c["num_layers"] * double + c["num_single_layers"] * single + lin(h, 2 * h) + lin(h, c["in_channels"]))
    assert flux_hf.args_from_config(c) == flux.FLAVORS["flux_dev"]
    assert flux_hf.args_from_config({**c, "guidance_embeds": False}) == flux.FLAVORS["flux_schnell"]
    assert flux.param_count(flux.FLAVORS["flux_schnell"]) == schnell
    assert flux.param_count(flux.FLAVORS["flux_dev"]) == schnell + embed == 11_901_408_320
    a = flux.FLAVORS["flux_dev"]
    with torch.device("meta"):
        model = flux.Flux(a)
        S, T = 4096, 512
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(1, S, 64), torch.zeros(1, S, 3), torch.randn(1, T, 4096), torch.zeros(1, T, 3),
                  torch.rand(1), torch.randn(1, 768), torch.rand(1)).sum().backward()
    measured = counter.get_total_flops()
    assert abs(flux.flops_per_sample(a, S, T) / measured - 1) < 0.01, (flux.flops_per_sample(a, S, T), measured)


@pytest.mark.fast
def test_flux_rectified_flow_targets_loss_timesteps_schedule_and_packing():
    from flux import model as flux
    from flux import sample as flux_sample
    g = torch.Generator().manual_seed(0)
    x0, eps, t = torch.randn(3, 1, 8, 8, generator=g), torch.randn(3, 1, 8, 8, generator=g), torch.tensor([0.0, 0.25, 1.0])
    xt, target = flux_sample.flow_pair(x0, eps, t)
    for b in range(3):
        assert torch.allclose(xt[b], (1 - t[b].item()) * x0[b] + t[b].item() * eps[b]) and torch.equal(target[b], eps[b] - x0[b])
    v = torch.randn(3, 1, 8, 8, generator=g)
    assert torch.allclose(flux_sample.flow_loss(v, x0, eps), sum(((v - (eps - x0)) ** 2).flatten()) / v.numel())
    u = flux_sample.sample_timesteps(4000, torch.Generator().manual_seed(1))
    assert torch.equal(u, torch.rand(4000, generator=torch.Generator().manual_seed(1)))
    ln = flux_sample.sample_timesteps(4000, torch.Generator().manual_seed(1), "logit_normal", 0.5, 2.0)
    assert torch.allclose(ln, 1 / (1 + torch.exp(-(0.5 + 2.0 * torch.randn(4000, generator=torch.Generator().manual_seed(1))))))
    assert flux_sample.validation_timesteps(8) == [0.0625, 0.1875, 0.3125, 0.4375, 0.5625, 0.6875, 0.8125, 0.9375]
    for tokens in (16, 256, 4096):  # BFL's get_schedule: mu on the line (256, 0.5) - (4096, 1.15)
        mu = 0.5 + (tokens - 256) * 0.65 / 3840
        want = [1.0] + [math.exp(mu) / (math.exp(mu) + 1 / (1 - i / 10) - 1) for i in range(1, 10)] + [0.0]
        assert flux_sample.schedule(10, tokens) == pytest.approx(want, rel=1e-12)
    assert flux_sample.schedule(4, 256, shift=False) == [1.0, 0.75, 0.5, 0.25, 0.0]
    img = torch.randn(2, 3, 4, 6, generator=g)  # packing: token (i, j) holds channel c's 2x2 patch at c*4 + di*2 + dj
    packed, ids = flux.patchify(img), flux.image_ids(2, 4, 6)
    for i in range(2):
        for j in range(3):
            assert ids[1, i * 3 + j].tolist() == [0, i, j]
            for c in range(3):
                for di in range(2):
                    for dj in range(2):
                        assert packed[1, i * 3 + j, c * 4 + di * 2 + dj] == img[1, c, 2 * i + di, 2 * j + dj]
    assert torch.equal(flux.unpatchify(packed, 4, 6), img)


def test_flux_euler_sampler_with_guidance_equals_a_direct_loop():
    """sample() (shifted schedule, classifier-free guidance u + s (c - u), seeded noise)
    against the Euler loop written out; a fresh model is zero-initialised at its modulation and
    final layer (predicts 0), so the weights are randomised first."""
    from flux import model as flux
    from flux import sample as flux_sample
    torch.manual_seed(0)
    model = flux.Flux(flux.FLAVORS["flux_debug"])
    assert all((p == 0).all() for n, p in model.named_parameters() if "mod" in n or n.startswith("final_layer"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    txt, y, utxt, uy = torch.randn(2, 4, 32), torch.randn(2, 32), torch.randn(1, 4, 32), torch.randn(1, 32)
    got = flux_sample.sample(model, txt, y, (1, 8, 8), steps=5, seed=7, cfg_scale=3.0, uncond=(utxt, uy))
    x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    x = x.reshape(2, 1, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 4)
    rr, cc = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    ids = torch.stack([torch.zeros_like(rr), rr, cc], -1).reshape(1, 16, 3).float().expand(2, -1, -1)
    mu = 0.5 + (16 - 256) * 0.65 / 3840
    ts = [1.0, *[math.exp(mu) / (math.exp(mu) + 1 / (1 - i / 5) - 1) for i in range(1, 5)], 0.0]
    with torch.no_grad():
        for i in range(5):
            tt = torch.full((2,), ts[i])
            c = model(x, ids, txt, torch.zeros(2, 4, 3), tt, y)
            u = model(x, ids, utxt.expand(2, -1, -1), torch.zeros(2, 4, 3), tt, uy.expand(2, -1))
            x = x + (ts[i + 1] - ts[i]) * (u + 3.0 * (c - u))
    want = x.reshape(2, 4, 4, 1, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 1, 8, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1


def _each_refused(tmp_path, cases):
    """Each (config.json, tensors, needle) written as a diffusers directory is refused by flux_hf.load in
    one FluxHFError line containing the needle; the last message is returned."""
    from safetensors.torch import save_file
    from flux import hf as flux_hf
    for i, (c, w, needle) in enumerate(cases):
        d = tmp_path / f"case{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        save_file(w, str(d / "diffusion_pytorch_model.safetensors"))
        with pytest.raises(flux_hf.FluxHFError) as e:
            flux_hf.load(str(d))
        assert needle in str(e.value) and "\n" not in str(e.value), (needle, str(e.value))
    return str(e.value)


def test_flux_refuses_unimplemented_diffusers_configs_and_bad_calls_in_one_line(tmp_path):
    from flux import model as flux
    from flux import hf as flux_hf
    from flux import sample as flux_sample
    from safetensors.torch import load_file
    src = os.path.join(FLUX_FIXTURES, "plain")
    cfg = json.load(open(os.path.join(src, "config.json")))
    weights = load_file(os.path.join(src, "diffusion_pytorch_model.safetensors"))
    extra = {**weights, "pos_embed.extra": torch.zeros(2)}
    short = {k: v for k, v in weights.items() if not k.endswith("attn.to_k.bias")}
    wrong = {**weights, "x_embedder.weight": torch.zeros(32, 9)}
    cases = [({**cfg, "patch_size": 2}, weights, "patch_size=2"), ({**cfg, "use_rope": True}, weights, "use_rope"),
             ({**cfg, "_class_name": "SD3Transformer2DModel"}, weights, "SD3Transformer2DModel"),
             ({**cfg, "axes_dims_rope": [4, 4, 6]}, weights, "axes_dim"), (cfg, extra, "pos_embed.extra"),
             (cfg, short, "to_k.bias"), (cfg, wrong, "x_embedder.weight"),
             ({**cfg, "guidance_embeds": True}, weights, "guidance_embedder")]
    _each_refused(tmp_path, cases)
    for bad in (tmp_path / "missing", tmp_path / "case0" / "config.json"):
        with pytest.raises(flux_hf.FluxHFError):
            flux_hf.load(str(bad))
    model = flux_hf.load(src)
    with pytest.raises(flux_hf.FluxHFError, match="not an empty directory"):
        flux_hf.save(model, src)
    with pytest.raises(flux_hf.FluxHFError, match="qkv_bias"):
        flux_hf.save(flux.Flux(dataclasses.replace(flux.FLAVORS["flux_debug"], qkv_bias=False)), str(tmp_path / "nobias"))
    assert not (tmp_path / "nobias").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".flux_hf")]
    e = _flux_expected("plain")
    with pytest.raises(ValueError, match="guidance"):
        _flux_call(model, {**e, "guidance": torch.ones(2)})
    with pytest.raises(ValueError, match="guidance"):
        _flux_call(flux_hf.load(os.path.join(FLUX_FIXTURES, "guidance")), e)
    with pytest.raises(ValueError, match="unconditional"):
        flux_sample.sample(model, torch.zeros(1, 5, 24), torch.zeros(1, 12), (1, 8, 6), cfg_scale=2.0)
    from flux import pipeline  # a scheduler config that is not FLUX's exponential shift (dynamic or static)
    for n, (override, says) in enumerate([({"use_karras_sigmas": True}, "use_karras_sigmas is not implemented"),
                                          ({"time_shift_type": "linear"}, "time_shift_type 'linear' is not"),
                                          ({"shift_terminal": 0.1}, "shift_terminal is not"),
                                          ({"use_dynamic_shifting": False, "shift": -1}, "shift -1 is not a positive"),
                                          ({"use_dynamic_shifting": True, "base_shift": "0.5"}, "base_shift '0.5'")]):
        os.makedirs(tmp_path / f"sched{n}" / "scheduler")
        (tmp_path / f"sched{n}" / "scheduler" / "scheduler_config.json").write_text(json.dumps(
            {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True, **override}))
        with pytest.raises(pipeline.FluxDirError, match=says):
            pipeline.schedule_kwargs(str(tmp_path / f"sched{n}"))
    with pytest.raises(ValueError, match="not divisible"):
        flux.patchify(torch.zeros(1, 1, 7, 8))
    with pytest.raises(ValueError, match="axes_dim"):
        flux.Flux(dataclasses.replace(flux.FLAVORS["flux_debug"], axes_dim=(8, 8, 8)))


def test_digits_split_is_seeded_disjoint_stratified_and_the_judge_is_accurate():
    """The real digits (sklearn's bundled copy, counted here as a multiset of (pixels, label)) split into
    train / held-out: disjoint, complete, every class in proportion, scaled 0..16 -> [-1, 1]; the
    independent SVC judge scores >= 97% on held-out digits it never saw."""
    import collections
    from flux import digits
    from sklearn.datasets import load_digits
    raw = load_digits()
    (tx, ty), (hx, hy) = digits.load("train"), digits.load("held_out")
    assert tx.shape == (1437, 1, 8, 8) and hx.shape == (360, 1, 8, 8) and tx.dtype == torch.float32
    assert tx.min() == -1 and tx.max() == 1 and torch.equal((tx + 1) * 8, ((tx + 1) * 8).round())
    key = lambda x, y: (tuple(((x.flatten() + 1) * 8).round().int().tolist()), int(y))
    parts = [collections.Counter(key(x, y) for x, y in zip(px, py)) for px, py in ((tx, ty), (hx, hy))]
    want = collections.Counter((tuple(int(v) for v in img.flatten()), int(t)) for img, t in zip(raw.images, raw.target))
    assert parts[0] + parts[1] == want and not set(parts[0]) & set(parts[1]) - {k for k, n in want.items() if n > 1}
    per_class = torch.bincount(hy, minlength=10).float() / torch.bincount(torch.tensor(raw.target), minlength=10)
    assert ((per_class - 0.2).abs() < 0.01).all(), per_class
    assert torch.equal(digits.load("held_out")[0], hx) and not torch.equal(digits.load("held_out", seed=1)[0], hx)
    judge, accuracy = digits.classifier()
    pred = judge.predict(((hx + 1) * 8).reshape(-1, 64).numpy())
    assert accuracy == sum(int(p) == int(y) for p, y in zip(pred, hy)) / len(hy) >= 0.97, accuracy
    assert torch.equal(digits.classify(judge, hx * 1.5), digits.classify(judge, hx.clamp(-1, 1)))  # overshoot clipped



def test_flux_jax_forward_and_adamw_steps_equal_torch():
    """flux/jax_step.py (pure JAX from BFL's layers, the competitor bench.py races) against flux/model.py and
    torch.optim.AdamW + clip_grad_norm_, on one set of random weights (every modulation and gate
    non-zero, so every path carries signal): the forward (with flux-dev's guidance embedder) to 1e-5;
    the digits workload's rectified-flow loss (t < 0.01, see below), pre-clip gradient norm and the weights after 2
    clipped AdamW steps (decay on matrices that are not norms or biases) to 1e-5."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flux import model as flux
    from flux import jax_step as flux_jax
    from flux import task as flux_task

    def randomized(module):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.1 * torch.randn_like(p))
        return module

    to_jax = lambda module: {k: jnp.array(v.detach().numpy()) for k, v in module.state_dict().items()}
    torch.manual_seed(0)
    a = dataclasses.replace(flux.FLAVORS["flux_debug"], guidance_embed=True)
    model = randomized(flux.Flux(a))
    B = 3
    # Times are embedded as sin / cos of 1000 t x freq: a 1-ulp difference between JAX's and torch's
    # fp32 exp in the frequency table (14 of 128 entries) moves the angle by ~1000 t ulps. So 1e-5 is
    # asserted for t, guidance < 0.01, and the whole range t < 1, guidance < 4 to 5e-4 (measured: 9e-5).
    forward = jax.jit(lambda p, *x: flux_jax.forward(p, dataclasses.asdict(a), *x))  # one compile, not one per op
    for scale, tol in ((0.01, 1e-5), (1.0, 5e-4)):
        inputs = (torch.randn(B, 16, 4), flux.image_ids(B, 8, 8), torch.randn(B, 4, 32), flux.text_ids(B, 4),
                  scale * torch.rand(B), torch.randn(B, 32), scale * 4 * torch.rand(B))
        with torch.no_grad():
            want = model(*inputs).numpy()
        got = forward(to_jax(model), *(jnp.asarray(x.numpy()) for x in inputs))
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)

    a = flux.FLAVORS["flux_debug"]
    model = randomized(flux_task.ConditionedFlux(a))
    params = to_jax(model)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(params)  # every trained tensor is a parameter on both sides
    decay = lambda n, p: p.dim() >= 2 and "norm" not in n and not n.endswith("bias")
    # lr: the FLUX run's. eps 1e-6: Adam's g / (sqrt(v) + eps) turns an fp32 rounding difference dg in a
    # near-zero gradient element into lr dg / eps (at eps 1e-8, 1 of 98304 elements moved by 1.6e-5)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if decay(n, p)], "weight_decay": 0.1},
                             {"params": [p for n, p in model.named_parameters() if not decay(n, p)], "weight_decay": 0.0}],
                            **hyper, foreach=False)
    step = flux_jax.make_train_step(dataclasses.asdict(a), betas=hyper["betas"], eps=hyper["eps"], weight_decay=0.1, clip=1.0)
    state = flux_jax.init_opt(params)
    for i in range(1, 3):
        x0, eps, t, cls = torch.randn(8, 16, 4), torch.randn(8, 16, 4), 0.01 * torch.rand(8), torch.randint(0, 11, (8,))
        x_t = (1 - t)[:, None, None] * x0 + t[:, None, None] * eps
        loss = F.mse_loss(model(x_t, t, cls), eps - x0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        params, state, jloss, jnorm = step(params, state, tuple(jnp.asarray(x.numpy()) for x in (x0, eps, t, cls)),
                                           jnp.float32(hyper["lr"]), jnp.float32(i))
        assert abs(float(jloss) - loss.item()) < 1e-5 * loss.item() and abs(float(jnorm) - norm.item()) < 1e-5 * norm.item()
        assert norm.item() > 1.0  # clipping was active
    for n, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(params[n]), p.detach().numpy(), rtol=1e-5, atol=1e-5, err_msg=n)


def test_flux_hf_types_config_json_and_refuses_non_float_nonfinite_or_misshapen_tensors(tmp_path):
    """config.json is read as interop/hf.py reads a language model's: a list, the string "false" for a bool, 2.9 or
    "4" for a size, out_channels 0 are refused, never coerced (bool("false") is True, int(2.9) is 2). Every
    tensor is checked before it is used: an int32 / int8 / bool weight (cast to float it would be taken
    for values), NaN or a float64 beyond float32's range (it would train from a NaN loss), a 0-d bias or
    a to_q of the wrong width (the fused qkv is joined from its parts only once each part's shape is
    right): one FluxHFError line naming the tensor."""
    from flux import hf as flux_hf
    from safetensors.torch import load_file
    src = os.path.join(FLUX_FIXTURES, "plain")
    cfg = json.load(open(os.path.join(src, "config.json")))
    weights = load_file(os.path.join(src, "diffusion_pytorch_model.safetensors"))
    q, qb = "transformer_blocks.0.attn.to_q.weight", "single_transformer_blocks.0.attn.to_q.bias"
    assert weights[q].shape == (32, 32) and weights[qb].shape == (32,)

    def poked(key, value):
        return {**weights, key: value}
    cases = [([cfg], weights, "must be a JSON object, got list"),
             ({**cfg, "guidance_embeds": "false"}, weights, 'guidance_embeds must be true or false, got "false"'),
             ({**cfg, "num_layers": 2.9}, weights, "num_layers must be an integer, got 2.9"),
             ({**cfg, "in_channels": "4"}, weights, 'in_channels must be an integer, got "4"'),
             ({**cfg, "out_channels": 0}, weights, "out_channels must be positive"),
             ({**cfg, "axes_dims_rope": [4, 6, "6"]}, weights, "axes_dims_rope must be a list of integers"),
             (cfg, poked(q, weights[q].to(torch.int32)), f"{q} is torch.int32"),
             (cfg, poked(q, weights[q].to(torch.int8)), f"{q} is torch.int8"),
             (cfg, poked(qb, weights[qb] > 0), f"{qb} is torch.bool"),
             (cfg, poked(qb, torch.tensor(0.5)), f"{qb} has shape (), config.json implies (32,)"),
             (cfg, poked(q, weights[q][:, :31].contiguous()), f"{q} has shape (32, 31), config.json implies (32, 32)"),
             (cfg, poked(q, weights[q].index_fill(0, torch.tensor([3]), float("nan"))), f"{q} holds non-finite"),
             (cfg, poked(q, torch.full((32, 32), 1e300, dtype=torch.float64)), "to_q.weight + "),
             ]
    assert "overflows float32" in _each_refused(tmp_path, cases)
    # the fixture itself still loads as before, and a config without out_channels takes in_channels'
    assert flux_hf.read_args(src).out_channels == 4
    assert flux_hf.args_from_config({k: v for k, v in cfg.items() if k != "out_channels"}).out_channels == 8


def test_flux_mlp_ratio_that_is_not_finite_or_rounds_to_no_mlp_is_refused(tmp_path, capsys):
    """mlp_ratio NaN / inf (which pass a `<= 0` test, then int() raises) or so small that int(hidden x ratio)
    is 0 (a model with no MLP at all): flux.check_args refuses it, and train.py in one line, exit 2,
    nothing written; a ratio that leaves one hidden unit builds."""
    from flux import model as flux
    from tests.common import _main
    base = flux.FLAVORS["flux_debug"]
    for ratio, needle in ((float("nan"), "mlp_ratio must be a positive finite number"),
                          (float("inf"), "mlp_ratio must be a positive finite number"),
                          (0.001, "rounds to an MLP of 0 hidden units")):
        with pytest.raises(ValueError, match=needle):
            flux.check_args(dataclasses.replace(base, mlp_ratio=ratio))
        out = str(tmp_path / "run")
        assert _main(["--task", "flux", "--set", f"mlp_ratio={ratio}", "--steps", "1", "--out-dir", out]) == 2
        err = capsys.readouterr().err
        said = needle if ratio == 0.001 else "not a finite number"  # (--set refuses NaN / inf as it parses: run/flags.py)
        assert err.startswith("error: ") and said in err and err.count("\n") == 1, err
        assert not os.path.exists(out)
    flux.check_args(dataclasses.replace(base, mlp_ratio=1 / 128))
    assert flux.Flux(dataclasses.replace(base, mlp_ratio=1 / 128)).single_blocks[0].mlp_dim == 1
