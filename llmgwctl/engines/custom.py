"""Engines a catalog defines: a command template, filled per replica.

The catalog checked the template's placeholders when it loaded ({source}
{port} {host} {model} {gpus}); here they are filled with `str.format`, one
argv element at a time, so a value with spaces stays one argument. Inside a
shell string (`sh -c "..."`, see `catalog.model.shell_strings`) a value is
filled `shlex.quote`d: a catalog's `source: "x; touch INJECTED #"` is then
one word to the shell, not a second command. (The catalog refuses a
placeholder written inside quotes there, where quoting would be undone.)

We cannot know what a catalog-defined engine prints on /metrics, so its page
is read with each built-in adapter in turn: an engine that speaks vLLM's,
SGLang's or llama.cpp's families (many forks do) gets load-aware routing;
any other yields None and is routed by request counts alone.
"""
from __future__ import annotations

import os
import shlex
import shutil
from typing import Sequence

from ..catalog.model import shell_strings

from .base import replica_env
from .errors import LaunchError
from .llamacpp import parse_llamacpp
from .sglang import parse_sglang
from ..contracts import LoadReading, ReplicaSpec
from .spec import Launch
from .vllm import parse_vllm


class TemplateDriver:
    def __init__(self, name: str, command: Sequence[str], health: str = "/health",
                 metrics: str | None = "/metrics"):
        self.name = name
        self.command = tuple(command)
        self.health = health
        self.metrics = metrics

    @classmethod
    def for_spec(cls, spec: ReplicaSpec) -> "TemplateDriver":
        return cls(spec.engine, spec.command, spec.health, spec.metrics)

    def launch(self, spec: ReplicaSpec, *, host: str, port: int) -> Launch:
        if not self.command:
            raise LaunchError(f"engine {self.name!r} has no command; a catalog-defined engine needs one")
        fields = {"source": spec.source, "port": port, "host": host, "model": spec.model, "gpus": spec.gpus}
        quoted = {key: shlex.quote(str(value)) for key, value in fields.items()}
        shell = shell_strings(self.command)
        try:
            argv = tuple(part.format(**(quoted if i in shell else fields)) for i, part in enumerate(self.command))
        except (KeyError, IndexError, ValueError) as exc:
            raise LaunchError(f"engine {self.name!r}: cannot fill command template {list(self.command)}: "
                              f"{exc!r}; placeholders are {{source}} {{port}} {{host}} {{model}} {{gpus}}") from None
        return Launch(argv=argv + tuple(spec.args), env=replica_env(spec), health_path=self.health,
                      metrics_path=self.metrics)

    def available(self) -> tuple[bool, str]:
        if not self.command:
            return False, f"engine {self.name!r} has no command in the catalog"
        program = self.command[0]
        if os.sep in program:
            found = program if os.access(program, os.X_OK) else None
        else:
            found = shutil.which(program)
        if found is None:
            return False, f"{program} (engine {self.name!r}) not found on PATH; install it on this node"
        return True, f"{program} at {found}"

    def parse_metrics(self, text: str) -> LoadReading | None:
        return parse_any(text)


def parse_any(text: str) -> LoadReading | None:
    """The first built-in adapter that finds its families on the page."""
    for parse in (parse_vllm, parse_sglang, parse_llamacpp):
        reading = parse(text)
        if reading is not None:
            return reading
    return None
