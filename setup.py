"""Which packages the distribution holds: found by setuptools, not listed (metadata: pyproject.toml).

Two source folders install under another name: ``kernels/`` (the Triton kernels) as
``loka_torchrec.kernels`` and ``recipes/`` (the Hydra recipes, YAML files included) as
``loka_job.recipes``; their subpackages follow their folders. Every other package is found where
its name says. ``tests/test_wheel.py`` checks the built wheel against the source tree.
"""

from setuptools import find_packages, setup

# Installed package -> the folder it is built from.
RELOCATED = {"loka_torchrec.kernels": "kernels", "loka_job.recipes": "recipes"}


def packages():
    """Every package under ``loka_torchrec/`` and ``loka_job/``, then each relocated folder's."""
    found = find_packages(include=["loka_torchrec", "loka_torchrec.*", "loka_job", "loka_job.*"])
    for package, folder in RELOCATED.items():
        found += [package] + [f"{package}.{sub}" for sub in find_packages(where=folder)]
    return found


setup(packages=packages(), package_dir=RELOCATED)
