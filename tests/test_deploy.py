"""The deployment files under ``deploy/``, checked without starting a stack: the compose files
(both variants, as ``docker-compose`` itself parses them; every harnessrl command in them, the
NATS cluster nodes included, as ``harnessrl`` itself parses it), the Kubernetes manifests
(against the Kubernetes OpenAPI schemas; the KEDA ScaledObject against KEDA's CRD models), the
NATS chart values (generated from the permission table), the images' files and entrypoint. The
stack itself comes up in ``tests/test_deploy_stack.py``; the cluster that ``harnessrl nats``
forms is tested in ``tests/test_nats_cluster.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harnessrl.common import natsauth
from harnessrl.common.files import free_port
from tests.helpers.dashboards import dashboards_module
from tests.helpers.wait import wait_until

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "k8s" / "nats_chart.py"


def _load_chart_module():
    """``deploy/k8s/nats_chart.py`` as a module (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location("hrl_nats_chart", CHART)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


nats_chart = _load_chart_module()


def run_chart_tool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHART), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


# ---------------------------------------------------------------------------------------------
# the NATS cluster on Kubernetes (the official chart)
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_chart_streams_command_fails_with_one_line_when_the_cluster_is_unreachable(
    tmp_path: Path,
) -> None:
    """``nats_chart.py streams`` against nothing: exit 1 and one line, no traceback."""
    creds = tmp_path / "admin.cred"
    creds.write_text("admin:x\n")
    creds.chmod(0o600)
    urls = f"nats://127.0.0.1:{free_port()},nats://127.0.0.1:{free_port()}"
    res = run_chart_tool("streams", "--nats", urls, "--creds", str(creds), "--wait", "1")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("nats_chart.py streams: ")
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.integration
def test_chart_auth_folder_is_the_one_harnessrl_nats_makes(tmp_path: Path) -> None:
    """``nats_chart.py auth`` makes what the Secrets are made of: one credential per role, the
    route credential, the CA and a certificate for the pods' names (usable by routes: server
    and client authentication); a second call keeps every file."""
    out = tmp_path / "auth"
    hosts = ["*.nats-headless.harnessrl.svc", "nats.harnessrl.svc"]
    argv = ("auth", str(out), "--runs", "fleet", "--tls-hosts", *hosts)
    res = run_chart_tool(*argv)
    assert res.returncode == 0, res.stderr
    files = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for role in (*natsauth.ROLES, natsauth.ROUTE_USER):
        assert f"{role}.cred" in files
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-text", "-in", str(out / "tls" / "server.pem")],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert all(f"DNS:{h}" in text for h in hosts), text
    assert "TLS Web Server Authentication, TLS Web Client Authentication" in text, text
    assert run_chart_tool(*argv).returncode == 0
    again = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert again == files


@pytest.mark.integration
def test_nats_chart_values_are_generated_from_the_permission_table() -> None:
    """``deploy/k8s/nats-values.yaml`` is exactly what ``nats_chart.py helm-values`` prints for
    its run: 3 nodes, JetStream on file storage, TLS for clients and routes, and every role with
    the permissions of ``harnessrl.common.natsauth`` (so a change of the table that is not regenerated
    fails here)."""
    path = DEPLOY / "k8s" / "nats-values.yaml"
    values = yaml.safe_load(path.read_text())
    runs = ["fleet"]
    assert values == nats_chart.helm_values(runs)
    cfg = values["config"]
    assert cfg["cluster"]["enabled"] and cfg["cluster"]["replicas"] == 3
    assert cfg["cluster"]["tls"]["enabled"] and cfg["cluster"]["tls"]["ca"] == "ca.crt"
    assert cfg["jetstream"]["fileStore"]["enabled"] and cfg["jetstream"]["enabled"]
    users = {u["user"]: u for u in cfg["merge"]["authorization"]["users"]}
    actors = {f"actor-{i}" for i in range(nats_chart.ACTORS)}  # one user per actor, no shared one
    assert set(users) == set(natsauth.ROLES) | actors
    for role, user in users.items():
        assert user["permissions"] == natsauth.role_permissions(role, runs)
        env = nats_chart.password_env(role)
        assert re.fullmatch(r"[A-Z0-9_]+", env) and user["password"] == f"<< ${env} >>"
        assert values["container"]["env"][env]["valueFrom"]["secretKeyRef"]["key"] == role
    own = users["actor-3"]["permissions"]["publish"]["allow"]
    assert "hrl.fleet.calls.actor-3.>" in own and "hrl.fleet.calls.>" not in own
    res = run_chart_tool("helm-values", "--runs", *runs)
    assert res.returncode == 0, res.stderr
    assert res.stdout == path.read_text()


# ---------------------------------------------------------------------------------------------
# compose
# ---------------------------------------------------------------------------------------------

COMPOSE = DEPLOY / "compose"


def compose_config(*files: str, profiles: tuple[str, ...] = ()) -> dict:
    """The merged, interpolated config that ``docker-compose`` itself makes of ``files``."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed (apt-get install docker-compose)")
    argv = [exe]
    for f in files:
        argv += ["-f", str(COMPOSE / f)]
    for p in profiles:
        argv += ["--profile", p]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HRL_")}
    res = subprocess.run([*argv, "config"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def harnessrl_config(argv: list[str], capsys: pytest.CaptureFixture) -> dict:
    """The config ``harnessrl`` resolves from a command line of the compose files (its own
    parser and validation, ``--print-config``); the stack's run file stands in for the
    container's."""
    import tomllib

    from harnessrl.common.cli import main

    argv = [a.replace("/etc/hrl/run.toml", str(COMPOSE / "run.toml")) for a in argv]
    capsys.readouterr()
    rc = main([*argv, "--print-config"])
    out, err = capsys.readouterr()
    assert rc == 0, f"harnessrl {' '.join(argv)}: {err}"
    return tomllib.loads(out)


@pytest.mark.integration
def test_compose_cpu_stack_config(capsys: pytest.CaptureFixture) -> None:
    """The CPU stack: three `harnessrl nats` cluster nodes sharing one auth folder and keeping
    the run's streams at R3, every harnessrl service on the host network with its role's
    credential and all three nodes' URLs (every command as harnessrl parses it), actors
    scalable (no fixed name or port), Prometheus reading deploy/monitoring, Grafana only in its
    profile, provisioned with deploy/monitoring's dashboards."""
    from harnessrl.common.config import nats_urls

    cfg = compose_config("docker-compose.yml")
    services = cfg["services"]
    assert services.pop("grafana")["profiles"] == ["grafana"]  # not started by default
    assert {"init", "nats-0", "nats-1", "nats-2", "engine", "weights-sync"} <= set(services)
    assert {"assembler", "learner", "actor", "prometheus"} <= set(services)
    for s in services.values():
        assert s["network_mode"] == "host"
    nodes = []
    for i in range(3):
        s = services[f"nats-{i}"]
        argv = s["entrypoint"] + s["command"]
        assert argv[:2] == ["harnessrl", "nats"]
        node = harnessrl_config(argv[1:], capsys)
        assert node["auth_dir"] == "/conf/auth" and node["store_dir"] == "/data"
        assert any(v.startswith("nats-conf:/conf") for v in s["volumes"])
        assert {"cluster_name", "cluster_port", "routes", "server_name"} <= set(node)
        nodes.append(node)
    assert {n["server_name"] for n in nodes} == {"nats-0", "nats-1", "nats-2"}
    assert {n["stream_replicas"] for n in nodes} == {3}
    assert all(n["routes"] == nodes[0]["routes"] for n in nodes)  # the same list everywhere
    assert sorted(f"127.0.0.1:{n['cluster_port']}" for n in nodes) == sorted(nodes[0]["routes"])
    node_urls = sorted(f"tls://127.0.0.1:{n['port']}" for n in nodes)
    roles = {
        "weights-sync": "/conf/auth/weights_sync.cred",
        "assembler": "/conf/auth/assembler.cred",
        "learner": "/conf/auth/learner.cred",
        "actor": "/conf/actors",  # the pool of per-actor credentials: each claims one
    }
    for name, creds in roles.items():
        cmd = services[name]["command"]
        assert cmd[0] == f"hrl-{name}" and cmd[1:3] == ["harnessrl", name]
        proc = harnessrl_config(cmd[2:], capsys)
        proc = proc.get(name.replace("-", "_"), proc)
        assert proc["nats_creds"] == creds
        conf = "/conf" if name == "actor" else "/conf/auth/tls"
        assert proc["nats_ca"] == f"{conf}/ca.pem"
        assert sorted(nats_urls(proc["nats"])) == node_urls, name
        assert "--config=/etc/hrl/run.toml" in cmd
        assert set(services[name]["depends_on"]) >= {"nats-0", "nats-1", "nats-2"}
    # weights-sync writes each version where the engine it updates can load it from
    work = next(a for a in services["weights-sync"]["command"] if a.startswith("--work-dir="))
    ws_vols = {v.split(":")[1]: v.split(":")[0] for v in services["weights-sync"]["volumes"]}
    engine_vols = {v.split(":")[1]: v.split(":")[0] for v in services["engine"]["volumes"]}
    shared = [p for p in ws_vols if work.split("=", 1)[1].startswith(p + "/")]
    assert shared and engine_vols.get(shared[0]) == ws_vols[shared[0]]
    actor = services["actor"]
    assert "container_name" not in actor and "ports" not in actor
    # actors see only their own volume (their credentials, the CA, the engine key), which the
    # init fills from the cluster's auth folder; the nodes make as many actor credentials
    assert [v for v in actor["volumes"] if v.endswith(":/conf:ro")] == ["actor-conf:/conf:ro"]
    init = " ".join(services["init"]["command"])
    assert "cp -p /conf/auth/actors/*.cred /actor-conf/actors/" in init
    assert "actor-conf:/actor-conf:rw" in services["init"]["volumes"]
    actors = {n["actors"] for n in nodes}
    assert actors == {int(services["init"]["environment"]["HRL_ACTORS"])}
    assert actor["environment"]["HRL_PASS_NAME"] == "1"
    assert set(actor["cap_add"]) == {"SYS_ADMIN", "NET_ADMIN"}
    prom = services["prometheus"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"]}
    for name in ("prometheus.yml", "alerts.yml"):
        assert Path(mounts[f"/etc/prometheus/hrl/{name}"]) == DEPLOY / "monitoring" / name
        assert (DEPLOY / "monitoring" / name).is_file()
    assert any(v.startswith("targets:/etc/prometheus/hrl/targets") for v in prom["volumes"])


@pytest.mark.integration
def test_grafana_provisioning_points_at_the_generated_dashboards() -> None:
    """Grafana (profile ``grafana``) gets deploy/monitoring's generated dashboards at the path
    its file provider reads, and a Prometheus datasource at the stack's Prometheus: every
    dashboard file there is one dashboards.py writes, and each asks for a Prometheus
    datasource the provisioned one satisfies."""
    grafana = compose_config("docker-compose.yml", profiles=("grafana",))["services"]["grafana"]
    mounts = {v.split(":")[1]: Path(v.split(":")[0]) for v in grafana["volumes"]}
    prov = mounts["/etc/grafana/provisioning"]
    [provider] = yaml.safe_load((prov / "dashboards" / "harnessrl.yml").read_text())["providers"]
    dash_dir = mounts[provider["options"]["path"]]
    assert dash_dir == DEPLOY / "monitoring" / "dashboards"
    files = sorted(dash_dir.glob("*.json"))
    assert [f.name for f in files] == sorted(dashboards_module().generate())
    [ds] = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["type"] == "prometheus"
    port = grafana["environment"]["HRL_PROMETHEUS_URL"].rsplit(":", 1)[1]
    prom = compose_config("docker-compose.yml")["services"]["prometheus"]
    assert f"--web.listen-address=127.0.0.1:{port}" in prom["command"]
    for f in files:
        ds_vars = [v for v in json.loads(f.read_text())["templating"]["list"]
                   if v["type"] == "datasource"]  # fmt: skip
        assert [v["query"] for v in ds_vars] == ["prometheus"], f.name


@pytest.mark.integration
def test_compose_gpu_variant_config() -> None:
    """The GPU override: SGLang engine and learner on their own GPUs from the GPU image, the
    GPU run file, weights-sync off (NCCL broadcast), nothing depending on a disabled service."""
    cfg = compose_config("docker-compose.yml", "docker-compose.gpu.yml")
    services = cfg["services"]
    assert services.pop("weights-sync")["profiles"] == ["never"]
    services.pop("grafana")
    for name, gpu in (("engine", "0"), ("learner", "1")):
        s = services[name]
        assert s["image"].startswith("harnessrl-gpu:")
        [dev] = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == [gpu] and dev["capabilities"] == ["gpu"]
    assert "sglang.launch_server" in " ".join(services["engine"]["command"])
    for s in services.values():
        assert not set(s.get("depends_on", {})) - set(services), s
        runs = [v for v in s.get("volumes", []) if v.endswith(":/etc/hrl/run.toml:ro")]
        assert all(v.startswith(str(COMPOSE / "run-gpu.toml")) for v in runs)


RUN_TABLES = {
    "actor": "harnessrl.actors.config:ActorConfig",
    "assembler": "harnessrl.learner.config:AssemblerConfig",
    "learner": "harnessrl.learner.config:LearnerConfig",
    "weights_sync": "harnessrl.proxy.config:WeightSyncConfig",
}


def _run_files() -> dict[str, str]:
    k8s = yaml.safe_load((DEPLOY / "k8s" / "run.yaml").read_text())
    return {
        "compose/run.toml": (COMPOSE / "run.toml").read_text(),
        "compose/run-gpu.toml": (COMPOSE / "run-gpu.toml").read_text(),
        "k8s/run.yaml": k8s["data"]["run.toml"],
    }


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(_run_files()))
def test_run_files_are_valid_process_configs(name: str) -> None:
    """Every table of the deploy run files is a valid config of its process (the same check
    ``harnessrl run`` makes before it starts anything)."""
    import importlib
    import tomllib

    from harnessrl.common.config import load_config

    tables = tomllib.loads(_run_files()[name])
    assert set(tables) <= set(RUN_TABLES), name
    for table, ref in RUN_TABLES.items():
        if table not in tables:
            continue
        mod, cls = ref.split(":")
        load_config(getattr(importlib.import_module(mod), cls), None, _flat(tables[table]))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------

K8S_VERSION = "1.33.0"
"""The Kubernetes API the manifests are validated against (hostUsers and procMount: 1.33+)."""


def k8s_documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "nats-values.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


@pytest.mark.unit
def test_kubernetes_manifests_validate_against_the_openapi_schemas() -> None:
    """Every manifest validates strictly (unknown fields are errors) against the Kubernetes
    schemas of ``kubernetes-validate``; custom resources against their CRD's models."""
    import kubernetes_validate

    kinds = set()
    for name, doc in k8s_documents():
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("keda.sh/"):
            validate_keda(doc)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']}: {e.message} at {e.path}")
    assert {"Namespace", "ConfigMap", "StatefulSet", "Deployment", "Service"} <= kinds
    assert {"NetworkPolicy", "ScaledObject"} <= kinds


def validate_keda(doc: dict) -> None:
    """A KEDA resource against the models generated from KEDA's CRDs: it must parse, and
    nothing may be dropped as unknown on the way (the models ignore extra fields)."""
    from cloudcoil.models.keda import v1alpha1

    model = getattr(v1alpha1, doc["kind"]).model_validate(doc)
    back = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert _strip_empty(back) == _strip_empty(doc)


def _strip_empty(v):
    if isinstance(v, dict):
        return {k: _strip_empty(x) for k, x in v.items() if x not in (None, {}, [])}
    if isinstance(v, list):
        return [_strip_empty(x) for x in v]
    return v


@pytest.mark.unit
def test_kubernetes_gpu_requests_hardening_and_scaling() -> None:
    """Engines and the learner request GPUs; the actor pod is hardened (own user namespace,
    non-root, no capabilities, read-only root, no token) and scaled by KEDA on the actors'
    consumer of the run's TASKS stream; every pod Prometheus scrapes is labelled for a job
    the scrape config keeps."""
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in k8s_documents()}
    for name in ("engine", "learner"):
        [c] = docs[("StatefulSet", name)]["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    sts = docs[("StatefulSet", "actor")]["spec"]
    pod = sts["template"]["spec"]
    [c] = pod["containers"]
    assert pod["hostUsers"] is False and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    # each pod (actor-<i>: stable names) gets its own NATS credential, never the others'
    assert docs[("Service", sts["serviceName"])]["spec"]["clusterIP"] == "None"
    assert "--nats-creds=/etc/hrl/nats-own/actor.cred" in c["args"]
    [init] = pod["initContainers"]
    assert '"/all/$POD_NAME.cred"' in init["command"][-1]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"] for m in c["volumeMounts"]}
    assert volumes["nats-actors"]["secret"]["secretName"] == "hrl-nats-actors"
    assert "nats-actors" not in mounts and "nats-own" in mounts
    assert {m["name"] for m in init["volumeMounts"]} == {"nats-actors", "nats-own"}
    assert [i["key"] for i in volumes["nats"]["secret"]["items"]] == ["ca.pem"]
    so = docs[("ScaledObject", "actor")]["spec"]
    assert so["scaleTargetRef"]["name"] == "actor" and so["scaleTargetRef"]["kind"] == "StatefulSet"
    assert so["maxReplicaCount"] <= nats_chart.ACTORS  # a credential for every pod
    [trigger] = so["triggers"]
    assert trigger["type"] == "nats-jetstream"
    assert trigger["metadata"]["consumer"] == natsauth.ACTOR_DURABLE
    assert trigger["metadata"]["stream"] == "HRL_fleet_TASKS"
    jobs = set()
    for (kind, _), d in docs.items():
        if kind in ("Deployment", "StatefulSet"):
            meta = d["spec"]["template"]["metadata"]
            jobs.add(meta["labels"]["hrl.job"])
            port = int(meta["annotations"]["hrl.metrics/port"])
            ports = [p["containerPort"] for c in d["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])]  # fmt: skip
            assert port in ports, d["metadata"]["name"]
    assert jobs == {"hrl-engine", "hrl-learner", "hrl-assembler", "hrl-actor"}


@pytest.mark.integration
def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """The compose stack's scrape config (deploy/monitoring/prometheus.yml) passes ``promtool
    check config`` with its rule files."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (apt-get install prometheus)")
    mon = tmp_path / "monitoring"
    shutil.copytree(DEPLOY / "monitoring", mon)
    res = subprocess.run([promtool, "check", "config", str(mon / "prometheus.yml")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.unit
def test_kubernetes_scrape_config_keeps_the_monitoring_jobs_and_labels() -> None:
    """The Kubernetes scrape config (Debian's promtool has no Kubernetes discovery to check it
    with): pod discovery in the fleet's namespace, relabelling that keeps hrl-* pods and sets
    the job, run and process labels the alert rules and dashboards read."""
    cm = yaml.safe_load((DEPLOY / "k8s" / "prometheus.yaml").read_text())
    cfg = yaml.safe_load(cm["data"]["prometheus.yml"])
    [job] = cfg["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["harnessrl"]}}]
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"__address__", "job", "run", "process"} <= targets
    for rule in job["relabel_configs"]:
        re.compile(rule.get("regex", "(.*)"))
        for src in rule["source_labels"]:
            assert src.startswith("__meta_kubernetes_pod_"), src
    keep = job["relabel_configs"][0]
    assert keep["action"] == "keep" and re.fullmatch(keep["regex"], "hrl-actor")


def _load_build_module():
    """``deploy/images/build.py`` as a module (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location("hrl_build", DEPLOY / "images" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.unit
def test_each_image_is_sent_only_its_part_of_the_build_context(tmp_path: Path) -> None:
    """The actor's context has no torch (``wheels/train``), cpu's has everything the legacy
    builder needs for the actor stage it passes through, Prometheus' only its binary."""
    import tarfile

    build = _load_build_module()
    ctx = tmp_path / "ctx"
    files = ["Dockerfile", "Dockerfile.prometheus", "prometheus", "deploy/images/entrypoint.sh"]
    files += ["wheels/core/numpy-1-py3-none-any.whl", "wheels/train/torch-1-py3-none-any.whl"]
    files += ["wheels/hrl/harnessrl-0-py3-none-any.whl", "harnesses/h/x", "envs/wheels-k/y"]
    for rel in files:
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / rel).write_text(rel)
    sent = {}
    for image in ("actor", "cpu", "prometheus"):
        build.write_context_tar(ctx, tmp_path / f"{image}.tar", image)
        with tarfile.open(tmp_path / f"{image}.tar") as tf:
            sent[image] = {os.path.normpath(m.name) for m in tf.getmembers() if m.isfile()}
    assert sent["prometheus"] == {"Dockerfile.prometheus", "prometheus"}
    assert sent["cpu"] == set(files) - {"prometheus"}
    assert sent["actor"] == set(files) - {"prometheus", "wheels/train/torch-1-py3-none-any.whl"}


# ---------------------------------------------------------------------------------------------
# hrl-entrypoint
# ---------------------------------------------------------------------------------------------

ENTRYPOINT = DEPLOY / "images" / "entrypoint.sh"


@pytest.mark.integration
def test_entrypoint_lists_the_process_while_it_runs_and_passes_its_status(tmp_path: Path) -> None:
    """With a scrape dir, hrl-entrypoint gives the command a free --metrics-port and --name,
    lists it as a file_sd target while it runs, removes the target when it ends and exits
    with the command's status; a SIGTERM reaches the command."""
    scrape = tmp_path / "targets"
    out = tmp_path / "args"
    script = tmp_path / "cmd.sh"
    script.write_text(f'#!/bin/sh\ntrap "exit 7" TERM\necho "$@" > {out}\nsleep 60 & wait\n')
    script.chmod(0o755)
    env = {**os.environ, "HRL_SCRAPE_DIR": str(scrape), "HRL_RUN": "r1", "HRL_PASS_NAME": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    proc = subprocess.Popen(["sh", str(ENTRYPOINT), "hrl-actor", str(script), "--x"], env=env)
    try:
        listed = lambda: out.exists() and list(scrape.glob("*.json"))  # noqa: E731
        wait_until(listed, 60, "the command started and listed", proc=proc)
        [target] = scrape.glob("hrl-actor-actor-*.json")
        [group] = json.loads(target.read_text())
        args = out.read_text().split()
        assert args[0] == "--x" and args[1] == "--name" and args[3] == "--metrics-port"
        assert group["labels"] == {"run": "r1", "process": args[2]}
        assert group["targets"] == [f"127.0.0.1:{args[4]}"]
        assert target.name == f"hrl-actor-{args[2]}.json"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 7
        assert list(scrape.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.integration
def test_entrypoint_without_a_job_just_runs_the_command(tmp_path: Path) -> None:
    """No job (nats-server, one-shot tools): the command runs as it is, its status passed."""
    env = {**os.environ, "HRL_SCRAPE_DIR": str(tmp_path / "t")}
    res = subprocess.run(["sh", str(ENTRYPOINT), "sh", "-c", "echo $# $0; exit 3"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 3 and res.stdout.strip() == "0 sh"
    assert not (tmp_path / "t").exists()
