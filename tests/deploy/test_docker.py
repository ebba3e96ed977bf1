"""deploy/Dockerfile (CPU, llama.cpp) and deploy/Dockerfile.vllm (GPU agent) held against hadolint.

No container builder runs on the machines the suite runs on (the docker
client is there, no engine), so the check is the linter, with every finding
failing (deploy/hadolint.yaml), plus the few promises deploy/README.md makes
about the images that a linter cannot know.
"""
from __future__ import annotations

import re
import subprocess

from .tools import DEPLOY, ROOT, tool

DOCKERFILES = (DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.vllm")


def hadolint(*paths) -> subprocess.CompletedProcess:
    return subprocess.run([tool("hadolint"), "--no-color", "--config", str(DEPLOY / "hadolint.yaml"), *map(str, paths)],
                          capture_output=True, text=True, timeout=60)


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", text, re.M)]


def test_hadolint_passes_both_dockerfiles():
    out = hadolint(*DOCKERFILES)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_with_our_settings_still_catches_a_bad_dockerfile(tmp_path):
    # The settings ignore one rule; this keeps them from silencing the linter.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y curl\nUSER root\n")
    out = hadolint(bad)
    assert out.returncode != 0
    for rule in ("DL3007", "DL3015", "DL3009", "DL3002"):   # latest, recommends, apt lists, root
        assert rule in out.stdout, out.stdout


def test_cpu_image_runs_serve_unprivileged_with_a_catalog_volume_and_a_healthcheck():
    ins = instructions(DEPLOY / "Dockerfile")
    last_stage = ins[max(i for i, (op, _) in enumerate(ins) if op == "FROM"):]
    ops = dict(last_stage)
    assert re.match(r"\d+(:\d+)?$", ops["USER"]) and not ops["USER"].startswith("0"), ops["USER"]
    assert '"llmgwctl", "serve"' in ops["ENTRYPOINT"] and '"/etc/llmgw/catalogs"' in ops["ENTRYPOINT"]
    assert '"/etc/llmgw/catalogs"' in ops["VOLUME"]
    assert "/healthz" in ops["ENV"] and "LLMGW_HEALTHCHECK_URL" in ops["HEALTHCHECK"]
    # The router listens where the health check asks.
    assert '"0.0.0.0:8080"' in ops["ENTRYPOINT"] and "127.0.0.1:8080/healthz" in ops["ENV"]
    build = " ".join(args for op, args in ins if op == "RUN")
    assert "[local" in build and "LLAMA_CPP_BUILD_JOBS" in (DEPLOY / "Dockerfile").read_text()


def test_gpu_image_is_an_unprivileged_agent_on_vllms_image():
    ops = dict(instructions(DEPLOY / "Dockerfile.vllm"))
    assert ops["FROM"] == "${VLLM_IMAGE}" and "ARG VLLM_IMAGE=vllm/vllm-openai:v" in (DEPLOY / "Dockerfile.vllm").read_text()
    assert re.match(r"\d+(:\d+)?$", ops["USER"]) and not ops["USER"].startswith("0")
    assert ops["ENTRYPOINT"].startswith('["llmgwctl", "agent"')


def test_build_context_holds_everything_the_install_reads():
    # The .dockerignore lets through a list of paths: each must exist, and
    # what setup.cfg reads at build time must be among them.
    for ignore in (DEPLOY / "Dockerfile.dockerignore", DEPLOY / "Dockerfile.vllm.dockerignore"):
        kept = [ln[1:].rstrip("/") for ln in ignore.read_text().splitlines() if ln.startswith("!")]
        for path in kept:
            assert (ROOT / path).exists(), f"{ignore.name} keeps {path}, which does not exist"
        for needed in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "llmgwctl", "schemas", "man", "catalogs"):
            assert needed in kept, f"{ignore.name} leaves out {needed}"
