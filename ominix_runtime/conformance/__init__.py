"""Backend conformance suite, runnable from the CLI (``ominix-runtime conformance``) and from pytest."""

from ominix_runtime.conformance.checks import ALL_CHECKS, CheckFailed, CheckSkipped, Harness
from ominix_runtime.conformance.runner import CheckResult, all_passed, format_table, run_checks

__all__ = [
    "ALL_CHECKS",
    "CheckFailed",
    "CheckResult",
    "CheckSkipped",
    "Harness",
    "all_passed",
    "format_table",
    "run_checks",
]
