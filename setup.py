"""Packaging: the repository's folders ``common/ proxy/ actors/ learner/`` install as
``harnessrl.common``, ``harnessrl.proxy``, ``harnessrl.actors`` and ``harnessrl.learner``, so the
distribution puts exactly one top-level import package, ``harnessrl``, into site-packages.
Everything else (metadata, dependencies, package data) is in ``pyproject.toml``."""

from setuptools import find_namespace_packages, setup

SUBPACKAGES = ("common", "proxy", "actors", "learner")


def packages() -> list[str]:
    """Every package and data folder below the four folders, named under ``harnessrl``."""
    out = []
    for sub in SUBPACKAGES:
        found = find_namespace_packages(where=sub, exclude=["*__pycache__*"])
        out += [f"harnessrl.{sub}", *(f"harnessrl.{sub}.{p}" for p in found)]
    return out


setup(packages=packages(), package_dir={f"harnessrl.{s}": s for s in SUBPACKAGES})
