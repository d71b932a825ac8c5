"""The code is formatted and lint-clean (ruff.toml): CI runs this with everything else."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("command", [["format", "--check", "--diff"], ["check"]], ids=["ruff format", "ruff check"])
def test_ruff(command):
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (
        f"ruff {' '.join(command)} . failed; `ruff format . && ruff check --fix .` fixes most:\n{proc.stdout[-5000:]}{proc.stderr[-2000:]}"
    )
