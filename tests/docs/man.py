"""Reading our man pages as a person would: rendered by groff to plain text.

Rendering (rather than grepping the roff source) means an option mentioned
only in a roff comment, or mangled by a bad escape, does not count as
documented. Without groff the source is read with the common escapes undone,
so the coverage test still runs on a machine with no man tooling.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import click

MAN = Path(__file__).resolve().parents[2] / "man"


def groff() -> str | None:
    return shutil.which("groff")


def render(page: Path) -> str:
    """The page as plain text, one paragraph per line and no hyphenation, so no option is split."""
    if groff() is None:
        return _unescape(page.read_text())
    out = subprocess.run(
        # -rLL: lines so long that paragraphs never wrap (groff may break after a
        # hyphen, which would split --no-local-agent); -rHY=0: no hyphenation;
        # -P-cbou: plain characters, no overstrike bold or underline.
        ["groff", "-man", "-Tascii", "-rLL=10000n", "-rHY=0", "-P-cbou", str(page)],
        capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def warnings(page: Path) -> str:
    """Everything groff complains about with every warning on; empty for a clean page."""
    out = subprocess.run(["groff", "-man", "-ww", "-z", str(page)], capture_output=True, text=True, timeout=60)
    return out.stderr + ("" if out.returncode == 0 else f"(exit {out.returncode})")


def _unescape(source: str) -> str:
    lines = [line for line in source.splitlines() if not line.startswith('.\\"')]
    text = "\n".join(re.sub(r"^\.\w+\s?", "", line) for line in lines)
    return re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace("\\e", "\\")


def mentions(text: str, flag: str) -> bool:
    """`flag` (-o, --output) as a word of its own: -o inside --output does not count."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def page_for(path: tuple[str, ...]) -> Path:
    """llmgwctl(1) for the root, llmgwctl-X(1) for X and everything under X."""
    return MAN / ("llmgwctl.1" if not path else f"llmgwctl-{path[0]}.1")


def walk(command: click.Command, ctx: click.Context, path: tuple[str, ...] = ()):
    """(path, command) for the command and every subcommand under it."""
    yield path, command
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            yield from walk(sub, click.Context(sub, parent=ctx, info_name=name), path + (name,))


def flags(command: click.Command) -> list[str]:
    """Every option spelling a user can type (help aside, which every page documents by hand)."""
    out = []
    for param in command.params:
        if isinstance(param, click.Option):
            out += [*param.opts, *param.secondary_opts]
    return out
