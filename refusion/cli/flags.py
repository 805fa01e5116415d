"""Command-line flags shared by the CLI verbs and the `bench` commands that load a model
and decode. The decoding and engine flags are derived from `DecodeConfig` and
`EngineConfig` (name, type, bounds, help), so they cannot drift from the dataclasses;
nothing here imports torch."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..errors import ConfigError
from ..settings.decode import PRESETS, DecodeConfig, EngineConfig
from ..settings.fields import check_value, field_kind
from ..settings.serve import ServerLimits


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        "-m",
        default=None,
        help="model directory, hub id, .gguf file, bundled:NAME or package:MODULE/PATH "
        "(default: the bundled model)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16, float16 (default: the checkpoint's, if the device runs it)",
    )
    add_quantize_argument(parser)
    add_nonfinite_argument(parser)


QUANTIZE_CHOICES = ("none", "int8", "int4")


def add_quantize_argument(parser: argparse.ArgumentParser) -> None:
    """--quantize int8|int4: weight-only quantization of the blocks' linear layers at load."""
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=None,
        help="quantize the linear layers' weights at load (torchao, weight only; int4 runs in bfloat16; "
        "a checkpoint saved quantized needs none; docs/quantization.md)",
    )


def add_nonfinite_argument(parser: argparse.ArgumentParser) -> None:
    """--allow-nonfinite-weights: load a checkpoint whose weights hold NaN or inf."""
    parser.add_argument(
        "--allow-nonfinite-weights",
        action="store_true",
        help="load weights that hold NaN or infinite values (refused by default: such a model's output "
        "is garbage)",
    )


def add_data_parallel_argument(parser: argparse._ActionsContainer, what: str) -> None:
    """--data-parallel-size N: N replicas of the model, a process (and device) each (on a
    parser or one of its groups)."""
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help=f"N model replicas, one process (device) each, {what} (default: 1)",
    )


def _flag_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)]


def _add_field_flags(group: argparse._ArgumentGroup, cls: type, skip: tuple[str, ...] = ()) -> None:
    for f in _flag_fields(cls):
        if f.name in skip:
            continue
        meta, kind, flag = f.metadata, field_kind(f), "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        # decoding settings not given come from the checkpoint's decode_config.json first
        source = "the checkpoint's, else " if cls is DecodeConfig else ""
        help_text = (
            meta["help"] if "default" in meta["help"] else f"{meta['help']} (default: {source}{default})"
        )
        if kind == "bool":
            # --x / --no-x: a checkpoint's decode_config.json may turn an option on
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=meta["help"])
        elif kind == "tuple":
            group.add_argument(flag, type=int, nargs="*", default=None, metavar="ID", help=help_text)
        else:
            group.add_argument(
                flag,
                type={"int": int, "float": float, "str": str}[kind],
                default=None,
                choices=meta.get("choices"),
                help=help_text,
            )


def add_decode_arguments(
    parser: argparse.ArgumentParser, default_method: str = "refusion", engine: bool = True
) -> None:
    """Every `DecodeConfig` flag and a --preset (and, with `engine`, every `EngineConfig`
    flag: --max-batch-size, --memory-budget-gb, --compile)."""
    g = parser.add_argument_group("decoding (per request)")
    g.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="the authors' settings for a benchmark (slot layout, thresholds, gen_length 512), on top of the "
        "checkpoint's; `eval` uses the task's own unless told",
    )
    _add_field_flags(g, DecodeConfig)
    g.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="constrain the output to JSON valid under the schema in FILE (sets --grammar; AR and "
        "ReFusion's lossless settings; docs/structured-outputs.md)",
    )
    if engine:
        _add_field_flags(parser.add_argument_group("engine (resources)"), EngineConfig)
    parser.set_defaults(_default_method=default_method)


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags of cls's fields that the user gave, checked against the field's bounds."""
    out = {}
    for f in _flag_fields(cls):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        value = tuple(value) if isinstance(value, list) else value
        try:
            out[f.name] = check_value(f, value)
        except ConfigError as e:
            raise ConfigError(f"--{f.name.replace('_', '-')}: {e}") from None
    return out


def decode_config_from_args(
    args: argparse.Namespace, base: DecodeConfig | None = None, model: Any = None
) -> DecodeConfig:
    """Preset (on `base`; else on the settings `model`'s checkpoint recommends, its
    decode_config.json; else on the defaults), then every flag the user gave on top.
    Called before loading a model, it checks the flags."""
    if base is None and model is not None:
        from ..settings.recommended import recommended_of

        base = recommended_of(model).decode_config()
    base = base or DecodeConfig(method=getattr(args, "_default_method", "refusion"))
    cfg = DecodeConfig.preset(args.preset, base) if getattr(args, "preset", None) else base
    given = _given(args, DecodeConfig)
    if getattr(args, "json_schema", None):
        if "grammar" in given:
            raise ConfigError("give --grammar or --json-schema, not both")
        given["grammar"] = _schema_grammar(args.json_schema)
    return cfg.replace(**given)


def _schema_grammar(path: str) -> str:
    """The grammar of JSON valid under the schema in the file at `path`."""
    import json

    from ..decode.grammar import json_schema_grammar

    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--json-schema {path}: cannot read a JSON schema there ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ConfigError(f"--json-schema {path}: a JSON schema is an object, got {type(schema).__name__}")
    return json_schema_grammar(schema)


def engine_config_from_args(args: argparse.Namespace, base: EngineConfig | None = None) -> EngineConfig:
    return (base or EngineConfig()).replace(**_given(args, EngineConfig))


def add_server_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `ServerLimits` flag: --header-timeout, --body-timeout, --min-body-rate,
    --max-connections, --max-connections-per-client."""
    _add_field_flags(parser.add_argument_group("connections (what one client may hold)"), ServerLimits)


def server_limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits().replace(**_given(args, ServerLimits))


def load_from_args(args: argparse.Namespace):
    from ..io import load

    return load(
        args.model,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", None) or 1,
        allow_nonfinite=getattr(args, "allow_nonfinite_weights", False),
        quantize=getattr(args, "quantize", None),
    )


def check_mask_before_load(args: argparse.Namespace) -> None:
    """A method that feeds MASK tokens, asked of a checkpoint that has none (an AR model,
    before `refusion convert`), fails on the checkpoint's config and tokenizer: before its
    weights load, which can take minutes, and naming the flag that decodes it as it is."""
    from ..decode.methods import METHODS
    from ..errors import MissingMaskTokenError
    from ..io import load_metadata
    from ..io.resolve import resolve_source
    from ..settings.recommended import Recommended

    source = resolve_source(args.model)
    rec = Recommended() if source.suffix == ".gguf" else Recommended.read(source)
    cfg = decode_config_from_args(args, base=rec.decode_config())
    if not METHODS[cfg.method].needs_mask:
        return
    config, _ = load_metadata(source)
    if config.mask_token_id is None:
        name = args.model or "this model"
        raise MissingMaskTokenError(
            f"{name} has no MASK token (an autoregressive checkpoint), so method {cfg.method!r} cannot "
            f"decode it: add --method ar, or make it a ReFusion model with `refusion convert {name} OUT` "
            "then `refusion train --model OUT ...`"
        )


def engine_from_args(args: argparse.Namespace):
    """The model the flags name, loaded, in an engine with the flags' resources (what a
    rank that follows rank 0 of a split model runs)."""
    from ..decode.engine import Engine

    model, tokenizer = load_from_args(args)
    return Engine(model, tokenizer, engine_config_from_args(args))
