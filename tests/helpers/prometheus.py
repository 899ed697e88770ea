"""A real Prometheus for tests: a server on a free loopback port with its own TSDB folder,
loaded with deploy/monitoring's configuration and alert rules (short intervals, every alert's
``for`` at 0), and the small process helpers around it."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from harnessrl.common.files import free_port
from harnessrl.common.procs import popen_child
from tests.helpers.dashboards import MONITORING

SCRAPE_S = 2
"""The test Prometheus' scrape interval (seconds)."""


class Prometheus:
    """A Prometheus server on a free loopback port with its own TSDB folder; stopped by PID
    (and by PDEATHSIG should the test process die first)."""

    def __init__(self, config: Path, data: Path, log: Path) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with open(log, "wb") as f:  # the child keeps its own copy of the descriptor
            self.proc = popen_child(argv, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"prometheus did not start:\n{tail(log)}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def get(self, path: str, **params: Any) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:  # 400 bad_data: the body says why
            return json.loads(e.read())

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        return self.get("/api/v1/query", query=expr, **({"time": at} if at else {}))

    def value(self, expr: str) -> float:
        res = self.query(expr).get("data", {}).get("result", [])
        return float(res[0]["value"][1]) if res else float("nan")

    def stop(self) -> None:
        stop(self.proc, timeout=30)


def prometheus_config(tmp: Path, targets: Path) -> Path:
    """deploy/monitoring's prometheus.yml and alerts.yml as they are, with short intervals, the
    run's target files and every alert's ``for`` at 0 (the expressions are under test)."""
    cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    every = f"{SCRAPE_S}s"
    cfg["global"] = {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": "1s"}
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    (tmp / "alerts.yml").write_text(yaml.safe_dump(rules))
    cfg["rule_files"] = [str(tmp / "alerts.yml")]
    for job in cfg["scrape_configs"]:
        for sd in job["file_sd_configs"]:
            sd["files"] = [str(targets / Path(f).name) for f in sd["files"]]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def stop(proc: subprocess.Popen, timeout: float = 150) -> None:
    """SIGTERM (``harnessrl run`` stops its processes tier by tier), SIGKILL after
    ``timeout``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""
