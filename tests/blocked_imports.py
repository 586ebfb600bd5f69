"""A folder that, first on ``PYTHONPATH``, makes importing the named packages fail: a stand-in for a
serving machine without them (the tests of exported programs run a process with it)."""

from pathlib import Path
from typing import Sequence


def blocking_folder(tmp_path: Path, packages: Sequence[str]) -> Path:
    folder = tmp_path / "blocker"
    for package in packages:
        (folder / package).mkdir(parents=True, exist_ok=True)
        (folder / package / "__init__.py").write_text(f"raise ImportError('{package} is not installed here')\n")
    return folder
