"""Project rules that keep policy and mechanism apart, and the tree lint-clean."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_policy_package_never_imports_torch() -> None:
    offenders = []
    for path in sorted((ROOT / "ominix_runtime").rglob("*.py")):
        found = _imports(path) & {"torch", "torch_npu", "triton"}
        # `ominix-runtime worker` is dispatched to the worker package here; that is its only link to mechanism.
        dispatch = path.relative_to(ROOT).as_posix() == "ominix_runtime/cli/worker_command.py"
        if not dispatch and "ominix_worker" in _imports(path):
            found.add("ominix_worker")
        if found:
            offenders.append(f"{path.relative_to(ROOT)}: {sorted(found)}")
    assert not offenders, "policy code imports mechanism:\n" + "\n".join(offenders)


def test_importing_every_policy_module_loads_no_torch() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "ominix_runtime").rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m.removesuffix('.__init__'))\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'ominix_worker')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is installed by the test extra"
    dirs = ["ominix_runtime", "workers", "tests", "bench"]
    check = subprocess.run([ruff, "check", *dirs], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run(
        [ruff, "format", "--check", *dirs], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_is_clean() -> None:
    """The type checker passes on what pyproject's [tool.mypy] names (strict for contract, engine, server)."""
    check = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert "No module named mypy" not in check.stderr, "mypy is installed by the test extra"
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_engine_core_and_the_server_see_worker_groups_only_through_their_base() -> None:
    """EngineCore and the server talk to WorkerGroup; the kinds of group are built by groups.build_group."""
    kinds = {"ominix_runtime.engine.groups.step_group", "ominix_runtime.engine.groups.request_group"}
    offenders = []
    for path in [
        ROOT / "ominix_runtime/engine/core.py",
        *sorted((ROOT / "ominix_runtime/server").glob("*.py")),
    ]:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                used = names & kinds
                if node.module == "ominix_runtime.engine.groups":
                    used |= {a.name for a in node.names} & {"StepWorkerGroup", "RequestWorkerGroup"}
                if used:
                    offenders.append(f"{path.relative_to(ROOT)}: {sorted(used)}")
    assert not offenders, "code that should see only WorkerGroup imports a kind of group:\n" + "\n".join(
        offenders
    )
