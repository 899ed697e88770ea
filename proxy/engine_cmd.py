"""``harnessrl engine``: serve a model over SGLang's native HTTP API until SIGTERM/SIGINT.

Prints ``engine ready: http://HOST:PORT (model PATH, weight_version V)`` on stdout once it
serves, so supervisors and tests can read the port (``--port 0`` picks a free one). torch is
imported only in ``main`` (``--help`` stays instant); ``spawn_engine`` starts it as a child
process without importing torch here.

``--kind teacher`` serves the scripted toy teacher instead (``harnessrl.proxy.engine.teacher``; no torch
model): ``harnessrl engine --kind teacher --suites toy [--suites toy-eval] --model TOKENIZER``,
with the same ready line (``engine ready: URL (teacher, ...)``) and the same clean stop.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time

from harnessrl.proxy.config import EngineConfig

CONFIG = EngineConfig

READY_RE = re.compile(r"^engine ready: (http://\S+) ")


def main(cfg: EngineConfig, args: argparse.Namespace | None = None) -> int:
    from harnessrl.common.aio import run, setup_logging

    setup_logging(cfg.log_level, "engine")
    if cfg.kind == "teacher":
        from harnessrl.proxy.engine.teacher import serve_teacher

        return int(run(serve_teacher(cfg)))
    from harnessrl.proxy.engine import serve

    return int(run(serve(cfg)))


def spawn_engine(
    flags: list[str], timeout: float = 120.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """Start ``python -m harnessrl.proxy.engine_cmd FLAGS`` as a child that dies with this process; wait
    for its ready line and return ``(process, url)``. The child's output keeps accumulating in
    ``process.output_lines``; stop it with ``process.terminate()`` (SIGTERM: clean exit 0)."""
    from harnessrl.common.procs import popen_child

    proc = popen_child(
        [sys.executable, "-m", "harnessrl.proxy.engine_cmd", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    lines: list[str] = []
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if not found and (mt := READY_RE.match(line)):
                found.append(mt.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("engine did not start:\n" + "".join(lines[-40:]))
        time.sleep(0.05)
    proc.output_lines = lines  # type: ignore[attr-defined]
    return proc, found[0]


if __name__ == "__main__":  # ``python -m harnessrl.proxy.engine_cmd`` is ``harnessrl engine``
    from harnessrl.common.cli import run_module

    run_module("engine")
