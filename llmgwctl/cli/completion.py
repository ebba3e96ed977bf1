"""`llmgwctl completion bash|zsh|fish`: the shell completion script, from click's own completion support.

The script asks `llmgwctl` itself for candidates (click's `_LLMGWCTL_COMPLETE`
protocol), so it completes every command and option of the installed version
and never goes stale.
"""
from __future__ import annotations

import click

# The variable click's completion protocol reads; what click derives from the
# console script's name, fixed here so `python -m llmgwctl` answers it too.
COMPLETE_VAR = "_LLMGWCTL_COMPLETE"

_INSTALL = {
    "bash": 'eval "$(llmgwctl completion bash)"   # in ~/.bashrc',
    "zsh": 'eval "$(llmgwctl completion zsh)"    # in ~/.zshrc, after compinit',
    "fish": "llmgwctl completion fish > ~/.config/fish/completions/llmgwctl.fish",
}


@click.command("completion")
@click.argument("shell", type=click.Choice(sorted(_INSTALL)))
def command(shell: str) -> None:
    """Print the completion script for SHELL (bash, zsh or fish).

    \b
    bash:  eval "$(llmgwctl completion bash)"   # in ~/.bashrc
    zsh:   eval "$(llmgwctl completion zsh)"    # in ~/.zshrc, after compinit
    fish:  llmgwctl completion fish > ~/.config/fish/completions/llmgwctl.fish
    """
    from click.shell_completion import get_completion_class

    from . import main

    cls = get_completion_class(shell)
    if cls is None:     # click.Choice above admits only shells click knows
        raise click.UsageError(f"no completion for {shell}")
    completion = cls(main, {}, "llmgwctl", COMPLETE_VAR)
    click.echo(completion.source())
