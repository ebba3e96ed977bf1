import textwrap

import pytest

HEADER = "apiVersion: llmgw/v1\nkind: Catalog\n"


def catalog_yaml(*models: str, engines: str = "") -> str:
    """A catalog document with one fake-engine model per name (`name` or `name:alias1,alias2`)."""
    out = HEADER + "models:\n"
    for spec in models:
        name, _, aliases = spec.partition(":")
        out += f"  - name: {name}\n"
        if aliases:
            out += f"    aliases: [{aliases}]\n"
        out += "    profiles: [{engine: fake, gpus: 0}]\n"
    if engines:
        out += textwrap.dedent(engines)
    return out


@pytest.fixture
def write(tmp_path):
    def write(name: str, text: str):
        path = tmp_path / name
        path.write_text(text)
        return path
    return write
