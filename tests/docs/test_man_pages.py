"""The man pages cover the CLI as it is: every command and option on its page, every page clean.

A new option without a line in its page fails here, naming both, so the
pages cannot drift from `llmgwctl --help`.
"""
from __future__ import annotations

import re

import click
import pytest

from llmgwctl.cli import SUBCOMMANDS, main

from .man import MAN, flags, groff, mentions, page_for, render, walk

ROOT = click.Context(main, info_name="llmgwctl")
COMMANDS = list(walk(main, ROOT))
PAGES = sorted(MAN.glob("*.[0-9]"))


def test_every_top_level_command_has_its_page_and_the_expected_pages_exist():
    names = {p.name for p in PAGES}
    assert {f"llmgwctl-{name}.1" for name in SUBCOMMANDS} | {"llmgwctl.1", "llmgw-catalog.5"} <= names


@pytest.mark.parametrize("path,command", COMMANDS, ids=[" ".join(p) or "llmgwctl" for p, _ in COMMANDS])
def test_command_and_every_option_are_on_its_page(path, command):
    page = page_for(path)
    assert page.is_file(), f"`llmgwctl {' '.join(path)}` has no man page: write {page.relative_to(MAN.parent)}"
    text = render(page)
    missing = [flag for flag in flags(command) if not mentions(text, flag)]
    assert not missing, f"{page.name} does not document {', '.join(missing)} of `llmgwctl {' '.join(path)}`"
    if path:
        # A top-level command is listed in llmgwctl(1); a nested one in its group's page.
        listing = render(page_for(path[:-1]) if len(path) > 1 else page_for(()))
        assert re.search(rf"(?m)^\s*{re.escape(path[-1])}\b", listing), \
            f"`llmgwctl {' '.join(path)}` is not listed in {page_for(path[:-1] if len(path) > 1 else ()).name}"


def test_a_missing_option_is_caught():
    # The check above, on a page that lacks one option: it must not pass by accident.
    text = render(page_for(("serve",)))
    assert mentions(text, "--no-local-agent")
    assert not mentions(text.replace("--no-local-agent", ""), "--no-local-agent")
    assert not mentions("--output", "-o") and mentions("-o, --output", "-o")


@pytest.mark.skipif(groff() is None, reason="groff is not installed (apt-get install groff) to check rendering")
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_renders_without_warnings(page):
    from .man import warnings
    assert warnings(page) == ""


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_see_also_names_only_pages_that_exist(page):
    see_also = page.read_text().split(".SH SEE ALSO", 1)
    assert len(see_also) == 2, f"{page.name} has no SEE ALSO section"
    refs = re.findall(r"^\.BR ([\w\\-]+) \((\d)\)", see_also[1], re.M)
    assert refs, f"{page.name}: SEE ALSO names no page"
    for name, section in refs:
        assert (MAN / f"{name.replace(chr(92) + '-', '-')}.{section}").is_file(), f"{page.name}: no page {name}({section})"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_title_matches_file_name(page):
    name, section = page.name.rsplit(".", 1)
    header = page.read_text().splitlines()[0]
    assert header.startswith(f".TH {name.upper().replace('-', chr(92) + '-')} {section} "), header
