"""Runs conformance checks, each with fresh backends and a time limit, and formats the results."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ominix_runtime.conformance.checks import ALL_CHECKS, BackendFactory, CheckFailed, CheckFn, Harness


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    passed: bool
    seconds: float
    message: str


async def run_check(name: str, check: CheckFn, make_backends: BackendFactory, timeout: float) -> CheckResult:
    harness = Harness(make_backends, step_timeout=min(timeout, 120.0))
    start = time.perf_counter()
    passed = False
    try:
        message = await asyncio.wait_for(check(harness), timeout)
        passed = True
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
            if passed:
                passed, message = False, f"engine shutdown failed: {type(exc).__name__}: {exc}"
    return CheckResult(name, passed, time.perf_counter() - start, message)


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
    return bool(results) and all(r.passed for r in results)


def format_table(results: Sequence[CheckResult]) -> str:
    width = max([len(r.name) for r in results] + [5])
    lines = [f"{'check':<{width}}  result  seconds  message", f"{'-' * width}  ------  -------  -------"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {'PASS' if r.passed else 'FAIL':<6}  {r.seconds:7.2f}  {r.message}")
    n_pass = sum(r.passed for r in results)
    lines.append(f"{n_pass}/{len(results)} checks passed")
    return "\n".join(lines)


def format_json(results: Sequence[CheckResult]) -> str:
    return json.dumps({"passed": all_passed(results), "checks": [asdict(r) for r in results]}, indent=2)
