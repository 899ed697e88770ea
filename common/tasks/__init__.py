"""Tasks: loading, listing and hashing (running and verifying them lives in ``actors/``).

Public API::

    Task, TaskError                    # the model every format loads into
    list_suites() -> {name: dir}       # built-in + $HRL_SUITE_PATH suites
    list_tasks(suite, split=None)      # suite name or directory
    load_task(suite, task_id)          # task_id may also be a folder path
    load_task_path(path)               # any supported folder format
    resolve_tasks(spec) / resolve_task(spec)   # "SUITE", "SUITE/ID" or a path
    import_any(src, out_dir, split=None, force=False) -> ImportReport
                                       # ClawGym JSONL / folders, Harbor -> native folders
    hash_paths(...)                    # the content hash behind Task.task_hash
    TaskEnv, BUILTIN_ENVS              # task environments (python alias, pip packages)
"""

from harnessrl.common.tasks.environments import BUILTIN_ENVS
from harnessrl.common.tasks.formats import (
    ImportReport,
    detect_format,
    import_any,
    import_jsonl,
    is_task_dir,
    load_folder,
    write_native,
)
from harnessrl.common.tasks.model import (
    CLAWGYM_MOUNT,
    DEFAULT_MOUNT,
    RUBRIC_SCORES,
    Task,
    TaskEnv,
    TaskError,
    hash_paths,
)
from harnessrl.common.tasks.registry import (
    BUILTIN_SUITES,
    list_suites,
    list_tasks,
    load_task,
    load_task_path,
    resolve_task,
    resolve_tasks,
    suite_dir,
)

__all__ = [
    "BUILTIN_ENVS",
    "BUILTIN_SUITES",
    "CLAWGYM_MOUNT",
    "DEFAULT_MOUNT",
    "ImportReport",
    "RUBRIC_SCORES",
    "Task",
    "TaskEnv",
    "TaskError",
    "detect_format",
    "hash_paths",
    "import_any",
    "import_jsonl",
    "is_task_dir",
    "list_suites",
    "list_tasks",
    "load_folder",
    "load_task",
    "load_task_path",
    "resolve_task",
    "resolve_tasks",
    "suite_dir",
    "write_native",
]
