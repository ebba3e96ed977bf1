"""`llmgwctl`: the one command. Thin by rule: each subcommand parses its options,
checks their combinations (click.UsageError, exit 2), calls one function of the
core, and maps our errors to exit codes (1 for a failed run). No logic here
that a test would want to call directly.
"""
from __future__ import annotations

import importlib

import click

from .. import __version__

# Subcommand modules, each defining one click command or group named `command`
# (or `module:name` for a module holding several: the maintenance verbs).
# Imported lazily so `llmgwctl catalog validate` does not pay for aiohttp.
SUBCOMMANDS = {
    "agent": "llmgwctl.cli.agent",
    "catalog": "llmgwctl.cli.catalog",
    "completion": "llmgwctl.cli.completion",
    "cordon": "llmgwctl.cli.maintenance:cordon",
    "drain": "llmgwctl.cli.maintenance:drain",
    "engine": "llmgwctl.cli.engine",
    "logs": "llmgwctl.cli.logs",
    "router": "llmgwctl.cli.router",
    "serve": "llmgwctl.cli.serve",
    "status": "llmgwctl.cli.status",
    "token": "llmgwctl.cli.token",
    "uncordon": "llmgwctl.cli.maintenance:uncordon",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module, _, attr = SUBCOMMANDS[name].partition(":")
        command: click.Command = getattr(importlib.import_module(module), attr or "command")
        return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmgwctl")
def main() -> None:
    """llmgw: a self-hosted LLM gateway for GPU fleets."""
