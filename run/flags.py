"""run/flags.py: what a flag and a config value are, for every layer that declares one: a flag is a dataclass
field with its help (`flag`: cli.TrainConfig's shared flags, each workload's `Flags`); a float flag is a
finite number (`finite_float`); `--set FIELD=VALUE` replaces a model config's field, parsed by its
declared type (`with_overrides`). Workloads declare their flags with this module, not with run/cli.py (the
command line, which reaches the workloads through task.WORKLOADS). Imports nothing of ours.
"""
import argparse
import dataclasses
import math
import typing


def flag(default, help, **argparse_kw):
    """A flag as a dataclass field: its default, its help, and what argparse needs beyond its type."""
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kw})


# `--set FIELD=VALUE`: a model config (model.ModelArgs, flux.FluxArgs) with fields replaced by name

def parse_as(kind, text):
    """`text` as the declared type of a config field: int, float, str, bool (true/false/1/0),
    tuple (comma-separated numbers, e.g. rope_scaling=8,1,4,8192); Optional[...] also takes 'none'."""
    if typing.get_origin(kind) is typing.Union:
        if text.lower() == "none":
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    if kind is tuple:
        return tuple(float(x) if any(c in x for c in ".eEnN") else int(x) for x in text.split(","))
    return kind(text)


def kind_name(kind):
    """A declared type in a user's words: 'an int', 'an int or none', 'comma-separated numbers', ..."""
    if typing.get_origin(kind) is typing.Union:
        inner = next(k for k in typing.get_args(kind) if k is not type(None))
        return f"{kind_name(inner)} or none"
    words = {int: "an int", float: "a float", str: "a string", bool: "a bool (true/false/1/0)",
             tuple: "comma-separated numbers"}
    return words.get(kind, f"a {getattr(kind, '__name__', kind)}")


def finite(value):
    """True unless `value` (a number, or a tuple of them) holds a NaN or an infinity: no config value
    or flag of ours means anything as one, and NaN passes every `x < 0` check (NaN < 0 is False)."""
    values = value if isinstance(value, tuple) else (value,)
    return all(not isinstance(v, float) or math.isfinite(v) for v in values)


def finite_float(text):
    """argparse's type for every float flag: a finite number (`--temperature nan` is refused)."""
    value = float(text)  # (ValueError: argparse's "invalid float value")
    if not finite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


finite_float.__name__ = "float"  # (argparse names the type in "invalid float value: 'x'")


def with_overrides(args, items):
    """A config dataclass (ModelArgs, flux.FluxArgs) with `FIELD=VALUE` strings applied (train.py
    --set), each parsed by its declared type."""
    kinds = typing.get_type_hints(type(args))
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in kinds:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(kinds)}")
        try:
            parsed = parse_as(kinds[key], value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {value!r} is not {kind_name(kinds[key])}") from None
        if not finite(parsed):
            raise ValueError(f"--set {item!r}: not a finite number")
        args = dataclasses.replace(args, **{key: parsed})
    return args
