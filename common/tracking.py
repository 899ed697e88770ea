"""Experiment tracking: what the learner writes to ``metrics.jsonl``, also to Weights & Biases
and/or TensorBoard when asked for (``--wandb [PROJECT]``, ``--tensorboard DIR`` on
``harnessrl learner``, ``run`` and ``demo``)::

    tracker = open_tracker(cfg.track, name=cfg.run, config={...}, folder=run_dir)
    tracker.line(step_line)       # every metrics.jsonl line, as scalars at its version
    tracker.table("held_out", columns, rows)
    tracker.close()

What must stay true:

* **Nothing changes when neither is asked for.** `open_tracker` then returns `NO_TRACKER`,
  and neither ``wandb`` nor ``tensorboard`` is ever imported.
* **The same numbers as ``metrics.jsonl``.** `scalars` flattens a line's JSON object: every
  number under its path (``reward_mean``, ``metrics/loss/total``, ``eval/toy/reference/mean``;
  a commit line's under ``commit/``), nothing else (no rollout ids, no text). Each is logged
  against the line's ``version``: W&B plots every key over a ``version`` axis (a resumed
  learner may go back to its committed version), TensorBoard uses it as the step. The eval
  entries of step lines also accumulate into an ``eval/table`` (version, suite, harness,
  mean, n), logged again whenever it grows.
* **The config is the run's.** The learner's resolved config, and with ``track.config_file``
  (``harnessrl run`` passes its run file) every table of that file.
* **A tracker never takes the learner down.** A failing backend is logged once and dropped;
  the learner goes on with ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from harnessrl.common.aio import StartupError
from harnessrl.common.config import HrlModel
from harnessrl.common.layout import MetricsLine, StepLine, line_object

log = logging.getLogger("harnessrl.tracking")

EVAL_COLUMNS = ["version", "suite", "harness", "mean", "n"]
DEFAULT_PROJECT = "harnessrl"


class TrackConfig(HrlModel):
    """Where the learner's metrics go besides ``metrics.jsonl`` (nothing more by default)."""

    wandb: str = ""
    """Weights & Biases project to log to (``pip install harnessrl[track]``); empty: none."""
    wandb_mode: Literal["online", "offline"] = "online"
    """``offline`` keeps the W&B run on disk (``<wandb_dir>/wandb/offline-run-*``) for
    ``wandb sync`` later: no account or network needed while training."""
    wandb_dir: str = ""
    """Folder W&B writes its files under; empty: the learner's run folder."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty: the account's default."""
    wandb_group: str = ""
    """W&B group of the run (the demo groups its phases under its name); empty: none."""
    tensorboard: str = ""
    """Folder of TensorBoard event files (``tensorboard --logdir DIR``); empty: none."""
    config_file: str = ""
    """A TOML file whose tables are logged as the run's config beside the learner's own
    (``harnessrl run`` passes its run file); empty: the learner's config alone."""

    @property
    def enabled(self) -> bool:
        return bool(self.wandb or self.tensorboard)


# ---------------------------------------------------------------------------------------------
# what is logged
# ---------------------------------------------------------------------------------------------


def scalars(line: MetricsLine) -> dict[str, float]:
    """Every number of ``line``'s JSON object by its ``/``-joined path (a commit line's under
    ``commit/``); booleans, text, ids and the line's ``time`` and ``version`` are left out."""
    obj = line_object(line)
    prefix = "" if line.event == "step" else f"{line.event}/"
    out: dict[str, float] = {}

    def walk(path: str, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, sub in v.items():
                walk(f"{path}/{k}" if path else str(k), sub)
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[prefix + path] = float(v)

    for key, value in obj.items():
        if key not in ("time", "event", "version"):
            walk(key, value)
    return out


def eval_rows(line: MetricsLine) -> list[list[Any]]:
    """The eval table rows of a step line (none for other lines)."""
    if not isinstance(line, StepLine) or not line.eval:
        return []
    rows = []
    for key, v in sorted(line.eval.items()):
        suite, _, harness = key.rpartition("/")
        rows.append([line.version, suite, harness, v.get("mean", 0.0), int(v.get("n", 0))])
    return rows


def run_config(own: dict[str, Any], config_file: str) -> dict[str, Any]:
    """The config to log: ``own`` (the process's resolved config) and the tables of
    ``config_file`` under ``run_file``."""
    if not config_file:
        return own
    try:
        tables = tomllib.loads(Path(config_file).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        log.warning("run file %s not logged: %s", config_file, e)
        return own
    return {**own, "run_file": tables}


# ---------------------------------------------------------------------------------------------
# trackers
# ---------------------------------------------------------------------------------------------


class Tracker:
    """Logs nothing (what `open_tracker` returns when no backend is asked for)."""

    def line(self, line: MetricsLine) -> None:
        """Log one ``metrics.jsonl`` line."""

    def table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Log (or replace) the table ``name``."""

    def close(self) -> None:
        """Flush and finish."""


NO_TRACKER = Tracker()


class _Backends(Tracker):
    """Fans every call out to the backends; one that fails is logged and dropped."""

    def __init__(self, backends: Iterable[Any]) -> None:
        self.backends = list(backends)
        self.eval: list[list[Any]] = []

    def line(self, line: MetricsLine) -> None:
        values = scalars(line)
        rows = eval_rows(line)
        self._each("log", values, line.version if hasattr(line, "version") else 0)
        if rows:
            self.eval += rows
            self.table("eval/table", EVAL_COLUMNS, self.eval)

    def table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self._each("table", name, columns, rows)

    def close(self) -> None:
        self._each("close")
        self.backends = []

    def _each(self, method: str, *args: Any) -> None:
        for b in list(self.backends):
            try:
                getattr(b, method)(*args)
            except Exception as e:  # tracking must never end a run
                log.error("%s tracking failed (%r); it is off from now on", b.name, e)
                self.backends.remove(b)


class _Wandb:
    name = "W&B"

    def __init__(self, cfg: TrackConfig, name: str, config: dict[str, Any], folder: Path):
        import wandb

        self.wandb = wandb
        files = Path(cfg.wandb_dir) if cfg.wandb_dir else folder
        files.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.wandb,
            entity=cfg.wandb_entity or None,
            group=cfg.wandb_group or None,
            name=name,
            id=_run_id(folder, name),
            resume="allow",  # a resumed learner goes on with its W&B run
            mode=cfg.wandb_mode,
            dir=str(files),
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("version")
        self.run.define_metric("*", step_metric="version")

    def log(self, values: dict[str, float], version: int) -> None:
        self.run.log({**values, "version": version})

    def table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=[list(r) for r in rows])})

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # only then has W&B's service written out the whole run


def _run_id(folder: Path, name: str) -> str:
    """The W&B run id of the run folder ``folder`` (made once, kept in its ``wandb-run-id``)."""
    import uuid

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "wandb-run-id"
    if path.exists():
        return path.read_text().strip()
    rid = f"{name}-{uuid.uuid4().hex[:8]}"
    path.write_text(rid + "\n")
    return rid


class _TensorBoard:
    """Event files written with the ``tensorboard`` package alone (no TensorFlow, no torch)."""

    name = "TensorBoard"

    def __init__(self, folder: str, config: dict[str, Any]) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(folder).mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(folder)
        self._text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)

    def log(self, values: dict[str, float], version: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._event(summary, version)

    def table(self, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
        body = "".join("| " + " | ".join(str(c) for c in r) + " |\n" for r in rows)
        self._text(name, head + body, int(rows[-1][0]) if rows and columns[0] == "version" else 0)

    def close(self) -> None:
        self.writer.close()

    def _text(self, tag: str, text: str, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        tensor = TensorProto(
            dtype="DT_STRING",
            string_val=[text.encode()],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        self._event(Summary(value=[Summary.Value(tag=tag, metadata=meta, tensor=tensor)]), step)

    def _event(self, summary: Any, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()


def open_tracker(cfg: TrackConfig, *, name: str, config: dict[str, Any], folder: Path) -> Tracker:
    """The trackers ``cfg`` asks for (`NO_TRACKER` for none: nothing is imported).
    ``name``: the run's name; ``config``: the process's resolved config; ``folder``: where
    W&B's files go unless ``wandb_dir`` says (and where the W&B run id is kept, so a resumed
    learner goes on with its W&B run). A backend that cannot start is an error (a
    ``StartupError`` naming the extra to install, or the backend's own)."""
    if not cfg.enabled:
        return NO_TRACKER
    config = run_config(config, cfg.config_file)
    backends: list[Any] = []
    try:
        if cfg.wandb:
            backends.append(_Wandb(cfg, name, config, folder))
        if cfg.tensorboard:
            backends.append(_TensorBoard(cfg.tensorboard, config))
    except ImportError as e:
        for b in backends:
            b.close()
        raise StartupError(
            f"experiment tracking needs {e.name}: pip install 'harnessrl[track]'"
        ) from e
    return _Backends(backends)


def add_arguments(parser: argparse.ArgumentParser, dest: str = "cfg__track__") -> None:
    """``--wandb [PROJECT]`` and ``--tensorboard DIR`` (``dest`` + ``wandb``/``tensorboard``)."""
    parser.add_argument(
        "--wandb",
        dest=dest + "wandb",
        nargs="?",
        const=DEFAULT_PROJECT,
        metavar="PROJECT",
        help=f"log the learner's metrics, config and eval table to Weights & Biases project "
        f"PROJECT (default {DEFAULT_PROJECT!r}; needs harnessrl[track])",
    )
    parser.add_argument(
        "--tensorboard",
        dest=dest + "tensorboard",
        metavar="DIR",
        help="write the same to TensorBoard event files in DIR (needs harnessrl[track])",
    )
