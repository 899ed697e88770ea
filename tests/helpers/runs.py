"""A small `harnessrl run` file (toy suite, reference harness, tiny model, PPO) for the tests
that run the whole system; ``RUN_FILE.format(steps=..., sandboxes=...)``."""

RUN_FILE = """
[run]
name = "e2e"
steps = {steps}
actors = 2
dashboard = false
status_interval_s = 5
scrape_interval_s = 1
rollup_interval_s = 5
plot_interval_s = 20
drain_timeout_s = 90
stop_timeout_s = 30

[engine]
model = "tiny"
max_batch_size = 8

[actor]
model = "tiny"
concurrency = 2
max_turns = 2
max_new_tokens = 32
harness_timeout_s = 120
install_harnesses = false
shutdown_grace_s = 5
sandbox_root = "{sandboxes}"

[assembler]

[learner]
model = "tiny"
algo = "ppo"
group_size = 2
batch_groups = 1
max_staleness = 1

[learner.ds]
lr = 1e-4

[learner.feeder]
suites = ["toy"]
harnesses = ["reference"]

[weights_sync]
"""
