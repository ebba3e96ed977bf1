"""The CLI's shared conventions: one logging flag, one port-range syntax, and shell completion that works.

Completion is exercised in a real bash: the script `llmgwctl completion bash`
prints is sourced, and its completion function asked for candidates the way
bash asks when Tab is pressed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from llmgwctl.cli import main


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("command", ["serve", "agent", "router"])
def test_every_long_running_command_takes_log_level_and_hides_the_old_verbose(command):
    out = run(command, "--help").output
    assert "--log-level [debug|info|warning|error]" in out
    assert "--verbose" not in out      # still accepted (below), no longer offered


def test_the_old_v_flag_still_parses_on_serve_and_agent():
    # Usage errors come after option parsing: -v got past the parser on both.
    serve = run("serve", "-vv", "--catalogs", "/nonexistent-dir")
    assert serve.exit_code == 2 and "no such option" not in serve.output.lower()
    agent = run("agent", "-v", "--state-dir", "/tmp/x")
    assert agent.exit_code == 2 and "give --controller URL" in agent.output


@pytest.mark.parametrize("command,extra", [("serve", ()), ("agent", ("--state-dir", "/tmp/x"))])
def test_one_port_range_syntax_with_one_message(command, extra):
    out = run(command, "--help").output
    assert "--ports LOW-HIGH" in out
    bad = run(command, *extra, "--ports", "20000:20999")
    assert bad.exit_code == 2
    assert "Invalid value for '--ports': port range '20000:20999': expected LOW-HIGH" in bad.output
    backwards = run(command, *extra, "--ports", "300-200")
    assert backwards.exit_code == 2 and "need 1 <= LOW <= HIGH <= 65535" in backwards.output


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_click_script_for_each_shell(shell):
    out = run("completion", shell)
    assert out.exit_code == 0 and "_LLMGWCTL_COMPLETE" in out.output
    assert run("completion", "tcsh").exit_code == 2


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completes_commands_and_options(tmp_path):
    # `llmgwctl` on PATH as this interpreter's module, so the script's call back works.
    shim = tmp_path / "llmgwctl"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m llmgwctl "$@"\n')
    shim.chmod(0o755)
    script = subprocess.run([str(shim), "completion", "bash"], capture_output=True, text=True, timeout=60,
                            check=True).stdout

    def complete(line: str) -> list[str]:
        words = line.split(" ")
        probe = (f'{script}\nCOMP_WORDS=({" ".join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}; '
                 '_llmgwctl_completion llmgwctl; printf "%s\\n" "${COMPREPLY[@]}"')
        out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PATH": f"{tmp_path}:{os.environ.get('PATH', '/usr/bin:/bin')}"})
        return out.stdout.split()

    assert complete("llmgwctl ca") == ["catalog"]
    assert "completion" in complete("llmgwctl co")
    assert complete("llmgwctl serve --log-l") == ["--log-level"]
    assert complete("llmgwctl serve --log-level w") == ["warning"]
