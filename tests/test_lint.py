"""The project's own lint config (pyproject.toml) holds for the whole tree; it selects line length
(E501) and ``zip()`` without ``strict=`` (B905), which grew unseen while nothing selected them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff")  # the test extra installs it

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_tree_is_clean_under_the_projects_config():
    result = ruff(".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_config_selects_line_length_and_strict_zip(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("pairs = list(zip([1], [2]))\n" + "x = " + repr("a" * 120) + "\n")
    result = ruff("--config", str(ROOT / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert result.returncode == 1
    assert "B905" in result.stdout and "E501" in result.stdout, result.stdout
