"""Runs conformance checks, each with fresh backends and a time limit, and formats the results."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ominix_runtime.conformance.checks import (
    ALL_CHECKS,
    BackendFactory,
    CheckFailed,
    CheckFn,
    CheckSkipped,
    Harness,
)

Status = Literal["PASS", "FAIL", "SKIP"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    status: Status
    seconds: float
    message: str

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


async def run_check(name: str, check: CheckFn, make_backends: BackendFactory, timeout: float) -> CheckResult:
    harness = Harness(make_backends, step_timeout=min(timeout, 120.0))
    start = time.perf_counter()
    status: Status = "FAIL"
    try:
        message = await asyncio.wait_for(check(harness), timeout)
        status = "PASS"
    except CheckSkipped as exc:
        message, status = str(exc), "SKIP"
    except CheckFailed as exc:
        message = str(exc)
    except asyncio.TimeoutError:
        message = f"did not finish within {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - any error is a readable failure of this check
        message = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            await asyncio.wait_for(harness.close(), 30.0)
        except Exception as exc:  # noqa: BLE001 - a failed shutdown fails the check too
            if status != "FAIL":
                status, message = "FAIL", f"engine shutdown failed: {type(exc).__name__}: {exc}"
    return CheckResult(name, status, time.perf_counter() - start, message)


async def run_checks(
    make_backends: BackendFactory, names: Sequence[str] | None = None, timeout: float = 120.0
) -> list[CheckResult]:
    """Run the named checks (all by default) one after another."""
    selected = list(names) if names else list(ALL_CHECKS)
    unknown = [n for n in selected if n not in ALL_CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {sorted(ALL_CHECKS)}")
    return [await run_check(n, ALL_CHECKS[n], make_backends, timeout) for n in selected]


def all_passed(results: Sequence[CheckResult]) -> bool:
    """No check failed and at least one passed (a SKIP neither passes nor fails)."""
    return any(r.passed for r in results) and not any(r.failed for r in results)


def format_table(results: Sequence[CheckResult]) -> str:
    width = max([len(r.name) for r in results] + [5])
    lines = [f"{'check':<{width}}  result  seconds  message", f"{'-' * width}  ------  -------  -------"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.2f}  {r.message}")
    n_pass = sum(r.passed for r in results)
    n_skip = sum(r.status == "SKIP" for r in results)
    skipped = f", {n_skip} skipped (not applicable)" if n_skip else ""
    lines.append(f"{n_pass}/{len(results)} checks passed{skipped}")
    return "\n".join(lines)


def format_json(results: Sequence[CheckResult]) -> str:
    checks = [
        {"name": r.name, "status": r.status, "passed": r.passed, "seconds": r.seconds, "message": r.message}
        for r in results
    ]
    return json.dumps({"passed": all_passed(results), "checks": checks}, indent=2)
