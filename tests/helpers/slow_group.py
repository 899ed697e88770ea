"""Under pytest-xdist (``pytest -n N --dist loadgroup``, the README's test command) every
``slow`` test runs on one worker, one after another, while the quicker tiers spread over the
workers: two learning runs, multi-rank steps or demos never share the cores.

pytest-xdist's own ``xdist_group`` mark cannot carry this: it passes the group from the worker
that collects to the scheduler that distributes by rewriting each test's node id, which pytest
9.2's structured node ids ignore (the tests then spread as if unmarked, silently). Here each
worker writes the node ids of its ``slow`` tests to a file the controller named for it
(``workerinput``), and the controller's scheduler — xdist's group scheduler, which sends one
group to one worker and orders the largest group first — reads them as one group. Only public
xdist hooks are used; without xdist the hooks are never called.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.tiers import tiers_of

SLOW_GROUP = "slow"
_FOLDER = pytest.StashKey[Path]()
_INPUT = "harnessrl_slow_ids"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller: tell each worker where to write its slow tests' ids."""
    config = node.config
    if _FOLDER not in config.stash:
        config.stash[_FOLDER] = Path(tempfile.mkdtemp(prefix="hrl-slow-ids-"))
    node.workerinput[_INPUT] = str(config.stash[_FOLDER] / f"{node.gateway.id}.json")


@pytest.hookimpl(trylast=True)  # after -m deselected: the ids the worker reports
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = getattr(config, "workerinput", {}).get(_INPUT)
    if path:
        slow = [item.nodeid for item in items if tiers_of(item) == ["slow"]]
        Path(path).write_text(json.dumps(slow))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _FOLDER in config.stash:
        shutil.rmtree(config.stash[_FOLDER], ignore_errors=True)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup" or _FOLDER not in config.stash:
        return None
    from xdist.scheduler import LoadGroupScheduling

    folder = config.stash[_FOLDER]

    class SlowGroupScheduling(LoadGroupScheduling):
        """xdist's group scheduler, with every ``slow`` test in the group `SLOW_GROUP`."""

        _slow: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._slow is None:  # called once every worker has collected (and written)
                self._slow = set()
                for f in folder.glob("*.json"):
                    self._slow.update(json.loads(f.read_text()))
            return SLOW_GROUP if nodeid in self._slow else super()._split_scope(nodeid)

    return SlowGroupScheduling(config, log)
