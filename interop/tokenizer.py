"""interop/tokenizer.py: what a run's token ids are as text, in both directions, and the tokenizer an export
carries.

A run trains on bytes (data.py: id b is byte b, no tokenizer to download) or on the ids of a Hugging
Face tokenizer.json (train.py --tokenizer DIR), which its checkpoint records. `for_run` gives back the
one it trained on, with the token its samples end with where the run records one (its workload's
`eos_id`), `generate.py` samples through it, and `export_files` writes it beside an export's
weights (interop/hf.py), so that transformers' AutoTokenizer and `generate.py --hf` read the export as any HF
model. Our bytes become a HF tokenizer without inventing a format: GPT-2's byte-level BPE with no
merges, whose alphabet writes each byte as one printable character (`byte_level`).

Both tokenizers decode incrementally (`stream`): a character may span several tokens, and sampling
prints each token as it comes.
"""
import codecs
import json
import os

import data
from errors import BadInput


class TokenizerError(BadInput):
    """A tokenizer that is missing or unreadable: one line, exit 2."""


class ByteTokenizer:
    """What our runs train on: UTF-8 bytes, decoded incrementally (a character may span tokens)."""
    vocab_size = data.BYTE_VOCAB

    def __init__(self, eos_id=None):
        self.eos_id = eos_id

    def encode(self, text):
        return list(text.encode("utf-8"))

    def stream(self):
        """step(token) -> the text it completes ('' inside a character); step(None) -> what is left."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def step(token):
            if token is None or token >= 256:  # an id past 255 (a wider --set vocab_size) is no byte: U+FFFD
                return decoder.decode(b"", final=True) + ("" if token is None else "\ufffd")
            return decoder.decode(bytes([token]))
        return step


class HFTokenizer:
    """A HF directory's tokenizer.json through the `tokenizers` library."""

    def __init__(self, path, eos_id=None):
        from tokenizers import Tokenizer
        try:
            self.tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        except Exception as e:
            raise TokenizerError(f"{os.path.join(path, 'tokenizer.json')}: missing or unreadable "
                                 f"({type(e).__name__})") from None
        self.vocab_size, self.eos_id = self.tok.get_vocab_size(), eos_id

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def stream(self):
        """As ByteTokenizer.stream: decode everything so far, return what is new. A text ending in U+FFFD
        may be a character cut between tokens: it is held back until the next token (or the end)
        completes it, else the printed text would keep the U+FFFD and drop the character."""
        ids, shown = [], [""]

        def step(token):
            if token is not None:
                ids.append(token)
            text = self.tok.decode(ids)
            if token is not None and text.endswith("\ufffd"):
                return ""
            new, shown[0] = text[len(shown[0]):], text
            return new
        return step


def run_tokenizer_dir(meta):
    """The tokenizer directory a run's checkpoint records (train.py --tokenizer), or None: bytes."""
    return meta.get("train", {}).get("tokenizer", meta.get("tokenizer"))  # (older runs: beside "train")


def for_run(meta):
    """What a run trained on: bytes, or the tokenizer directory its checkpoint records (--tokenizer),
    with the token that ends its samples where the run records one (its workload's eos_id)."""
    where, eos_id = run_tokenizer_dir(meta), meta.get("eos_id")
    if where is None:
        return ByteTokenizer(eos_id)
    try:
        return HFTokenizer(str(where), eos_id)
    except TokenizerError as e:
        raise TokenizerError(f"this run trained on the tokenizer in {where}, which is gone ({e}): put it "
                             f"back to sample from the run") from None


def byte_level():
    """Our byte vocabulary as a `tokenizers` Tokenizer: id b is byte b. A byte-level BPE with no merges:
    GPT-2's byte-level alphabet writes each byte as one printable character (the bytes that print as
    themselves keep their code point, the other 68 take 256, 257, ... in byte order), and the
    vocabulary maps byte b's character to id b."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    prints = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    others = iter(range(256, 512))
    char_of = {b: chr(b if b in prints else next(others)) for b in range(data.BYTE_VOCAB)}
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in char_of.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_files(meta, max_seq_len):
    """{file name: bytes} of the tokenizer an export of this run carries: its directory's files, or for
    a byte run `byte_level`'s tokenizer.json with a tokenizer_config.json naming transformers' generic
    fast tokenizer (not the Llama / Qwen one config.json's model_type would pick, which adds a BOS id).
    TokenizerError if the recorded tokenizer is gone."""
    where = run_tokenizer_dir(meta)
    if where is None:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_seq_len}
        return {"tokenizer.json": byte_level().to_str().encode(),
                "tokenizer_config.json": json.dumps(config, indent=2).encode()}
    files = {}
    for name in HF_FILES:
        try:
            with open(os.path.join(where, name), "rb") as f:
                files[name] = f.read()
        except OSError as e:
            if name == "tokenizer.json":
                raise TokenizerError(f"this run trained on the tokenizer in {where}, whose tokenizer.json is "
                                     f"gone ({e.strerror}): put it back to export the run") from None
    return files
