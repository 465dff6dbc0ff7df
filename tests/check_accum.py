# accum.py: gradient accumulation. Oracles: plain autograd on the whole batch (gradients before any
# update), the unaccumulated trainer on the same global batch (losses, pre-clip norms, weights after AdamW)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import pytest
import torch

import accum
from model import Transformer, next_token_loss

from tests.common import TINY, _main, _near, _train_losses, _trainer, tiny_args


def _flat(grads):
    return torch.cat([g.reshape(-1) for g in grads])


def _grad_gap(want, got):
    """max |got - want| over every gradient entry, and the largest entry (the scale the gap is read on)."""
    want, got = _flat(want), _flat(got)
    return (got - want).abs().max().item(), want.abs().max().item()


def test_microbatch_gradients_sum_to_the_whole_batch_gradient_mean_and_sum_reductions():
    """Before any update: the gradients accumulated over 4 microbatches equal plain autograd on the whole
    batch. "mean" (the LM's cross-entropy, every position a target); "sum" (a masked loss divided by the
    whole batch's target count, the 0-d entry, where the microbatches hold 1 to 31 targets each: a mean of
    microbatch means would be wrong by far more than the tolerance, checked below)."""
    torch.manual_seed(0)
    model = Transformer(tiny_args(vocab_size=256, max_seq_len=32))
    params = list(model.parameters())
    x, y = torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16))

    def grads_of(loss):
        return torch.autograd.grad(loss, params)
    want = grads_of(next_token_loss(model, (x, y))[1])
    reported, got = accum.loss_and_grads(next_token_loss, model, (x, y), accum.Microbatches(4, "mean"), grads_of,
                                         _no_autocast)
    gap, scale = _grad_gap(want, got)
    assert gap <= 1e-6 * scale, (gap, scale)
    torch.testing.assert_close(reported, next_token_loss(model, (x, y))[0], rtol=1e-6, atol=0)

    masked = y.clone()
    masked[:2, 1:] = -100  # rows of microbatch 0 keep 1 target each; the rest keep all 16
    masked[2:4, :8] = -100
    count = (masked != -100).sum().float()

    def masked_loss(m, batch):
        inputs, targets, n = batch
        ce = torch.nn.functional.cross_entropy(m(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100,
                                               reduction="sum") / n
        return ce, ce
    want = grads_of(masked_loss(model, (x, masked, count))[1])
    _, got = accum.loss_and_grads(masked_loss, model, (x, masked, count), accum.Microbatches(4, "sum"), grads_of,
                                  _no_autocast)
    gap, scale = _grad_gap(want, got)
    assert gap <= 1e-6 * scale, (gap, scale)
    micro_means = [grads_of(masked_loss(model, (x[i:i + 2], masked[i:i + 2], (masked[i:i + 2] != -100).sum()))[1])
                   for i in range(0, 8, 2)]
    wrong = [sum(g) / 4 for g in zip(*micro_means)]  # what a mean of microbatch means would step on
    assert _grad_gap(want, wrong)[0] > 100 * gap + 1e-3 * scale


def _no_autocast():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_step_of_4_microbatches_equals_one_step_on_the_whole_batch(corpus, tmp_path, mode):
    """The trainer with --grad-accum 4 against --grad-accum 1 on the same global batch of 8 rows, 4 steps:
    the losses, the pre-clip gradient norms (a wrong scale, e.g. a sum where a mean belongs, hides behind
    clipping and Adam in the losses) and the weights after AdamW. Graph mode: the loop unrolled in the one
    traced step (4 embedding backwards in the graph: one per microbatch)."""
    args = ("--batch-size", "8", "--mode", mode)
    whole, micro = _trainer(corpus, tmp_path / "whole", *args), _trainer(corpus, tmp_path / "micro", *args, "--grad-accum", "4")
    norms_whole, norms_micro = [], []
    want, got = _train_losses(whole, 4, norms_whole), _train_losses(micro, 4, norms_micro)
    _near(want, got, atol=1e-6)
    _near(norms_whole, norms_micro, atol=0, rtol=1e-5)
    for p, q in zip(whole.params, micro.params):  # (1.2e-6 measured: Adam divides a rounding-sized gradient
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)  # gap by sqrt(v); the layouts' oracle's 1e-5)
    if mode == "graph":
        import graph_trainer
        ops = {n: graph_trainer.op_counts(t.step_fn.gm).get("aten.embedding_dense_backward.default") for n, t in
               (("whole", whole), ("micro", micro))}
        assert ops == {"whole": 1, "micro": 4}, ops


@pytest.mark.parametrize("argv, message", [
    (["--grad-accum", "0"], "--grad-accum must be positive, got 0"),
    (["--grad-accum", "3"], "--grad-accum 3: --batch-size 4 over 1 data-parallel rank(s) do not split into 3 equal"),
])
def test_a_bad_grad_accum_is_one_line_exit_2(argv, message, capsys):
    assert _main([*TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
