"""Which environment variables a catalog may not give an engine: those that load code into it.

A profile's `env` tunes an engine (VLLM_*, CUDA_*, NCCL_DEBUG, HF_*, OMP_*...).
Some variables instead choose what code the engine process runs: the dynamic
loader's, the interpreters', the shells', and a few libraries' and engines'
own that name a library, a program or a Python file to load. Set by whoever
writes the catalog, each of them is code execution on every node that runs
the profile, so the catalog refuses them (with the file and line) and the
agent refuses a replica spec that carries one anyway (a forged desired list).

A node that really needs one (an LD_LIBRARY_PATH for its CUDA install, say)
sets it in its agent's own environment, which every engine inherits: that is
the node operator's choice, not the catalog's.

It is a deny-list of what is known to load code, not an allow-list: the
engines read hundreds of legitimate variables (vLLM alone over 300), and an
allow-list of them would break a new engine release's knobs every time.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

_LOADER = "the dynamic loader reads it in every program it starts (a library to preload, or where libraries are found)"
_PYTHON = "Python reads it at startup to choose which code it imports or runs"

# Exact names, each with why it loads code.
REFUSED: Mapping[str, str] = MappingProxyType({
    # Where a program started by name is found: the engine's own launcher and
    # the compilers and helpers engines start at run time (torch's inductor
    # runs a C++ compiler, Triton `cc`, llama.cpp ffmpeg).
    "PATH": "it chooses which program runs wherever the engine starts one by name (its compilers and helpers)",
    "GCONV_PATH": "glibc loads character-set conversion modules (shared libraries) from it",
    "PYTHONPATH": _PYTHON,
    "PYTHONHOME": _PYTHON,
    "PYTHONSTARTUP": _PYTHON,
    "PYTHONUSERBASE": _PYTHON + " (its site-packages .pth files run code)",
    "PYTHONPYCACHEPREFIX": "Python loads compiled bytecode from it instead of from the installed modules",
    "PYTHONBREAKPOINT": "Python imports and calls what it names",
    "PYTHONPLATLIBDIR": _PYTHON,
    # ~/.local/lib/pythonX.Y/site-packages is on sys.path, and a .pth file there runs code.
    "HOME": "Python imports from the user site-packages under it (and its .pth files run code)",
    "BASH_ENV": "bash runs the file it names before any script",
    "ENV": "sh runs the file it names when it starts",
    "SHELLOPTS": "it turns on shell options (xtrace with PS4) in every shell the engine starts",
    "BASHOPTS": "it turns on shell options in every bash the engine starts",
    "PS4": "a shell tracing commands expands it, command substitutions included",
    "PERL5OPT": "perl takes it as command-line options (-M loads a module)",
    "PERL5LIB": "perl loads modules from it",
    "PERLLIB": "perl loads modules from it",
    "RUBYOPT": "ruby takes it as command-line options (-r loads a file)",
    "RUBYLIB": "ruby loads files from it",
    "NODE_OPTIONS": "node takes it as command-line options (--require loads a file)",
    "NODE_PATH": "node loads modules from it",
    "JAVA_TOOL_OPTIONS": "the JVM takes it as options (-javaagent loads code)",
    "_JAVA_OPTIONS": "the JVM takes it as options (-javaagent loads code)",
    "JDK_JAVA_OPTIONS": "the JVM takes it as options (-javaagent loads code)",
    "OPENSSL_CONF": "an OpenSSL config file can load engines and providers (shared libraries)",
    "OPENSSL_ENGINES": "OpenSSL loads engines (shared libraries) from it",
    "OPENSSL_MODULES": "OpenSSL loads providers (shared libraries) from it",
    "GGML_BACKEND_PATH": "llama.cpp's ggml loads the backend library it names",
    # llama-server reads every option from LLAMA_ARG_*; these are the forms of
    # options the node refuses in args (llmgwctl.engines.codeargs), where its
    # operator can allow them -- never through the environment.
    "LLAMA_ARG_TOOLS": "it is llama-server's --tools, which lets clients run shell commands (pass --tools "
                       "in args, where a node's operator can allow it)",
    "LLAMA_ARG_TOOLS_RUNTIME": "it is llama-server's --tools-runtime, where client-run tools execute",
    "LLAMA_ARG_VIDEO_FFMPEG_DIR": "llama-server runs ffmpeg and ffprobe from the directory it names",
    "NCCL_NET_PLUGIN": "NCCL loads the network plugin library it names",
    "NCCL_TUNER_PLUGIN": "NCCL loads the tuner plugin library it names",
    "NCCL_PROFILER_PLUGIN": "NCCL loads the profiler plugin library it names",
    "VLLM_CUDART_SO_PATH": "vLLM loads the CUDA runtime library it names",
    "VLLM_NCCL_SO_PATH": "vLLM loads the NCCL library it names",
    "VLLM_CUDA_COMPATIBILITY_PATH": "vLLM puts it on the library search path",
    "VLLM_RUST_FRONTEND_PATH": "vLLM runs the program it names as its front end",
    # logging.config.dictConfig builds any callable a config names ("()": "module.f").
    "VLLM_LOGGING_CONFIG_PATH": "vLLM hands the file to logging's dictConfig, which calls what the file names",
})

# Whole families, by prefix.
REFUSED_PREFIXES: Mapping[str, str] = MappingProxyType({
    # LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH...: glibc honours them all, and
    # none is a tuning knob an engine profile needs.
    "LD_": _LOADER,
    "DYLD_": _LOADER,
    # Exported shell functions: bash defines them before running anything, so
    # one named like a command replaces it.
    "BASH_FUNC_": "bash defines the function it holds before it runs anything, replacing a command of that name",
})


def env_refusal(key: str) -> str | None:
    """Why a catalog may not set `key` in an engine's environment, or None if it may."""
    why = REFUSED.get(key)
    if why is None:
        why = next((reason for prefix, reason in REFUSED_PREFIXES.items() if key.startswith(prefix)), None)
    if why is None:
        return None
    return (f"{key} decides what code the engine runs: {why}; a catalog may not set it (a node that needs it "
            "sets it in its agent's environment)")
