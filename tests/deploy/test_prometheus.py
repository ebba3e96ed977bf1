"""deploy/prometheus/: the alert rules pass `promtool check rules`, do what they say under
`promtool test rules` (alerts.test.yaml), and the scrape configuration passes `promtool check config`."""
from __future__ import annotations

import subprocess

from .tools import DEPLOY, tool

PROM = DEPLOY / "prometheus"


def promtool(*args: str, cwd=PROM) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_alert_rules_pass_promtool_check():
    out = promtool("check", "rules", "alerts.yaml")
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_each_alert_fires_on_its_trouble_and_not_on_its_healthy_neighbour():
    out = promtool("test", "rules", "alerts.test.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_is_tested():
    import yaml
    rules = {r["alert"] for g in yaml.safe_load((PROM / "alerts.yaml").read_text())["groups"] for r in g["rules"]}
    tested = {case["alertname"] for t in yaml.safe_load((PROM / "alerts.test.yaml").read_text())["tests"]
              for case in t["alert_rule_test"] if case.get("exp_alerts")}
    assert rules == tested, f"alerts never seen firing in alerts.test.yaml: {sorted(rules - tested)}"


def test_promtool_here_rejects_a_broken_rule(tmp_path):
    (tmp_path / "bad.yaml").write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: rate(llmgw_x[5m]\n")
    assert promtool("check", "rules", "bad.yaml", cwd=tmp_path).returncode != 0


def test_scrape_config_passes_promtool_check():
    # --syntax-only: the token file it names exists on the Prometheus server, not here.
    out = promtool("check", "config", "--syntax-only", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
