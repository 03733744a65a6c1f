"""The Helm chart, checked on its rendered manifests (``helm template``, no cluster).

Every values file in helm/ci is rendered and checked for what an operator relies on: probes
on ports that exist, one bridge pod per slot and never two, passwords only by Secret
reference, non-root containers with read-only root filesystems, values the schema must
refuse, and configuration files that the services' own pydantic settings accept.

helm comes from helm/ci/install-tools.sh (the project cache's bin folder) or PATH; the
tests skip, saying so, only when neither has it (outside CI; in CI that fails).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from prometheus_client import CollectorRegistry

from services.bridge.assemble.spool import SpoolStats
from services.bridge.metrics import BridgeMetrics
from services.bridge.settings import BridgeSettings
from services.cli import cli
from services.common.settings import ServiceSettings, load_settings
from services.failover.settings import FailoverSettings
from services.failover.watch import Metrics as FailoverMetrics
from slotbridge_dev.bootstrap import cache_dir
from spark_consumers.metrics import registry_for
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status, TableCounts, Upkeep

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "slotbridge"
CI_VALUES = sorted((REPO / "helm" / "ci").glob("*-values.yaml"))
ALL_VALUES = REPO / "helm" / "ci" / "all-values.yaml"
KUBE_VERSION = "1.37.0"  # explicit, so any helm build renders the same (check.sh uses it too)

Manifest = dict[str, Any]
WORKLOADS = {"Deployment", "StatefulSet", "Job", "CronJob"}


@pytest.fixture(scope="session")
def helm() -> str:
    for candidate in (cache_dir() / "bin" / "helm", shutil.which("helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    if os.environ.get("CI"):
        pytest.fail("helm is not installed: the bootstrap should have built it", pytrace=False)
    pytest.skip("helm is not installed (run helm/ci/install-tools.sh)")


def test_lint_template_and_validate(helm: str) -> None:
    """helm lint --strict and kubernetes-validate --strict on every CI values file."""
    proc = subprocess.run(
        ["bash", str(REPO / "helm" / "ci" / "check.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "FAIL" not in proc.stdout


def _template(
    helm: str, *args: str, release: str = "slotbridge", namespace: str = "slotbridge"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            helm,
            "template",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--kube-version",
            KUBE_VERSION,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def render(
    helm: str, *args: str, release: str = "slotbridge", namespace: str = "slotbridge"
) -> list[Manifest]:
    proc = _template(helm, *args, release=release, namespace=namespace)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def refused(helm: str, *args: str) -> str:
    proc = _template(helm, *args)
    assert proc.returncode != 0, f"helm template accepted {args}"
    return proc.stderr


@pytest.fixture(scope="session", params=CI_VALUES, ids=[p.stem for p in CI_VALUES])
def manifests(request: pytest.FixtureRequest, helm: str) -> list[Manifest]:
    return render(helm, "-f", str(request.param))


@pytest.fixture(scope="session")
def all_manifests(helm: str) -> list[Manifest]:
    return render(helm, "-f", str(ALL_VALUES))


def pod_template(doc: Manifest) -> Manifest:
    spec = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
    return dict(spec["template"])


def pod_specs(docs: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            yield f"{doc['kind']}/{doc['metadata']['name']}", pod_template(doc)["spec"]


def containers(docs: list[Manifest]) -> Iterator[tuple[str, Manifest, Manifest]]:
    for where, spec in pod_specs(docs):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            yield f"{where}/{c['name']}", c, spec


def component(doc: Manifest) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


def config_files(docs: list[Manifest]) -> dict[str, dict[str, Any]]:
    """Every settings file the chart renders, by ConfigMap key."""
    files: dict[str, dict[str, Any]] = {}
    for doc in docs:
        if doc["kind"] == "ConfigMap" and component(doc) != "dashboard":
            for key, text in doc["data"].items():
                files[key] = yaml.safe_load(text)
    return files


# -- probes and ports ------------------------------------------------------------------


def test_probes_point_at_container_ports(manifests: list[Manifest]) -> None:
    probed = 0
    for where, c, _ in containers(manifests):
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            action = probe.get("httpGet") or probe.get("tcpSocket")
            assert action is not None, f"{where} {kind} has no http/tcp action"
            port = action["port"]
            assert port in ports or port in ports.values(), f"{where} {kind} -> port {port}"
            probed += 1
    if any(
        component(d) in ("bridge", "failover-watch") for d in manifests if d["kind"] in WORKLOADS
    ):
        assert probed > 0


def test_health_probes_hit_the_served_endpoints(manifests: list[Manifest]) -> None:
    """Bridge and watcher: liveness /healthz, readiness /readyz, on the configured port."""
    files = config_files(manifests)
    for doc in manifests:
        if doc["kind"] not in WORKLOADS or component(doc) not in ("bridge", "failover-watch"):
            continue
        c = pod_template(doc)["spec"]["containers"][0]
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        config = files[Path(c["args"][c["args"].index("--config") + 1]).name]
        http = next(p for p in c["ports"] if p["name"] == "http")
        assert config["http_port"] == http["containerPort"]
        assert config["http_host"] == "0.0.0.0"


def test_services_target_named_ports(manifests: list[Manifest]) -> None:
    for svc in (d for d in manifests if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        pods = [
            c
            for _, c, spec in containers(manifests)
            if selector.items() <= _pod_labels(manifests, spec).items()
        ]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            assert any(p["name"] == port["targetPort"] for c in pods for p in c["ports"])


def _pod_labels(docs: list[Manifest], spec: Manifest) -> dict[str, str]:
    for doc in docs:
        if doc["kind"] in WORKLOADS and pod_template(doc)["spec"] is spec:
            return dict(pod_template(doc)["metadata"]["labels"])
    return {}


# -- one bridge per slot -----------------------------------------------------------------


def test_one_single_replica_bridge_per_slot(manifests: list[Manifest]) -> None:
    files = config_files(manifests)
    bridges = [d for d in manifests if d["kind"] in WORKLOADS and component(d) == "bridge"]
    slots = [s for s in (f.get("slot_name") for f in files.values()) if s]
    assert sorted(slots) == sorted(set(slots))
    assert len(bridges) == len(slots)
    assert not [d for d in manifests if d["kind"] == "HorizontalPodAutoscaler"]


def test_long_running_pods_are_single_writers(manifests: list[Manifest]) -> None:
    """Bridge, watcher and local consumer each own something (a slot, the repointing of
    subscribers, a checkpoint): StatefulSets of one replica, which - unlike a Deployment
    on a lost node or a force delete - start no second pod while the first may run."""
    assert not [d["metadata"]["name"] for d in manifests if d["kind"] == "Deployment"]
    for doc in (d for d in manifests if d["kind"] == "StatefulSet"):
        assert doc["spec"]["replicas"] == 1, doc["metadata"]["name"]
        assert doc["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def test_bridge_replicas_cannot_be_raised(helm: str) -> None:
    assert "replicas" in refused(helm, "--set", "bridge.replicas=2")


def test_duplicate_slot_is_refused(helm: str) -> None:
    err = refused(helm, "--set", "bridge.slots[0].name=a", "--set", "bridge.slots[1].name=a")
    assert 'slot "a" is listed twice' in err


def test_slots_get_distinct_pods_and_configs(all_manifests: list[Manifest]) -> None:
    bridges = {
        d["metadata"]["name"]: d
        for d in all_manifests
        if d["kind"] == "StatefulSet" and component(d) == "bridge"
    }
    assert set(bridges) == {"slotbridge-orders", "slotbridge-billing-events"}
    args = {n: d["spec"]["template"]["spec"]["containers"][0]["args"] for n, d in bridges.items()}
    assert args["slotbridge-billing-events"][-1] == "/etc/slotbridge/billing_events.yaml"


@pytest.mark.parametrize("slot", ["failover_watch", "consumer", "spark", "promote"])
def test_slot_named_like_another_resource_is_refused(helm: str, slot: str) -> None:
    assert "name of another of the chart's resources" in refused(
        helm, "--set", f"bridge.slots[0].name={slot}"
    )


def test_transactional_ids_are_scoped_to_the_release(helm: str) -> None:
    """Two releases on one Kafka cluster, same slot name, other databases: their
    producers must not fence each other."""

    def ids(release: str, namespace: str) -> set[str]:
        docs = render(helm, release=release, namespace=namespace)
        return {
            f["kafka_transactional_id"] for f in config_files(docs).values() if "slot_name" in f
        }

    a, b, c = ids("app", "team-a"), ids("billing", "team-a"), ids("app", "team-b")
    assert len(a) == len(b) == len(c) == 1 and len(a | b | c) == 3, (a, b, c)


# -- secrets -----------------------------------------------------------------------------


SECRET_WORDS = re.compile(r"password|passwd|secret|jaas", re.IGNORECASE)


def _keys(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _keys(v)


def test_no_secret_is_rendered(manifests: list[Manifest]) -> None:
    assert not [d for d in manifests if d["kind"] == "Secret"]
    for name, config in config_files(manifests).items():
        assert not [k for k in _keys(config) if SECRET_WORDS.search(k)], name


def test_passwords_come_from_secret_refs(all_manifests: list[Manifest]) -> None:
    seen: dict[str, set[str]] = {}
    for where, c, _ in containers(all_manifests):
        for env in c.get("env", []):
            if SECRET_WORDS.search(env["name"]):
                assert "value" not in env, f"{where}: {env['name']} inlined"
                ref = env["valueFrom"]["secretKeyRef"]
                seen.setdefault(where.split("/")[1], set()).add(f"{env['name']}={ref['name']}")
    assert seen["slotbridge-orders"] == {
        "SLOTBRIDGE_SOURCE_PASSWORD=app-db-slotbridge",
        "SLOTBRIDGE_KAFKA_SASL_PASSWORD=kafka-slotbridge",
    }
    assert "SLOTBRIDGE_SOURCE_PASSWORD=billing-db" in seen["slotbridge-billing-events"]
    assert seen["slotbridge-failover-watch"] == {
        "SLOTBRIDGE_PRIMARY__PASSWORD=pg-admin",
        "SLOTBRIDGE_STANDBYS__PG2__PASSWORD=pg-admin",
        "SLOTBRIDGE_SUBSCRIBERS__REPORTING__PASSWORD=pg-reporting-admin",
    }


@pytest.mark.parametrize(
    "bad",
    [
        "bridge.config.source_password=hunter2",
        "bridge.config.kafka_sasl_password=hunter2",
        "bridge.slots[0].config.source_password=hunter2",
        "bridge.config.kafka_config.sasl\\.password=hunter2",
        "failover.config.primary.password=hunter2",
        "consumer.config.kafka_options.sasl\\.jaas\\.config=hunter2",
        "bridge.env[0].name=SLOTBRIDGE_SOURCE_PASSWORD,bridge.env[0].value=hunter2",
        "bridge.config.source_dsn=host=pg user=app password=hunter2",
        "bridge.slots[0].config.source_dsn=host=pg PASSWORD = hunter2",
        "bridge.config.source_dsn=postgresql://app:hunter2@pg/app",
        "failover.config.primary.dsn=host=pg password=hunter2",
        "failover.config.standbys.standby1.dsn=host=pg2 password=hunter2",
    ],
)
def test_inline_secrets_are_refused(helm: str, bad: str) -> None:
    err = refused(helm, "--set", bad)
    assert "values don't meet the specifications of the schema" in err
    assert "hunter2" not in err.replace(bad, "")


# -- pod security ------------------------------------------------------------------------


def _security(c: Manifest, pod: Manifest, where: str) -> None:
    sc, psc = c.get("securityContext", {}), pod.get("securityContext", {})
    assert sc.get("runAsNonRoot") or psc.get("runAsNonRoot"), where
    assert (sc.get("runAsUser") or psc.get("runAsUser") or 0) != 0, where
    assert sc.get("readOnlyRootFilesystem") is True, where
    assert sc.get("allowPrivilegeEscalation") is False, where
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
    assert sc.get("privileged") is not True, where


def test_every_container_is_non_root_and_read_only(manifests: list[Manifest]) -> None:
    for where, c, spec in containers(manifests):
        _security(c, spec, where)
        assert c["resources"]["requests"] and c["resources"]["limits"], where
        writable = {m["mountPath"] for m in c.get("volumeMounts", []) if not m.get("readOnly")}
        assert "/tmp" in writable, where


def test_spark_operator_pods_are_non_root(all_manifests: list[Manifest]) -> None:
    (app,) = [d for d in all_manifests if d["kind"] == "SparkApplication"]
    for role in ("driver", "executor"):
        spec = app["spec"][role]
        _security(spec, {"securityContext": spec["podSecurityContext"]}, role)


def test_bridge_spools_to_an_empty_dir(all_manifests: list[Manifest]) -> None:
    files = config_files(all_manifests)
    for doc in all_manifests:
        if doc["kind"] == "StatefulSet" and component(doc) == "bridge":
            spec = doc["spec"]["template"]["spec"]
            c = spec["containers"][0]
            spool = Path(files[Path(c["args"][-1]).name]["spool_dir"])
            (mount,) = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == spool]
            (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
            assert "emptyDir" in volume


# -- schema ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("bridge.slots[0].name=Orders", "bridge/slots/0/name"),
        ("bridge.slots[0].name=orders-1", "bridge/slots/0/name"),
        ("bridge.config.http_port=9000", "http_port"),
        ("bridge.config.slot_name=x", "slot_name"),
        ("bridge.config.streaming=sometimes", "bridge/config/streaming"),
        ("bridge.config.tables[0]=orders", "bridge/config/tables/0"),
        ("bridge.port=70000", "bridge/port"),
        ("image.pullPolicy=Sometimes", "image/pullPolicy"),
        ("sparkImage.pullPolicy=Sometimes", "sparkImage/pullPolicy"),
        ("sparkImage.digest=latest", "sparkImage/digest"),
        ("failover.runbook.dryRun=no", "failover/runbook/dryRun"),
        ("failover.config.standbys=null", "failover/config"),
        ("consumer.config.spark_master=yarn", "spark_master"),
        ("nosuchkey=1", "nosuchkey"),
    ],
)
def test_schema_refuses_bad_values(helm: str, bad: str, why: str) -> None:
    err = refused(helm, "--set", bad)
    assert "values don't meet the specifications of the schema" in err, err
    assert why in err, err


def test_schema_names_every_settings_field() -> None:
    """values.schema.json knows each settings field, except those the chart sets itself."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]
    owned: dict[type[ServiceSettings], tuple[set[str], dict[str, Any]]] = {
        BridgeSettings: (
            {
                "slot_name",
                "http_host",
                "http_port",
                "spool_dir",
                "source_password",
                "kafka_sasl_password",
                "kafka_transactional_id",
            },
            props["bridge"]["properties"]["config"],
        ),
        FailoverSettings: ({"http_host", "http_port"}, props["failover"]["properties"]["config"]),
        ConsumerSettings: (
            {"jars_dir", "spark_master", "status_path", "http_host", "http_port"},
            props["consumer"]["properties"]["config"],
        ),
    }
    for model, (chart_owned, config) in owned.items():
        assert set(config["properties"]) == set(model.model_fields) - chart_owned, model


# -- runbook -----------------------------------------------------------------------------


def _promote_args(docs: list[Manifest]) -> list[str]:
    (cron,) = [d for d in docs if d["kind"] == "CronJob"]
    return list(pod_template(cron)["spec"]["containers"][0]["args"])


def test_runbook_is_off_by_default_and_dry_run_unless_told(helm: str) -> None:
    assert not [d for d in render(helm) if d["kind"] in ("Job", "CronJob")]
    on = ("--set", "failover.runbook.enabled=true", "--set", "failover.runbook.standby=standby1")
    args = _promote_args(render(helm, *on))
    assert args[:2] == ["failover", "promote"] and "--dry-run" in args
    assert args[args.index("--standby") + 1] == "standby1"
    real = _promote_args(render(helm, *on, "--set", "failover.runbook.dryRun=false"))
    assert "--dry-run" not in real


def test_runbook_runs_only_when_asked(helm: str) -> None:
    """No Job is rendered, so install, upgrade and rollback run nothing; the promotion is a
    suspended CronJob with one stable name, started by `kubectl create job --from`."""
    on = ("--set", "failover.runbook.enabled=true", "--set", "failover.runbook.standby=standby1")
    docs = render(helm, *on)
    assert not [d for d in docs if d["kind"] == "Job"]
    (cron,) = [d for d in docs if d["kind"] == "CronJob"]
    assert cron["metadata"]["name"] == "slotbridge-promote"
    assert cron["spec"]["suspend"] is True
    assert cron["spec"]["jobTemplate"]["spec"]["backoffLimit"] == 0
    template = (CHART / "templates" / "failover-runbook-cronjob.yaml").read_text()
    assert "Release.Revision" not in template


def test_runbook_needs_a_known_standby(helm: str) -> None:
    assert "failover.runbook.standby" in refused(helm, "--set", "failover.runbook.enabled=true")
    err = refused(
        helm, "--set", "failover.runbook.enabled=true", "--set", "failover.runbook.standby=nosuch"
    )
    assert '"nosuch" is not a key of failover.config.standbys' in err


# -- the services accept what the chart renders --------------------------------------------


def _env(c: Manifest) -> dict[str, str]:
    """The container's environment as the process would see it (Secrets: a stand-in)."""
    out: dict[str, str] = {}
    for env in c.get("env", []):
        # As long as a masking key must be.
        out[env["name"]] = env.get("value", "from-a-secret-of-32-bytes-at-least")
    return out


SETTINGS: dict[str, type[ServiceSettings]] = {
    "run": BridgeSettings,
    "failover": FailoverSettings,
    "consume": ConsumerSettings,
}


def _load(
    c: Manifest, docs: list[Manifest], tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> ServiceSettings:
    args = c["args"]
    path = tmp / Path(args[args.index("--config") + 1]).name
    path.write_text(yaml.safe_dump(config_files(docs)[path.name]))
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith("SLOTBRIDGE_")]:
            m.delenv(name)
        for name, value in _env(c).items():
            m.setenv(name, value)
        return load_settings(SETTINGS[args[0]], path)


def _configured(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    for where, c, _ in containers(manifests):
        if "--config" in c.get("args", []):
            yield where, c


def test_rendered_settings_pass_service_validation(
    manifests: list[Manifest],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for where, c in _configured(manifests):
        settings = _load(c, manifests, tmp_path, monkeypatch)
        if isinstance(settings, BridgeSettings):
            assert settings.source_password is not None or not any(
                e["name"] == "SLOTBRIDGE_SOURCE_PASSWORD" for e in c.get("env", [])
            ), where


def test_secrets_reach_the_settings(
    all_manifests: list[Manifest],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded = {
        where.split("/")[1]: _load(c, all_manifests, tmp_path, monkeypatch)
        for where, c in _configured(all_manifests)
    }
    bridge = loaded["slotbridge-billing-events"]
    assert isinstance(bridge, BridgeSettings)
    assert bridge.slot_name == "billing_events" and bridge.snapshot_mode == "never"
    assert bridge.source_password is not None and bridge.kafka_sasl_password is not None
    assert bridge.topic_prefix == "app"  # shared config under the slot's own
    orders = loaded["slotbridge-orders"]
    assert isinstance(orders, BridgeSettings) and orders.transforms
    (container,) = [c for where, c in _configured(all_manifests) if "slotbridge-orders" in where]
    with monkeypatch.context() as m:  # the key is read from the environment at start
        for name, value in _env(container).items():
            m.setenv(name, value)
        assert orders.masking_key() == b"from-a-secret-of-32-bytes-at-least"
    watch = loaded["slotbridge-failover-watch"]
    assert isinstance(watch, FailoverSettings)
    assert watch.primary.password is not None
    assert watch.standbys["pg2"].password is not None
    assert watch.subscribers["reporting"].password is not None
    assert watch.standbys["pg2"].dsn.startswith("host=pg-2")


def test_consumer_settings_in_both_modes(
    helm: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = render(helm, "--set", "consumer.enabled=true")
    (dep,) = [d for d in local if d["kind"] == "StatefulSet" and component(d) == "consumer"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    settings = _load(c, local, tmp_path, monkeypatch)
    assert isinstance(settings, ConsumerSettings)
    assert settings.spark_master == "local[2]"
    assert settings.jars_dir == Path("/opt/slotbridge/jars/spark")

    operator = render(helm, "-f", str(ALL_VALUES))
    config = config_files(operator)["consumer.yaml"]
    path = tmp_path / "consumer.yaml"
    path.write_text(yaml.safe_dump(config))
    with monkeypatch.context() as m:
        for name in [n for n in os.environ if n.startswith("SLOTBRIDGE_")]:
            m.delenv(name)
        m.setenv("SLOTBRIDGE_KAFKA_OPTIONS__SASL.JAAS.CONFIG", "from-a-secret")
        settings = load_settings(ConsumerSettings, path)
    assert isinstance(settings, ConsumerSettings)
    assert settings.spark_master is None  # spark-submit decides it
    assert settings.kafka_options["sasl.jaas.config"] == "from-a-secret"
    (app,) = [d for d in operator if d["kind"] == "SparkApplication"]
    assert app["spec"]["arguments"] == ["/etc/slotbridge/consumer.yaml"]


def test_container_args_parse_with_the_cli(manifests: list[Manifest]) -> None:
    for where, c, _ in containers(manifests):
        args = list(c["args"])
        command: click.Command = cli
        ctx = click.Context(cli, info_name="slotbridge")
        while isinstance(command, click.Group):
            sub = command.get_command(ctx, args[0])
            assert sub is not None, f"{where}: no command {args[0]!r}"
            command, args = sub, args[1:]
        command.make_context(command.name, args)  # raises on unknown or missing options


# -- monitoring --------------------------------------------------------------------------


def _exported_metrics() -> set[str]:
    names: set[str] = set()
    status = Status(
        tables={"public.t": TableCounts(applied=1, quarantined=1)},
        lag={"p.public.t": 0},
        last_batch_seconds=1.0,
        housekeeping=Upkeep(),
    )
    registries = [
        BridgeMetrics("s", SpoolStats()).registry,
        CollectorRegistry(),
        registry_for(status),
    ]
    FailoverMetrics(registries[1])
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
    return names


def test_alerts_and_dashboard_use_exported_metrics(all_manifests: list[Manifest]) -> None:
    exported = _exported_metrics()
    (rule,) = [d for d in all_manifests if d["kind"] == "PrometheusRule"]
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "SlotbridgeBridgeNotStreaming",
        "SlotbridgeLagBytesHigh",
        "SlotbridgeSlotNotFailoverReady",
        "SlotbridgeBridgeAbsent",
        "SlotbridgeFailoverWatchAbsent",
    } <= alerts
    # A bridge that never ran exports nothing for the other rules to judge.
    (absent,) = [
        r["expr"]
        for g in rule["spec"]["groups"]
        for r in g["rules"]
        if r["alert"] == "SlotbridgeBridgeAbsent"
    ]
    assert re.findall(r'absent\(slotbridge_streaming\{[^}]*slot="(\w+)"', absent) == [
        "orders",
        "billing_events",
    ], absent
    (board,) = [
        d for d in all_manifests if d["kind"] == "ConfigMap" and component(d) == "dashboard"
    ]
    dashboard = json.loads(board["data"]["slotbridge.json"])
    exprs += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bslotbridge_[a-z_]+", e)}
    assert used and used <= exported, used - exported


# -- images ----------------------------------------------------------------------------


def test_only_the_consumer_runs_the_spark_image(helm: str, all_manifests: list[Manifest]) -> None:
    """Bridge and failover pods run `image` (no Java, no Spark); the consumer `sparkImage`."""
    spark = "example/slotbridge-spark@sha256:" + "0123456789abcdef" * 4
    (app,) = [d for d in all_manifests if d["kind"] == "SparkApplication"]
    assert app["spec"]["image"] == spark
    local = render(
        helm,
        "-f",
        str(REPO / "helm" / "ci" / "local-consumer-values.yaml"),
        "--set",
        "image.tag=1.2.3",
        "--set",
        "sparkImage.tag=4.5.6",
        "--set",
        "sparkImage.pullPolicy=Always",
    )
    seen = set()
    for docs, bridge_image, spark_image in (
        (all_manifests, "example/slotbridge:0.1.0", spark),
        (local, "slotbridge:1.2.3", "slotbridge-spark:4.5.6"),
    ):
        for doc in docs:
            if doc["kind"] not in WORKLOADS:
                continue
            for c in pod_template(doc)["spec"]["containers"]:
                want = spark_image if component(doc) == "consumer" else bridge_image
                assert c["image"] == want, (doc["metadata"]["name"], c["image"])
                seen.add(component(doc))
                if docs is local and component(doc) == "consumer":
                    assert c["imagePullPolicy"] == "Always"
    assert "consumer" in seen and "bridge" in seen, seen


# -- extension points ------------------------------------------------------------------


def test_the_chart_can_be_a_subchart(helm: str) -> None:
    """A parent chart passes `global` to every subchart: the strict schema must take it."""
    render(helm, "--set", "global.imageRegistry=registry.example.com")


def test_extra_volumes_mounts_and_env_from_reach_every_pod(helm: str) -> None:
    sets: list[str] = []
    for at in ("bridge", "failover.watch", "failover.runbook", "consumer"):
        sets += [
            "--set",
            f"{at}.extraVolumes[0].name=ca",
            "--set",
            f"{at}.extraVolumes[0].secret.secretName=pg-ca",
            "--set",
            f"{at}.extraVolumeMounts[0].name=ca",
            "--set",
            f"{at}.extraVolumeMounts[0].mountPath=/etc/ssl/pg",
            "--set",
            f"{at}.envFrom[0].secretRef.name=kafka-tls",
        ]
    on = [
        "--set",
        "failover.runbook.enabled=true",
        "--set",
        "failover.runbook.standby=standby1",
        "--set",
        "consumer.enabled=true",
    ]
    docs = render(helm, *on, *sets)
    pods = dict(pod_specs(docs))
    assert len(pods) == 4, list(pods)  # bridge, watcher, runbook, consumer
    for where, spec in pods.items():
        assert {"name": "ca", "secret": {"secretName": "pg-ca"}} in spec["volumes"], where
        c = spec["containers"][0]
        assert {"name": "ca", "mountPath": "/etc/ssl/pg"} in c["volumeMounts"], where
        assert c["envFrom"] == [{"secretRef": {"name": "kafka-tls"}}], where
    operator = render(helm, "-f", str(ALL_VALUES), *sets)
    (app,) = [d for d in operator if d["kind"] == "SparkApplication"]
    assert {"name": "ca", "secret": {"secretName": "pg-ca"}} in app["spec"]["volumes"]
    for role in ("driver", "executor"):
        assert {"name": "ca", "mountPath": "/etc/ssl/pg"} in app["spec"][role]["volumeMounts"]
        assert app["spec"][role]["envFrom"] == [{"secretRef": {"name": "kafka-tls"}}]


# -- Spark operator ----------------------------------------------------------------------


def test_spark_pods_get_the_consumers_account_and_scheduling(helm: str) -> None:
    docs = render(
        helm,
        "-f",
        str(ALL_VALUES),
        "--set",
        "serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn=arn:x",
        "--set",
        "consumer.nodeSelector.pool=spark",
        "--set",
        "consumer.tolerations[0].key=spark",
        "--set",
        "consumer.tolerations[0].operator=Exists",
        "--set",
        "consumer.podLabels.cost=lake",
    )
    (app,) = [d for d in docs if d["kind"] == "SparkApplication"]
    (account,) = [
        d
        for d in docs
        if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "slotbridge-spark"
    ]
    assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:x"}
    for role in ("driver", "executor"):
        spec = app["spec"][role]
        assert spec["serviceAccount"] == "slotbridge-spark", role
        assert spec["nodeSelector"] == {"pool": "spark"}, role
        assert spec["tolerations"] == [{"key": "spark", "operator": "Exists"}], role
        assert spec["labels"]["cost"] == "lake", role


def test_spark_operator_refuses_a_local_warehouse_without_a_shared_claim(helm: str) -> None:
    local = ("-f", str(ALL_VALUES), "--set", "consumer.config.warehouse=/var/lib/slotbridge/w")
    assert "consumer.config.warehouse" in refused(helm, *local)
    docs = render(
        helm,
        *local,
        "--set",
        "consumer.config.checkpoint_dir=/var/lib/slotbridge/c",
        "--set",
        "consumer.dataClaim=lake-rwx",
    )
    (app,) = [d for d in docs if d["kind"] == "SparkApplication"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "lake-rwx"}} in app["spec"][
        "volumes"
    ]
    for role in ("driver", "executor"):
        assert {"name": "data", "mountPath": "/var/lib/slotbridge"} in app["spec"][role][
            "volumeMounts"
        ]


# -- resources ---------------------------------------------------------------------------


def test_bridge_resources_cover_the_kafka_queue_and_the_spool(manifests: list[Manifest]) -> None:
    for doc in (d for d in manifests if d["kind"] == "StatefulSet" and component(d) == "bridge"):
        resources = doc["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert _quantity(resources["limits"]["memory"]) >= 1024**3  # 256 MiB queue + rest
        spool = next(v for v in doc["spec"]["template"]["spec"]["volumes"] if v["name"] == "spool")
        assert _quantity(resources["requests"]["ephemeral-storage"]) >= _quantity(
            spool["emptyDir"]["sizeLimit"]
        )


def _quantity(text: str) -> int:
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)
