"""A catalog engine's `sh -c` template cannot be made to run a second command through `{source}`.

At b616774 `source: "x; touch INJECTED #"` was pasted into the shell string
as is, and the shell ran `touch INJECTED`.
"""
import subprocess

import pytest

from llmgwctl.catalog import CatalogError, load_text
from llmgwctl.contracts import ReplicaSpec
from llmgwctl.engines.custom import TemplateDriver

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: m
    source: "x; touch INJECTED #"
    profiles: [{engine: shelly, gpus: 0}]
engines:
  shelly:
    command: [%s]
"""


def launch_argv(command: str, tmp_path) -> tuple[str, ...]:
    catalog = load_text(CATALOG % command)
    (model,) = catalog.models
    spec = ReplicaSpec.for_profile("r1", model, model.profiles[0], catalog.engines["shelly"])
    return TemplateDriver.for_spec(spec).launch(spec, host="127.0.0.1", port=8000).argv


@pytest.mark.parametrize("command", [
    '"sh", "-c", "echo {source} --port {port}"',
    '"/bin/bash", "-ec", "echo serving {source}"',
])
def test_a_placeholder_in_a_shell_string_is_one_quoted_word(tmp_path, command):
    argv = launch_argv(command, tmp_path)
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert not (tmp_path / "INJECTED").exists()
    assert "x; touch INJECTED #" in result.stdout


def test_a_placeholder_outside_a_shell_is_one_argv_element(tmp_path):
    argv = launch_argv('"echo", "{source}", "{port}"', tmp_path)
    assert argv[:3] == ("echo", "x; touch INJECTED #", "8000")


def test_a_placeholder_inside_quotes_of_a_shell_string_is_refused():
    # shlex.quote's quotes inside the operator's quotes would cancel out.
    with pytest.raises(CatalogError, match=r"engines\.shelly\.command\[2\]: placeholder \{source\} is inside quotes"):
        load_text(CATALOG % '"sh", "-c", "echo \'{source}\'"')
