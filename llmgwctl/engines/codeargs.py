"""Engine options that make a built-in engine run code the catalog chooses, refused unless a node allows them.

A profile's `args` are the catalog writer's to choose, and most tune the
engine. A few make it import or run code that is not the engine's own: the
model repository's Python (`--trust-remote-code`), a class or module named by
import path (vLLM's `--worker-cls`, `--middleware`...), a Python file
(`--tool-parser-plugin`), or let clients run commands (llama-server's
`--tools`). Whoever may edit the catalog could then run code on every node
that runs the profile, so a node refuses a replica whose args hold one,
unless its operator allowed that option (`llmgwctl agent --allow-engine-arg
OPTION`). The refusal is the replica's reason in status.

The list is of the options each engine documents as loading or running code
(vLLM 0.32's argument parser, llama-server's --help, SGLang's server
arguments), each with its reason; `CODE_OPTIONS` is the one place to add one.
Options are matched as the engines' parsers read them: vLLM and SGLang use
argparse, which takes `--opt=value`, and any unambiguous abbreviation, and
vLLM also `--opt_name` and `--opt.key value` for its JSON options.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..catalog.engine_env import env_refusal

VLLM, SGLANG, LLAMACPP = "vllm", "sglang", "llamacpp"


def _always(settings: Mapping[str, Any]) -> bool:
    return True


def _sets(*fields: str) -> Callable[[Mapping[str, Any]], bool]:
    """For a JSON option: refused only when it sets one of these fields (what imports code)."""
    def check(settings: Mapping[str, Any]) -> bool:
        keys = [key for key in settings if key]
        if keys:
            return any(key.rsplit(".", 1)[-1] in fields for key in keys)
        # Not a JSON mapping: the engine may still read it some way we do not, so look at the text.
        return any(field in str(settings.get("", "")) for field in fields)
    return check


def _custom_proposer(settings: Mapping[str, Any]) -> bool:
    # vLLM takes a draft `model` that looks like a dotted import path (no
    # "/": not a hub id) as a custom proposer class to import.
    model = settings.get("model")
    dotted = isinstance(model, str) and "/" not in model and len(model.split(".")) >= 2 and \
        all(part.isidentifier() for part in model.split("."))
    return dotted or settings.get("method") == "custom_class" or "custom_class" in str(settings.get("", ""))


def _not_builtin_executor(settings: Mapping[str, Any]) -> bool:
    # Any other value is an executor class vLLM imports by its import path.
    return str(settings.get("", "")) not in ("mp", "ray", "uni", "external_launcher")


def _demo_tools(settings: Mapping[str, Any]) -> bool:
    return "demo" in str(settings.get("", "")).split(",")


@dataclass(frozen=True, slots=True)
class CodeOption:
    """One engine option that can run code: its spellings, engines, why, and when its value makes it do so."""

    name: str                                   # the long form, without dashes: what --allow-engine-arg names
    engines: frozenset[str]
    reason: str
    aliases: tuple[str, ...] = ()               # other spellings, dashes included ("-cc")
    runs_code: Callable[[Mapping[str, Any]], bool] = _always

    @property
    def flag(self) -> str:
        return "--" + self.name


_IMPORTS = "imports and runs the Python it names by import path"
CODE_OPTIONS: tuple[CodeOption, ...] = (
    CodeOption("trust-remote-code", frozenset({VLLM, SGLANG}),
               "runs Python code shipped in the model's repository"),
    CodeOption("worker-cls", frozenset({VLLM}), _IMPORTS),
    CodeOption("worker-extension-cls", frozenset({VLLM}), _IMPORTS),
    CodeOption("scheduler-cls", frozenset({VLLM}), _IMPORTS),
    CodeOption("distributed-executor-backend", frozenset({VLLM}), _IMPORTS + " (other than mp, ray, uni)",
               runs_code=_not_builtin_executor),
    CodeOption("middleware", frozenset({VLLM}), _IMPORTS + " into the API server"),
    CodeOption("logits-processors", frozenset({VLLM}), _IMPORTS),
    CodeOption("model-class-overrides", frozenset({VLLM}), _IMPORTS),
    CodeOption("tool-parser-plugin", frozenset({VLLM}), "runs the Python file it names"),
    CodeOption("reasoning-parser-plugin", frozenset({VLLM}), "runs the Python file it names"),
    CodeOption("config", frozenset({VLLM}), "reads more options from a file, where this check cannot see them"),
    CodeOption("log-config-file", frozenset({VLLM}), "hands the file to logging's dictConfig, which calls what it names"),
    CodeOption("logging-config", frozenset({VLLM}),
               "with pylogging_config_file, hands that file to logging's dictConfig, which calls what it names",
               runs_code=_sets("pylogging_config_file")),
    CodeOption("kv-transfer-config", frozenset({VLLM}), "with kv_connector_module_path, imports that module",
               runs_code=_sets("kv_connector_module_path")),
    CodeOption("ec-transfer-config", frozenset({VLLM}), "with ec_connector_module_path, imports that module",
               runs_code=_sets("ec_connector_module_path")),
    CodeOption("ec-manager-config", frozenset({VLLM}), "with encoder_cache_manager_cls, imports that class",
               runs_code=_sets("encoder_cache_manager_cls")),
    CodeOption("compilation-config", frozenset({VLLM}), "with backend, imports the compile backend it names",
               aliases=("-cc",), runs_code=_sets("backend")),
    CodeOption("speculative-config", frozenset({VLLM}),
               "with a custom proposer (method custom_class, or a model named by import path), imports it",
               aliases=("-sc",), runs_code=_custom_proposer),
    CodeOption("tool-server", frozenset({VLLM}), "with demo, runs model-written Python code",
               runs_code=_demo_tools),
    CodeOption("enable-custom-logit-processor", frozenset({SGLANG}),
               "lets every client send a Python logit processor that the engine deserializes and runs"),
    CodeOption("tools", frozenset({LLAMACPP}), "lets clients run shell commands and write files on the node"),
    CodeOption("tools-runtime", frozenset({LLAMACPP}), "chooses where client-run tools execute (a container, a host over ssh)"),
    CodeOption("video-ffmpeg-dir", frozenset({LLAMACPP}), "runs ffmpeg and ffprobe from the directory it names"),
)
BY_NAME: Mapping[str, CodeOption] = MappingProxyType({o.name: o for o in CODE_OPTIONS})

# Real options of an engine that are a prefix of a refused one: argparse takes
# them exactly, so they are not abbreviations of it (vLLM's --model is not
# --model-class-overrides).
_EXACT_PREFIXES: Mapping[str, frozenset[str]] = MappingProxyType({
    VLLM: frozenset({"model", "reasoning-parser"}),
})
# Engines whose parser is argparse: they take abbreviations and `_` for `-` (vLLM).
_ARGPARSE = frozenset({VLLM, SGLANG})


def normalize_option(value: str) -> str:
    """What --allow-engine-arg takes (`--trust-remote-code`, `trust_remote_code`) as a CODE_OPTIONS name; ValueError if none."""
    name = value.strip().lstrip("-").replace("_", "-")
    if name not in BY_NAME:
        raise ValueError(f"{value!r} is not an engine option the node refuses; nothing to allow (refused unless "
                         f"allowed: {', '.join(o.flag for o in CODE_OPTIONS)})")
    return name


@dataclass(frozen=True, slots=True)
class Refusal:
    option: CodeOption
    arg: str            # as the profile wrote it

    def __str__(self) -> str:
        # Name the option too when the profile spelled it otherwise (-cc, an abbreviation, a_b).
        spelled = "" if self.arg.partition("=")[0] == self.option.flag else f" ({self.option.flag})"
        return f"{self.arg!r}{spelled} {self.option.reason}"


def code_options(engine: str, args: Sequence[str], allowed: Iterable[str] = ()) -> list[Refusal]:
    """The args that would make `engine` run code the catalog chooses, minus the options `allowed` (names)."""
    allowed = frozenset(allowed)     # once, not once per option: `allowed` may be a one-shot iterable
    table = [o for o in CODE_OPTIONS if engine in o.engines and o.name not in allowed]
    if not table:
        return []
    found = []
    for i, arg in enumerate(args):
        if not arg.startswith("-") or arg in ("-", "--"):
            continue
        option, key, value = _match(engine, arg, table)
        if option is None:
            continue
        if value is None and "=" not in arg and i + 1 < len(args):
            value = args[i + 1]
        if option.runs_code(_settings(key, value)):
            found.append(Refusal(option, arg))
    return found


def _match(engine: str, arg: str, table: list[CodeOption]) -> tuple[CodeOption | None, str, str | None]:
    """The option `arg` spells (with the dotted key after it, and its `=value`), or None."""
    head, eq, value = arg.partition("=")
    head, _, key = head.partition(".")
    name: str | None = None
    if head.startswith("--"):
        name = head[2:].replace("_", "-") if engine in _ARGPARSE else head[2:]
    for option in table:
        if head in option.aliases or name == option.name:
            return option, key, value if eq else None
    if engine in _ARGPARSE and name and len(name) >= 2 and name not in _EXACT_PREFIXES.get(engine, frozenset()):
        # argparse takes an unambiguous prefix as the option; an ambiguous one
        # it refuses itself, so any prefix of a refused option is refused here.
        for option in table:
            if option.name.startswith(name):
                return option, key, value if eq else None
    return None, "", None


def _settings(key: str, value: str | None) -> dict[str, Any]:
    """An option's value as flat settings: {"": raw value}, plus its JSON mapping's keys or its dotted key."""
    out: dict[str, Any] = {"": value or ""}
    if key:
        out[key.rstrip("+").replace("-", "_")] = value
        return out
    try:
        parsed = json.loads(value) if value else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        out.update(_flat(parsed))
    return out


def _flat(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in mapping.items():
        path = prefix + str(k).replace("-", "_")
        out[path] = v
        if isinstance(v, dict):
            out.update(_flat(v, path + "."))
    return out


def allow_arg_hint(option: CodeOption) -> str:
    """The option that allows `option` on a node: the fix every refusal names."""
    return f"llmgwctl agent --allow-engine-arg {option.flag}"


def spec_refusal(engine: str, args: Sequence[str], env: Mapping[str, str], allowed: Iterable[str] = ()) -> str | None:
    """Why a node refuses a replica's env or args (code the catalog would choose), or None.

    Env that loads code is refused whatever the node allows (its operator sets
    such a variable in the agent's own environment instead); an option that
    runs code is refused unless the operator allowed that option.
    """
    for key in env:
        why = env_refusal(key)
        if why:
            return f"env: {why}"
    refused = code_options(engine, args, allowed)
    if refused:
        first = refused[0]
        return (f"args: {first}; this node does not run it unless its operator allows it "
                f"({allow_arg_hint(first.option)})")
    return None
