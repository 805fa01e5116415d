"""`refusion generate`: not implemented yet."""

import argparse

from ..errors import ReFusionError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise ReFusionError("'refusion generate' is not implemented yet")
