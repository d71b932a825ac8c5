"""The code is formatted and lint-clean (ruff.toml): CI runs this with everything else. Only the files git
tracks are read: a virtual environment made inside the clone (V/, env/) is not the project."""

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = [["format", "--check", "--diff"], ["check"]]


def ruff(command, repo):
    """`ruff command` over the Python files git tracks in `repo`. --force-exclude: ruff.toml's excludes still
    hold for files named on the command line."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=repo, capture_output=True, text=True)
    assert listed.returncode == 0, f"git ls-files failed in {repo}: {listed.stderr}"
    files = [f for f in listed.stdout.split("\0") if f]
    cmd = [sys.executable, "-m", "ruff", *command, "--force-exclude", *files]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", COMMANDS, ids=["ruff format", "ruff check"])
def test_ruff(command):
    proc = ruff(command, REPO)
    assert proc.returncode == 0, (
        f"ruff {' '.join(command)} failed; `ruff format . && ruff check --fix .` fixes most:\n{proc.stdout[-5000:]}{proc.stderr[-2000:]}"
    )


def test_a_virtual_environment_inside_the_clone_is_not_linted(tmp_path):
    """A venv under a name ruff does not skip by itself (V/, env/): its bin/ scripts are not ours to format."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    shutil.copy(os.path.join(REPO, "ruff.toml"), tmp_path)
    (tmp_path / "ours.py").write_text("x = 1\n")
    subprocess.run(["git", "add", "ours.py", "ruff.toml"], cwd=tmp_path, check=True)
    (tmp_path / "V" / "bin").mkdir(parents=True)
    (tmp_path / "V" / "bin" / "activate_this.py").write_text("import sys,os\nx=[1,2 ,3]\n")  # unformatted, unsorted
    for command in COMMANDS:
        proc = ruff(command, tmp_path)
        assert proc.returncode == 0, f"ruff {' '.join(command)} read the venv:\n{proc.stdout[-2000:]}{proc.stderr}"
