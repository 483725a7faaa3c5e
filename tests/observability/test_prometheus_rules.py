"""The Prometheus scrape config and alert rules under deploy/prometheus pass the real promtool."""

from __future__ import annotations

import shutil
from pathlib import Path

from obs_tools import DEPLOY, promtool, run

PROMETHEUS = DEPLOY / "prometheus"


def test_scrape_config_is_valid() -> None:
    result = run([promtool(), "check", "config", str(PROMETHEUS / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_alert_rules_are_valid() -> None:
    result = run([promtool(), "check", "rules", str(PROMETHEUS / "alerts.yml")])
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rule_unit_tests_pass() -> None:
    result = run([promtool(), "test", "rules", str(PROMETHEUS / "alerts_test.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_rule_unit_tests_catch_a_wrong_threshold(tmp_path: Path) -> None:
    """The rule tests can fail: with the KV threshold raised to 99% the KV test no longer sees its alert."""
    shutil.copy(PROMETHEUS / "alerts_test.yml", tmp_path / "alerts_test.yml")
    rules = (PROMETHEUS / "alerts.yml").read_text()
    assert "ominix_kv_usage_ratio > 0.95" in rules
    (tmp_path / "alerts.yml").write_text(
        rules.replace("ominix_kv_usage_ratio > 0.95", "ominix_kv_usage_ratio > 0.99")
    )
    result = run([promtool(), "test", "rules", str(tmp_path / "alerts_test.yml")])
    assert result.returncode != 0
    assert "OminixKVCacheNearlyFull" in result.stdout + result.stderr
