"""Engines a catalog defines: a command template, filled per replica.

The catalog checked the template's placeholders when it loaded ({source}
{port} {host} {model} {gpus}); here they are filled with `str.format`, one
argv element at a time, so a value with spaces stays one argument. Inside a
shell string (`sh -c "..."`, see `catalog.commands.shell_strings`) a value is
filled `shlex.quote`d: a catalog's `source: "x; touch INJECTED #"` is then
one word to the shell, not a second command. (The catalog refuses a
placeholder written inside quotes there, where quoting would be undone.)

We cannot know what a catalog-defined engine prints on /metrics, so its page
is read with each built-in adapter in turn: an engine that speaks vLLM's,
SGLang's or llama.cpp's families (many forks do) gets load-aware routing;
any other yields None and is routed by request counts alone.

Who may run one is the node's operator, not the catalog's writer: the
catalog repository describes the fleet, but write access to it must not be
a shell on every GPU machine. `AllowedEngines` is what an operator allowed
on one node (`llmgwctl agent --allow-engine NAME=PROGRAM`), and nothing else
runs there. An allowance pins the *program*, not only the name: the command
of an allowed name is the catalog's to change (a new flag, another port), but
what it executes stays the file the operator named, resolved on this node
and executed by its absolute path (a profile's `env: {PATH: ...}` cannot
point the lookup elsewhere). Pinning a shell or an interpreter (`sh`,
`python3`) allows whatever the catalog writes after `-c`; that is the
operator's informed choice, said in llmgwctl-agent(1).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from ..catalog.commands import shell_strings
from ..catalog.model import BUILTIN_ENGINES
from ..contracts import LoadReading, ReplicaSpec
from .base import replica_env
from .codeargs import normalize_option, spec_refusal
from .errors import EngineNotAllowed, LaunchError, SpecNotAllowed
from .llamacpp import parse_llamacpp
from .sglang import parse_sglang
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
    def for_spec(cls, spec: ReplicaSpec) -> TemplateDriver:
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
        if os.sep in program:  # noqa: SIM108 -- a path or a name on PATH: two branches read clearer than a nested expression
            found = program if os.access(program, os.X_OK) else None
        else:
            found = shutil.which(program)
        if found is None:
            return False, f"{program} (engine {self.name!r}) not found on PATH; install it on this node"
        return True, f"{program} at {found}"

    def parse_metrics(self, text: str) -> LoadReading | None:
        return parse_any(text)


# The catalog schema's engineName: an allowance for a name no catalog can
# define would be a typo that silently allows nothing.
ENGINE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")


def allow_hint(name: str, program: str = "PROGRAM") -> str:
    """The option that allows catalog engine `name` on a node: the fix every refusal names."""
    return f"llmgwctl agent --allow-engine {name}={program}"


class AllowedEngines:
    """What one node's operator allows engines to run beyond the built-in defaults.

    The catalog-defined engines the node runs, each pinned to the one program
    it may execute, and the engine options that run code (codeargs.py, such
    as --trust-remote-code) the node lets a profile pass. Empty by default: a
    node runs the built-in engines, no catalog-defined one and no such option,
    until its operator allows them.
    """

    __slots__ = ("_pins", "_args")

    def __init__(self, pins: Mapping[str, str] | None = None, args: Iterable[str] = ()):
        self._pins: Mapping[str, str] = MappingProxyType(dict(sorted((pins or {}).items())))
        self._args: frozenset[str] = frozenset(args)

    @classmethod
    def parse(cls, values: Iterable[str]) -> AllowedEngines:
        """From `NAME=PROGRAM` strings (a PROGRAM is an absolute path or a name on PATH); ValueError names the bad one."""
        pins: dict[str, str] = {}
        for value in values:
            name, sep, program = value.partition("=")
            if not sep or not program:
                raise ValueError(
                    f"{value!r}: give NAME=PROGRAM, the catalog engine and the one program it may run here "
                    f"(such as {name or 'mylmdeploy'}=/usr/bin/lmdeploy); a name alone would let whoever edits "
                    "the catalog change what that name executes")
            if not ENGINE_NAME.fullmatch(name):
                raise ValueError(f"{value!r}: {name!r} is not an engine name a catalog can define "
                                 "(lower-case letters, digits, - and _, starting with a letter)")
            if name in BUILTIN_ENGINES:
                raise ValueError(f"{value!r}: {name} is built in and always allowed; --allow-engine is for "
                                 "engines a catalog defines")
            if "\0" in program or (os.sep in program and not os.path.isabs(program)):
                raise ValueError(f"{value!r}: PROGRAM must be an absolute path or a program name looked up on PATH")
            if pins.get(name, program) != program:
                raise ValueError(f"{value!r}: engine {name} is already allowed as {pins[name]}; one program per engine")
            pins[name] = program
        return cls(pins)

    def with_args(self, values: Iterable[str]) -> AllowedEngines:
        """These allowances plus the engine options `values` (`--trust-remote-code`); ValueError names one that is not refused."""
        return AllowedEngines(self._pins, self._args | {normalize_option(v) for v in values})

    @property
    def pins(self) -> Mapping[str, str]:
        return self._pins

    @property
    def args(self) -> frozenset[str]:
        """The code-running engine options allowed here, by name (`trust-remote-code`)."""
        return self._args

    def __bool__(self) -> bool:
        return bool(self._pins or self._args)

    def __repr__(self) -> str:
        return f"AllowedEngines({dict(self._pins)!r}, args={sorted(self._args)!r})"

    def check(self, spec: ReplicaSpec) -> None:
        """SpecNotAllowed if the replica's env or args would make its engine run code this node does not allow."""
        why = spec_refusal(spec.engine, spec.args, spec.env, self._args)
        if why:
            raise SpecNotAllowed(f"replica {spec.id} (profile {spec.profile!r}) {why}")

    def driver(self, spec: ReplicaSpec) -> TemplateDriver:
        """The driver for a catalog engine's replica, running the pinned program; EngineNotAllowed if it may not run here."""
        program = self._pins.get(spec.engine)
        if program is None:
            raise EngineNotAllowed(
                f"catalog engine {spec.engine!r} is not allowed on this node: a node runs the built-in engines "
                f"and only the catalog engines its operator allows ({allow_hint(spec.engine, _program_of(spec))})")
        asked = spec.command[0] if spec.command else ""
        resolved = _resolve(program)
        if resolved is None:
            if asked != program:
                raise EngineNotAllowed(_other_program(spec.engine, asked, program))
            # Allowed, but not installed: the driver's available() says so with the fix.
            return TemplateDriver.for_spec(spec)
        if asked not in (program, resolved):
            found = _resolve(asked)
            if found is None or os.path.realpath(found) != os.path.realpath(resolved):
                raise EngineNotAllowed(_other_program(spec.engine, asked, f"{program} ({resolved})"))
        return TemplateDriver(spec.engine, (resolved, *spec.command[1:]), spec.health, spec.metrics)

    def available(self) -> dict[str, tuple[bool, str]]:
        """Each allowed engine and whether its program is on this node, as `Driver.available` says it."""
        found = {}
        for name, program in self._pins.items():
            resolved = _resolve(program)
            found[name] = ((True, f"{program} at {resolved} (allowed on this node)") if resolved is not None else
                           (False, f"{program} (allowed as engine {name!r}) not found on PATH; install it on this "
                                   f"node or give its path ({allow_hint(name, '/path/to/' + os.path.basename(program))})"))
        return found


NOTHING_ALLOWED = AllowedEngines()


def _resolve(program: str) -> str | None:
    """Where `program` is on this node: itself if it is a path to an executable, else the PATH lookup."""
    if not program:
        return None
    if os.sep in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program)


def _program_of(spec: ReplicaSpec) -> str:
    program = spec.command[0] if spec.command else ""
    # The hint is copied into a shell by an operator: only a plain program is worth suggesting.
    return program if re.fullmatch(r"[A-Za-z0-9_./+-]{1,200}", program) else "PROGRAM"


def _other_program(name: str, asked: str, allowed: str) -> str:
    return (f"catalog engine {name!r} runs {asked!r}, but this node allows {name!r} only as {allowed}; "
            f"the catalog cannot change which program runs here (its operator can: {allow_hint(name, 'PROGRAM')})")


def parse_any(text: str) -> LoadReading | None:
    """The first built-in adapter that finds its families on the page."""
    for parse in (parse_vllm, parse_sglang, parse_llamacpp):
        reading = parse(text)
        if reading is not None:
            return reading
    return None
