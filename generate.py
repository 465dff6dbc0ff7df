"""generate.py: sampling from a trained model or a Hugging Face checkpoint, with a static KV cache.

    python generate.py --run runs/llama3_debug-XXXX "def main("     # our newest verified checkpoint
    python generate.py --run runs/llama3_debug-XXXX/checkpoints/step_000100 "def main("   # a chosen one
    python generate.py --hf path/to/Qwen3-0.6B "Hello" --temperature 0.8 --top-p 0.95

Decoding, gpt-fast style: the prompt is run once (prefill), then one token per step. Each layer's
keys and values go into a cache allocated once at its final size, (B, Hkv, T_max, hd), written at
the current position with index_copy_ and read whole under a mask `key position <= query position`;
the position is a tensor. So every decode step has the same shapes and the same program: on XLA it
compiles once (prefill once more) for a whole generation, instead of once per length.
A run's text is bytes, or the ids of the tokenizer its checkpoint records (interop/tokenizer.py).
Sampling: greedy (temperature 0), or temperature, then top-k, then top-p (nucleus; Holtzman et al.,
arXiv 1904.09751), from a seeded generator: same seed, same text.
"""
import argparse
import functools
import math
import sys

import torch

from run import checkpoint
import device as dev
from context_parallel import masked_attention
from model import KIND
from interop import tokenizer
from interop import hf
class KVCache:
    """Keys and values of every layer, (B, Hkv, T_max, hd) each, and `pos`, the number of tokens
    already in the cache (a 0-d tensor on the device, so positions never become constants). The
    model's sequence seam (model.Transformer.hidden): `view` gives a chunk's positions and each
    layer's attention over the cache."""

    def __init__(self, args, batch, max_len, device, dtype=torch.float32):
        shape = (batch, args.n_kv_heads, max_len, args.hd)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.max_len = max_len

    def view(self, tokens_BxS, args):
        """The chunk `tokens_BxS` at positions pos..pos+S-1 (the caller advances `pos` after it)."""
        if args.sliding_window is not None or args.doc_sep is not None:
            raise ValueError("decoding with a sliding window or packed documents is not built (the KV cache is causal only)")
        return _ChunkView(self, self.pos + torch.arange(tokens_BxS.shape[1], device=self.pos.device))


class _ChunkView:
    def __init__(self, cache, positions):
        self.cache, self.positions = cache, positions

    def layer(self, i):
        return functools.partial(self.attend, i)

    def attend(self, i, q_BxHxSxD, k_BxKxSxD, v_BxKxSxD):
        """Write this chunk's S keys/values at their positions; attend over the whole cache under the
        (S, T_max) mask of what each of the S queries may see (itself and everything before)."""
        c, query_pos = self.cache, self.positions
        c.k[i].index_copy_(2, query_pos, k_BxKxSxD.to(c.k[i].dtype))
        c.v[i].index_copy_(2, query_pos, v_BxKxSxD.to(c.v[i].dtype))
        mask_SxT = torch.arange(c.max_len, device=c.pos.device)[None, :] <= query_pos[:, None]
        return masked_attention(q_BxHxSxD, c.k[i], c.v[i], mask_SxT)


# ------------------------------------------------------------------------------------------------
# Sampling

def top_k_filter(logits_V, k):
    """Keep the k largest logits (ties at the k-th value kept), the rest -inf."""
    if k <= 0 or k >= logits_V.shape[-1]:
        return logits_V
    kth = torch.topk(logits_V, k).values[..., -1:]
    return logits_V.masked_fill(logits_V < kth, float("-inf"))


def top_p_filter(logits_V, p):
    """Keep the smallest set of most likely tokens whose probabilities sum to >= p, the rest -inf."""
    if p >= 1.0:
        return logits_V
    sorted_logits, order = torch.sort(logits_V, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly before each token
    drop_sorted = before >= p                      # already reached p without it (the first is always kept)
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits_V.masked_fill(drop, float("-inf"))


def sample(logits_V, temperature=0.0, top_k=0, top_p=1.0, generator=None):
    """One token id from (V,) logits: argmax at temperature 0, else a draw from the filtered softmax."""
    if temperature <= 0:
        return int(torch.argmax(logits_V))
    logits_V = top_p_filter(top_k_filter(logits_V.float() / temperature, top_k), top_p)
    return int(torch.multinomial(torch.softmax(logits_V, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0, eos_id=None,
             on_token=None):
    """Token ids after `prompt_ids` (a non-empty list), at most max_new_tokens, stopping after eos_id."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    device = model.embed_tokens.weight.device
    total = len(prompt_ids) + max_new_tokens
    if total > model.args.max_seq_len:
        raise ValueError(f"prompt + new tokens = {total} exceeds the model's max_seq_len {model.args.max_seq_len}")
    cache = KVCache(model.args, 1, total, device, model.embed_tokens.weight.dtype)
    generator = torch.Generator().manual_seed(seed)  # sampling runs on the host: one stream per seed
    step_in = torch.tensor([prompt_ids], device=device)  # prefill: the whole prompt at once
    out = []
    for _ in range(max_new_tokens):
        logits = model(step_in, sequence=cache)[0, -1]
        cache.pos += step_in.shape[1]
        dev.sync(device)  # XLA: one program per step; the cache and pos become device data again
        token = sample(logits.cpu(), temperature, top_k, top_p, generator)
        out.append(token)
        if on_token:
            on_token(token)
        if token == eos_id:
            break
        step_in = torch.tensor([[token]], device=device)
    return out


def byte_sample(model, n, seed, temperature=0.8):
    """(text, bytes drawn): what a byte-level model writes after a newline (train.py's last words)."""
    show = tokenizer.ByteTokenizer().stream()
    ids = generate(model, list(b"\n"), min(n, model.args.max_seq_len - 1), temperature=temperature, seed=seed)
    return "".join(show(t) for t in ids) + show(None), len(ids)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a train.py run directory (its newest verified checkpoint) or one of its "
                                   "checkpoints/step_N")
    src.add_argument("--hf", help="a Hugging Face model directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    cfg = p.parse_args(argv)
    echoed = False
    try:
        for flag, value, ok, want in (  # (NaN fails every comparison)
                ("--max-new-tokens", cfg.max_new_tokens, cfg.max_new_tokens > 0, "> 0"),
                ("--temperature", cfg.temperature, 0 <= cfg.temperature < math.inf, "finite and >= 0 (0: greedy)"),
                ("--top-k", cfg.top_k, cfg.top_k >= 0, ">= 0 (0: off)"),
                ("--top-p", cfg.top_p, 0 < cfg.top_p <= 1, "in (0, 1]")):
            if not ok:
                raise ValueError(f"{flag} {value}: must be {want}")
        device = dev.pick_device(cfg.device)
        if cfg.run:
            model, meta = checkpoint.load_run(cfg.run, device, kind=KIND)
            tok = tokenizer.for_run(meta)
        else:
            config = hf.read_config(cfg.hf)
            tok = tokenizer.HFTokenizer(cfg.hf, config.get("eos_token_id"))
            model = hf.load(cfg.hf, device)
        if tok.vocab_size > model.args.vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} tokens, the model only {model.args.vocab_size}")
        prompt = tok.encode(cfg.prompt)
        show = tok.stream()
        print(cfg.prompt, end="", flush=True)
        echoed = True
        generate(model, prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, tok.eos_id,
                 on_token=lambda t: print(show(t), end="", flush=True))
        print(show(None))
        return 0
    except (ValueError, OSError, dev.DeviceUnavailable) as e:
        if echoed:  # the error on its own line, not glued to the text
            print(flush=True)
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
