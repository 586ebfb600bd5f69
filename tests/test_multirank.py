"""The test helper that runs a 2-rank job once more after the known gloo/TorchRec abort, and only then."""

import sys

import pytest

from multirank import ABORT, run_job

# Fails with the known abort while the marker file does not exist yet (creating it), then succeeds.
_FLAKY = f"""
import os, sys
marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    print({ABORT!r}, file=sys.stderr)
    sys.exit(134)
print("ok")
"""


def test_the_known_abort_is_run_once_more_in_an_emptied_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from the first attempt")
    with pytest.warns(UserWarning, match="running the job once more"):
        proc = run_job([sys.executable, "-c", _FLAKY, str(tmp_path / "marker")], fresh_dir=str(out), timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok"
    assert list(out.iterdir()) == []  # emptied before the second run


def test_other_failures_and_a_second_abort_are_not_retried(tmp_path):
    proc = run_job([sys.executable, "-c", "import sys; sys.exit(3)"], timeout=60)
    assert proc.returncode == 3
    always = f"import sys; print({ABORT!r}, file=sys.stderr); sys.exit(134)"
    with pytest.warns(UserWarning):
        proc = run_job([sys.executable, "-c", always], timeout=60)
    assert proc.returncode == 134  # the second abort is the caller's failure
