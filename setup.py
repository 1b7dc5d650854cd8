"""The package list, derived from the folders so that no subpackage can be left out of the wheel.

The library lives in ``staleflow/``; the service folders sit at the top level and install as
subpackages of ``staleflow`` (``servers/`` -> ``staleflow.servers``, ...), so nothing generic like
``cli`` or ``servers`` lands in site-packages. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

FOLDERS = {
    "staleflow": "staleflow",
    "servers": "staleflow.servers",
    "coordinator": "staleflow.coordinator",
    "launch": "staleflow.launch",
    "cli": "staleflow.cli",
    "migrations": "staleflow.migrations",
}

packages = []
for folder, name in FOLDERS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir={name: folder for folder, name in FOLDERS.items()})
