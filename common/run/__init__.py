"""Orchestration on one machine: ``harnessrl run`` and ``harnessrl demo``, their supervisor,
dashboard and plots.

Where each process of a run lives (each is started here by its command line, exactly as a user
would start it on its own machine, never imported):

* ``harnessrl nats``: the embedded nats-server (``harnessrl.common.natsd``);
* ``harnessrl engine``: the embedded engine, torch or the scripted teacher (``proxy/engine/``),
  and ``harnessrl weights-sync``, its updater (``proxy/``);
* ``harnessrl actor``: sandboxes, harnesses, proxy and verifiers (``actors/``); ``harnessrl eval``
  runs the same rollouts without training (``harnessrl.actors.eval_cmd``);
* ``harnessrl assembler`` and ``harnessrl learner`` (with its feeder): ``learner/``.

Modules: ``run`` (the ``harnessrl run`` command), ``plan`` (the run file resolved, the run
folder, every child's command line), ``supervisor`` (children by PID: restarts, stops),
``dashboard`` (what the run shows and records), ``plot``, ``config`` (``RunConfig``, the
``[run]`` table) and ``demo``. The on-disk formats they read (weights folders, checkpoints,
metrics lines) are ``harnessrl.common.layout``'s.

This package imports nothing above ``common``: a command's config model is resolved by name
through the CLI face (``harnessrl.common.cli.command_config``).
"""
