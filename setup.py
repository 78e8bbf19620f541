"""Package discovery that ``pyproject.toml`` cannot express on its own.

The config tree lives in ``conf/`` at the top of the repository but ships as the package
``corelib.conf``; every other package under ``corelib/`` is discovered, so a new subpackage
cannot be left out of the wheel by a list that was not updated.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["corelib", "corelib.*"]), "corelib.conf"],
    package_dir={"corelib.conf": "conf"},
)
