"""flux/tiny.py: a FLUX.1 pipeline small enough for a CPU test, built offline from configs and saved as
a diffusers directory (the layout of black-forest-labs/FLUX.1-dev, every part a few layers wide).

    python -m flux.tiny OUT_DIR        # or build(OUT_DIR) from a test fixture

Its parts are FLUX's own classes with random weights: the transformer (FluxTransformer2DModel, with
flux-dev's guidance embedding), the 16-channel AutoencoderKL without quant convs (4 blocks: 8x down, as
FLUX's), its shift / scaling factors set, as FLUX's were, so that its latents of real pictures (64
upscaled digits) have mean 0 and variance 1, CLIP (CLIPTextModel, pooled) and T5 (T5EncoderModel, gated
GELU as T5 v1.1), the flow-matching Euler scheduler with FLUX's dynamic shift. The tokenizers are
built here, with no download: CLIP's byte-level BPE from a vocabulary of the 256 byte symbols (no
merges: a word is its letters) and T5's Unigram over lowercase letters and digits (`tokenizers`).
What it can show: that every step of ours equals FluxPipeline's on the same directory. What it cannot:
pictures that mean anything (random encoders: the VAE is no autoencoder, the text encoders no language
model).
"""
import json
import os
import sys
import tempfile

import torch

from flux import digits

T5_TOKENS = 12       # the T5 prompt length (FLUX.1-dev: 512) the tiny pipeline is used with ("digit 3": 9)
CLIP_TOKENS = 16     # CLIP's tokenizer pads to model_max_length (FLUX: 77)
TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24, guidance_embeds=True,
                   axes_dims_rope=[4, 6, 6])
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[8, 8, 16, 16], layers_per_block=1,
           norm_num_groups=4, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
           scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, sample_size=32)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096)


def clip_tokenizer(tmp):
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer
    chars = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    with open(os.path.join(tmp, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(tmp, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    return CLIPTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"), model_max_length=CLIP_TOKENS)


def t5_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import T5TokenizerFast
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    t = Tokenizer(models.Unigram(pieces, unk_id=2))
    t.normalizer = normalizers.Lowercase()
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    t.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=t, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0,
                           model_max_length=T5_TOKENS)


def build(out, seed=0):
    """Write the tiny pipeline to `out` (a diffusers FLUX directory); returns `out`. (The caller's global
    RNG state is left as it was.)"""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _build(out)


def _build(out):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    with tempfile.TemporaryDirectory() as tmp:
        tok = clip_tokenizer(tmp)
    tok2 = t5_tokenizer()
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tok), hidden_size=TRANSFORMER["pooled_projection_dim"], intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=CLIP_TOKENS, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).eval()
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(tok2), d_model=TRANSFORMER["joint_attention_dim"], d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, relative_attention_max_distance=16,
        is_encoder_decoder=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    transformer = FluxTransformer2DModel(**TRANSFORMER).eval()
    with torch.no_grad():  # wider than diffusers' init, so that no modulation is ~0 and a wrong piece shows
        for name, p in transformer.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if p.ndim == 1 and ".attn.norm_" in name else torch.randn_like(p) * 0.1)
    vae = AutoencoderKL(**VAE).eval()
    with torch.no_grad():  # FLUX's shift / scale make its latents ~N(0, 1) on its data: these, on 64 digits
        z = vae.encode(torch.from_numpy(digits.upscaled()[0][:64]).permute(0, 3, 1, 2) / 127.5 - 1).latent_dist.mode()
    vae.register_to_config(shift_factor=round(z.mean().item(), 4), scaling_factor=round(1 / z.std().item(), 4))
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=clip,
                        tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok2, transformer=transformer)
    pipe.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1]))
