"""`refusion train --model BASE --data FILE --out DIR [...]`: one flag per `TrainConfig` field.

The flags are generated from the dataclass, and their help from the comment next to each
field, so the CLI and the Python API cannot drift apart. Multi-GPU: run the same command
under `accelerate launch` or `torchrun` (see configs/).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from typing import Any

from ...settings.train import (
    AR_REDUCTIONS,
    DTYPE_NAMES,
    OBJECTIVES,
    PRECISIONS,
    TrainConfig,
    config_fields,
    flag_name,
)

_CHOICES = {
    "objective": OBJECTIVES,
    "precision": PRECISIONS,
    "dtype": DTYPE_NAMES,
    "ar_reduction": AR_REDUCTIONS,
}
_COMMENT = re.compile(r"^\s+(\w+):[^#]*#\s*(.+)$")


def _field_help() -> dict[str, str]:
    """Field name -> the comment that documents it in TrainConfig's source."""
    helps = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        m = _COMMENT.match(line)
        if m:
            helps[m.group(1)] = m.group(2)
    return helps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    helps = _field_help()
    for f in config_fields():
        flag = flag_name(f.name)
        default: Any = f.default if f.default is not dataclasses.MISSING else None
        text = helps.get(f.name, "")
        kind = str(f.type)
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif kind.startswith("tuple"):
            item = int if "int" in kind else str
            shown = " ".join(map(str, default))
            parser.add_argument(
                flag, nargs="+", type=item, default=default, metavar="X", help=f"{text} (default: {shown})"
            )
        else:
            conv = int if kind.startswith("int") else float if kind.startswith("float") else str
            required = f.name in ("data", "out")
            parser.add_argument(
                flag,
                type=conv,
                default=None if required else default,
                required=required,
                choices=_CHOICES.get(f.name),
                help=text + ("" if required or default is None else f" (default: {default})"),
            )


def run(args: argparse.Namespace) -> int:
    from ...train import train

    values = {f.name: getattr(args, f.name) for f in config_fields()}
    cfg = TrainConfig(**values)
    cfg.validate(flags=True)  # here, so that a bad setting is named by its flag
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # one line per run, not per process
        print(f"trained {result.step} steps; model saved to {result.out_dir}")
    return 0
