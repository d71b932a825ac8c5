"""pytest.ini: what a run of the suite leaves on disk. pytest's default kept every test's tmp_path for the last 3
runs, about 12 GB a run (docs/tests.md); a passed test's is deleted now, a failed test's kept for a look."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TWO = """
def test_passes(tmp_path):
    (tmp_path / "run").write_bytes(b"x" * 1000)

def test_fails(tmp_path):
    (tmp_path / "run").write_bytes(b"x" * 1000)
    assert False
"""


def test_a_passed_tests_directory_is_deleted_and_a_failed_ones_kept(tmp_path):
    (tmp_path / "test_two.py").write_text(TWO)
    root = tmp_path / "root"  # the run's own temporary root, so that no other run's directories are counted
    root.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n0",
        "-p",
        "no:cacheprovider",
        "-c",
        os.path.join(REPO, "pytest.ini"),
    ]
    cmd += ["--rootdir", str(tmp_path), str(tmp_path / "test_two.py")]
    env = {**os.environ, "PYTEST_DEBUG_TEMPROOT": str(root)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout[-2000:]
    left = sorted(p.parent.name for p in root.rglob("run"))
    assert left == ["test_fails0"], left
