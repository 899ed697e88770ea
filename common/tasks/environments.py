"""Named task environments and the ``[environment]`` table of task.toml / suite.toml.

A task environment (`TaskEnv`) is what a task's prompt and checker assume beyond the sandbox's
base userland: a ``python`` command and pip packages. Where a task gets one, first match wins:

1. its own ``[environment]`` table (native ``task.toml``);
2. its format: ClawGym tasks (folders loaded in place, and what ``tasks import`` writes from
   ClawGym folders or JSONL) use the built-in ``clawgym``;
3. its suite's ``suite.toml`` ``[environment]`` table (tasks loaded through their suite, or by
   a path whose parent folder holds ``suite.toml``);
4. none: the base userland.

The table::

    [environment]
    name = "clawgym"            # the built-in to start from: base (nothing) or clawgym
    pip = ["openpyxl==3.1.5"]   # added to it (a project it already pins is replaced)
    python_alias = true         # override its python alias (omit: keep the built-in's)

Built-ins pin every package, dependencies included, so that an environment's content depends
only on its definition, not on the day it was built.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from harnessrl.common.tasks.model import TaskEnv, pip_requirements, requirement_project

CLAWGYM_PIP = [
    # test tools
    "pytest==8.4.2",
    "iniconfig==2.3.0",
    "packaging==26.3",
    "pluggy==1.6.0",
    "pygments==2.21.0",
    # data
    "pandas==2.3.3",
    "numpy==2.2.6",
    "python-dateutil==2.9.0.post0",
    "pytz==2026.4",
    "tzdata==2026.4",
    "six==1.17.0",
    "pyyaml==6.0.3",
    # web
    "requests==2.34.2",
    "charset-normalizer==3.5.2",
    "idna==3.20",
    "urllib3==2.8.0",
    "certifi==2026.7.22",
    "flask==3.1.3",
    "werkzeug==3.1.9",
    "jinja2==3.1.6",
    "itsdangerous==2.2.0",
    "click==8.5.0",
    "blinker==1.9.0",
    "markupsafe==3.0.3",
]
"""The ``clawgym`` environment's packages: what ClawGym prompts and checkers use (``python -m
pytest``, pandas, requests, flask, PyYAML) with their dependency closure, pinned."""

BUILTIN_ENVS: dict[str, TaskEnv] = {
    "base": TaskEnv(name="base"),
    "clawgym": TaskEnv(name="clawgym", python_alias=True, pip=CLAWGYM_PIP),
}
"""Environments known by name: ``base`` adds nothing; ``clawgym`` is a ``python`` command,
pytest, pandas, numpy, requests, flask and PyYAML (`CLAWGYM_PIP`)."""

CLAWGYM_ENV = BUILTIN_ENVS["clawgym"]


def builtin_env(name: str) -> TaskEnv:
    """The built-in environment ``name``; ValueError naming the known ones otherwise."""
    try:
        return BUILTIN_ENVS[name]
    except KeyError:
        known = ", ".join(BUILTIN_ENVS)
        raise ValueError(f"unknown environment {name!r} (built-in: {known})") from None


class EnvironmentToml(BaseModel):
    """The ``[environment]`` table of task.toml and suite.toml (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = "base"
    """The built-in environment to start from: ``base`` (nothing) or ``clawgym``."""
    pip: list[str] = []
    """pip requirements added to the named environment's (``name==version``; a project it
    already has is replaced by this one)."""
    python_alias: bool | None = None
    """Provide a ``python`` command; omitted: as the named environment does."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        builtin_env(v)
        return v

    @field_validator("pip")
    @classmethod
    def _requirements(cls, v: list[str]) -> list[str]:
        return pip_requirements(v)

    def resolve(self) -> TaskEnv:
        """The environment this table describes."""
        base = builtin_env(self.name)
        extra = {requirement_project(r): r for r in self.pip}
        pip = [r for r in base.pip if requirement_project(r) not in extra] + list(extra.values())
        alias = base.python_alias if self.python_alias is None else self.python_alias
        return TaskEnv(name=self.name, python_alias=alias, pip=pip)


def environment_table(env: TaskEnv) -> dict[str, Any]:
    """The ``[environment]`` table that resolves to ``env`` (for writing task.toml).

    ``env.name`` must be a built-in; the table lists only what differs from it. A built-in
    package ``env`` lacks cannot be expressed and raises ValueError."""
    base = builtin_env(env.name)
    have = {requirement_project(r): r for r in env.pip}
    missing = [r for r in base.pip if requirement_project(r) not in have]
    if missing:
        raise ValueError(
            f"environment {env.name!r} without {', '.join(missing)} cannot be written as a table"
        )
    extra = [r for r in env.pip if r not in base.pip]
    table: dict[str, Any] = {"name": env.name}
    if extra:
        table["pip"] = extra
    if env.python_alias != base.python_alias:
        table["python_alias"] = env.python_alias
    return table
