"""deploy/monitoring/dashboards.py (a script beside the dashboards it writes) as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"


def dashboards_module() -> Any:
    """deploy/monitoring/dashboards.py, loaded from its file."""
    spec = importlib.util.spec_from_file_location("hrl_dashboards", MONITORING / "dashboards.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
