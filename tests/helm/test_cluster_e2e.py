"""The Helm chart on a real kube-apiserver (issue #16): install, upgrade, rollback, force
delete, drain.

helm/ci/cluster.sh brings up etcd, kube-apiserver (RBAC, PodSecurity admission),
kube-controller-manager, kube-scheduler and kwok with three fake nodes in a temporary folder.
The CRDs the chart may render are installed from their upstream sources (SparkApplication from
the kubeflow spark-operator module, ServiceMonitor and PrometheusRule from the
prometheus-operator module, both through the Go module proxy). Then, for each of
helm/ci/default-values.yaml, all-values.yaml and local-consumer-values.yaml, in a namespace
labelled pod-security.kubernetes.io/enforce=restricted, one scenario runs:

  helm install --wait; helm upgrade --wait with an unrelated value change (a common label,
  which rolls every workload); helm rollback --wait to revision 1; a force delete of each
  bridge pod; kubectl drain (--ignore-daemonsets --delete-emptydir-data --force) of every node
  that runs a single-writer pod. Where a PodDisruptionBudget blocks the drain (the chart's
  maxUnavailable 0), the pods are moved the way values.yaml tells operators to: deleted by
  hand, then the drain is completed.

A `kubectl get pods -w` runs through the whole scenario and counts, per component (per slot
for the bridge), the pods that exist and have not terminated (phase neither Succeeded nor
Failed; a pod being deleted counts until it is gone, since its container may still run).
The tests below then assert on what was recorded:

  * every pod the controllers want is admitted (no FailedCreate event, no PodSecurity
    warning from helm, every Deployment/StatefulSet ready after each step);
  * never two bridge pods of one slot, two failover-watch pods or two local consumer pods
    at once;
  * install, upgrade and rollback create no failover runbook Job or pod;
  * every liveness, readiness and startup probe targets a port its container declares.

kwok runs no containers: pods are marked Running and Ready at once and probes are never
executed (the probe test checks the pod specs the API server stored). A deleted pod
disappears KWOK_POD_DELETE_DELAY_MS (2 s) after the deletion request, standing in for a
container that stops within its grace period. A force delete removes the pod object at once,
so the API never shows the old and the new pod together even where the old container may
still run on its node: the count cannot see that case, only the graceful ones (rollouts,
evictions, deletes).

Needs the binaries built by helm/ci/k8s-tools.sh (7-40 minutes cold); skips, saying so, when
they are not cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from slotbridge_dev.bootstrap import cache_dir

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "slotbridge"
CI = REPO / "helm" / "ci"
K8S_BIN = cache_dir() / "k8s" / "bin"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
)
RELEASE = "slotbridge"
SCENARIOS = ("default-values.yaml", "all-values.yaml", "local-consumer-values.yaml")
# Components that must never run two pods at once (the bridge per slot).
SINGLE_WRITERS = ("bridge", "failover-watch", "consumer")
RUNBOOK = "failover-runbook"
COMPONENT = "app.kubernetes.io/component"
SLOT = "slotbridge.io/slot"
# Upstream CRD sources, through the Go module proxy (go mod download).
CRD_SOURCES = (
    (
        "github.com/kubeflow/spark-operator/v2",
        "v2.4.0",
        ("config/crd/bases/sparkoperator.k8s.io_sparkapplications.yaml",),
    ),
    (
        "github.com/prometheus-operator/prometheus-operator",
        "v0.85.0",
        (
            "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
            "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
        ),
    ),
)
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
TERMINATED = ("Succeeded", "Failed")

Obj = dict[str, Any]

missing = [b for b in BINARIES if not os.access(K8S_BIN / b, os.X_OK)]
pytestmark = pytest.mark.skipif(
    bool(missing),
    reason=f"Kubernetes binaries not cached in {K8S_BIN}: build them with helm/ci/k8s-tools.sh",
)


@dataclass
class Cluster:
    dir: Path
    env: dict[str, str]
    helm: str

    def run(
        self, *args: str, timeout: float = 90, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            list(args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            input=stdin,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {proc.returncode}:\n"
                f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
            )
        return proc

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run(str(K8S_BIN / "kubectl"), *args, **kw)

    def get(self, *args: str) -> list[Obj]:
        items: list[Obj] = json.loads(self.kubectl("get", *args, "-o", "json").stdout)["items"]
        return items


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    helm = (
        subprocess.run(
            ["bash", str(CI / "install-tools.sh")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    folder = tmp_path_factory.mktemp("k8s")
    up = subprocess.run(
        ["bash", str(CI / "cluster.sh"), "up", str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        assert up.returncode == 0, f"cluster.sh up failed:\n{up.stderr[-4000:]}"
        env = {
            **os.environ,
            "KUBECONFIG": str(folder / "kubeconfig"),
            "KUBE_FEATURE_WatchListClient": "false",
            "HELM_CACHE_HOME": str(folder / "helm-cache"),
            "HELM_CONFIG_HOME": str(folder / "helm-config"),
            "HELM_DATA_HOME": str(folder / "helm-data"),
        }
        c = Cluster(folder, env, helm)
        _install_crds(c)
        yield c
    finally:
        subprocess.run(
            ["bash", str(CI / "cluster.sh"), "down", str(folder)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


def _install_crds(c: Cluster) -> None:
    files: list[str] = []
    for module, version, paths in CRD_SOURCES:
        out = c.run("go", "mod", "download", "-json", f"{module}@{version}", timeout=300)
        root = Path(json.loads(out.stdout)["Dir"])
        files += [str(root / p) for p in paths]
    # Server-side: the SparkApplication CRD is too large for the last-applied annotation.
    c.kubectl("apply", "--server-side", *[a for f in files for a in ("-f", f)])
    names = (
        "sparkapplications.sparkoperator.k8s.io",
        "servicemonitors.monitoring.coreos.com",
        "prometheusrules.monitoring.coreos.com",
    )
    deadline = time.monotonic() + 60
    # (kubectl wait fails at once on a CRD whose status has no conditions yet: poll.)
    while True:
        established = {
            crd["metadata"]["name"]
            for crd in c.get("crd")
            if any(
                cond["type"] == "Established" and cond["status"] == "True"
                for cond in crd.get("status", {}).get("conditions") or []
            )
        }
        if established.issuperset(names):
            return
        assert time.monotonic() < deadline, f"CRDs not established: {set(names) - established}"
        time.sleep(0.5)


def component_of(pod: Obj) -> str:
    labels = pod["metadata"].get("labels") or {}
    comp = labels.get(COMPONENT, "other")
    return f"{comp}[{labels[SLOT]}]" if SLOT in labels else str(comp)


class PodWatch:
    """`kubectl get pods -w` over one namespace, counting non-terminated pods per component."""

    def __init__(self, c: Cluster, namespace: str) -> None:
        self.step = "start"
        self.lock = threading.Lock()
        self.live: dict[str, Obj] = {}
        self.max: dict[str, int] = {}
        self.evidence: dict[str, str] = {}
        self.runbook_pods: list[tuple[str, str]] = []  # (step, pod) first seen
        self.runbook_uids: set[str] = set()
        self.proc = subprocess.Popen(
            [
                str(K8S_BIN / "kubectl"),
                "get",
                "pods",
                "-n",
                namespace,
                "-w",
                "--output-watch-events",
                "-o",
                "json",
            ],
            env=c.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        time.sleep(1.0)  # let the watch start before anything is created

    def _read(self) -> None:
        assert self.proc.stdout is not None
        decoder = json.JSONDecoder()
        buf = ""
        for line in self.proc.stdout:  # one event per line, or indented over several
            buf += line
            while buf.strip():
                try:
                    event, end = decoder.raw_decode(buf.lstrip())
                except json.JSONDecodeError:
                    break  # incomplete: read on
                buf = buf.lstrip()[end:]
                self._event(event)

    def _event(self, event: Obj) -> None:
        pod = event["object"]
        uid = pod["metadata"]["uid"]
        name = pod["metadata"]["name"]
        comp = component_of(pod)
        with self.lock:
            if comp == RUNBOOK and uid not in self.runbook_uids:
                self.runbook_uids.add(uid)
                self.runbook_pods.append((self.step, name))
            if event["type"] == "DELETED" or pod.get("status", {}).get("phase") in TERMINATED:
                self.live.pop(uid, None)
            else:
                self.live[uid] = pod
            same = [p for p in self.live.values() if component_of(p) == comp]
            if len(same) > self.max.get(comp, 0):
                self.max[comp] = len(same)
                desc = ", ".join(
                    p["metadata"]["name"]
                    + (" (terminating)" if p["metadata"].get("deletionTimestamp") else "")
                    for p in same
                )
                self.evidence[comp] = f"{len(same)} during {self.step}: {desc}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.thread.join(timeout=10)


@dataclass
class Scenario:
    values: str
    namespace: str
    seconds: float = 0.0
    commands: list[tuple[str, int, str]] = field(default_factory=list)  # step, rc, output
    warnings: list[str] = field(default_factory=list)  # PodSecurity
    failed_create: list[str] = field(default_factory=list)
    not_ready: list[str] = field(default_factory=list)
    runbook_jobs: list[tuple[str, str]] = field(default_factory=list)
    runbook_pods: list[tuple[str, str]] = field(default_factory=list)
    max_pods: dict[str, int] = field(default_factory=dict)
    evidence: dict[str, str] = field(default_factory=dict)
    probe_problems: list[str] = field(default_factory=list)


def _probe_problems(where: str, pod_spec: Obj) -> list[str]:
    problems = []
    for container in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        ports = container.get("ports") or []
        names = {p.get("name") for p in ports if p.get("name")}
        numbers = {p["containerPort"] for p in ports}
        for kind in PROBES:
            probe = container.get(kind)
            if not probe:
                continue
            for handler in ("httpGet", "tcpSocket", "grpc"):
                if handler not in probe:
                    continue
                port = probe[handler].get("port")
                ok = port in numbers if isinstance(port, int) else port in names
                if not ok:
                    problems.append(
                        f"{where} container {container['name']} {kind} "
                        f"{handler} port {port!r}; declared {sorted(names)} "
                        f"{sorted(numbers)}"
                    )
    return problems


def _pod_specs(c: Cluster, ns: str) -> Iterator[tuple[str, Obj]]:
    for pod in c.get("pods", "-n", ns):
        yield f"pod/{pod['metadata']['name']}", pod["spec"]
    kinds = "deployments,statefulsets,daemonsets,jobs,cronjobs"
    for w in c.get(kinds, "-n", ns):
        spec = w["spec"]
        if w["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        yield f"{w['kind']}/{w['metadata']['name']}", spec["template"]["spec"]


class Runner:
    def __init__(self, c: Cluster, s: Scenario, watch: PodWatch) -> None:
        self.c, self.s, self.watch, self.ns = c, s, watch, s.namespace
        self.runbook_job_uids: set[str] = set()

    def command(self, step: str, *args: str) -> subprocess.CompletedProcess[str]:
        proc = self.c.run(*args, timeout=120, check=False)
        out = (proc.stdout + proc.stderr).strip()
        shown = " ".join(Path(args[0]).name if i == 0 else a for i, a in enumerate(args[:6]))
        self.s.commands.append((step, proc.returncode, f"$ {shown} ...\n{out[-1500:]}"))
        self.s.warnings += [
            f"{step}: {line.strip()}" for line in proc.stderr.splitlines() if "PodSecurity" in line
        ]
        return proc

    def step(self, name: str) -> None:
        with self.watch.lock:
            self.watch.step = name

    def settle(self, step: str) -> None:
        """After a step: workloads rolled out and ready, runbook Jobs and probes recorded."""
        for w in self.c.get("deployments,statefulsets", "-n", self.ns):
            ref = f"{w['kind'].lower()}/{w['metadata']['name']}"
            proc = self.c.kubectl(
                "rollout", "status", "-n", self.ns, ref, "--timeout=45s", check=False, timeout=60
            )
            if proc.returncode != 0:
                self.s.not_ready.append(f"{step}: {ref}: {proc.stderr.strip()[-300:]}")
        for job in self.c.get("jobs", "-n", self.ns, "-l", f"{COMPONENT}={RUNBOOK}"):
            uid = job["metadata"]["uid"]
            if uid not in self.runbook_job_uids:
                self.runbook_job_uids.add(uid)
                self.s.runbook_jobs.append((step, job["metadata"]["name"]))
        for where, spec in _pod_specs(self.c, self.ns):
            for problem in _probe_problems(where, spec):
                if problem not in self.s.probe_problems:
                    self.s.probe_problems.append(problem)

    def helm(self, step: str, *args: str) -> None:
        self.step(step)
        self.command(step, self.c.helm, *args, "-n", self.ns, "--wait", "--timeout", "60s")
        self.settle(step)

    def single_writer_nodes(self) -> list[str]:
        nodes = {
            p["spec"].get("nodeName")
            for p in self.c.get("pods", "-n", self.ns)
            if component_of(p).split("[")[0] in SINGLE_WRITERS
            and not p["metadata"].get("deletionTimestamp")
        }
        return sorted(n for n in nodes if n)

    def drain(self, node: str) -> None:
        step = f"drain {node}"
        self.step(step)
        args = ("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--force")
        proc = self.command(step, str(K8S_BIN / "kubectl"), *args, "--timeout=6s")
        if proc.returncode != 0 and "disruption budget" in proc.stderr:
            # values.yaml: "maxUnavailable 0 makes kubectl drain wait until you move the pod
            # yourself". Move them (a plain delete), then finish the drain.
            self.step(f"{step} (pods blocked by a PodDisruptionBudget deleted by hand)")
            for pod in self.c.get(
                "pods", "-n", self.ns, "--field-selector", f"spec.nodeName={node}"
            ):
                self.command(
                    step,
                    str(K8S_BIN / "kubectl"),
                    "delete",
                    "pod",
                    "-n",
                    self.ns,
                    pod["metadata"]["name"],
                    "--wait=false",
                )
            self.command(step, str(K8S_BIN / "kubectl"), *args, "--timeout=30s")
        self.settle(step)
        self.c.kubectl("uncordon", node)


def _prepare_namespace(c: Cluster, ns: str, values: str) -> None:
    c.kubectl("create", "namespace", ns)
    c.kubectl(
        "label",
        "namespace",
        ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
        "pod-security.kubernetes.io/warn=restricted",
    )
    claim = (CI / values).read_text()
    if "dataClaim:" in claim:
        # A statically bound volume for consumer.dataClaim (no provisioner in this cluster).
        c.kubectl(
            "apply",
            "-f",
            "-",
            stdin=f"""
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {ns}-lake}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  hostPath: {{path: /nonexistent/{ns}-lake}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: slotbridge-lake, namespace: {ns}}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  volumeName: {ns}-lake
  resources: {{requests: {{storage: 1Gi}}}}
""",
        )


@pytest.fixture(scope="module", params=SCENARIOS)
def scenario(request: pytest.FixtureRequest, cluster: Cluster) -> Scenario:
    values: str = request.param
    ns = "e2e-" + values.removesuffix("-values.yaml")
    s = Scenario(values, ns)
    started = time.monotonic()
    _prepare_namespace(cluster, ns, values)
    watch = PodWatch(cluster, ns)
    r = Runner(cluster, s, watch)
    chart_args = (RELEASE, str(CHART), "-f", str(CI / values))
    try:
        r.helm("install", "install", *chart_args)
        r.helm("upgrade", "upgrade", *chart_args, "--set-string", "commonLabels.e2e-upgrade=yes")
        r.helm("rollback", "rollback", RELEASE, "1")
        r.step("force delete")
        for pod in cluster.get("pods", "-n", ns, "-l", f"{COMPONENT}=bridge"):
            r.command(
                "force delete",
                str(K8S_BIN / "kubectl"),
                "delete",
                "pod",
                "-n",
                ns,
                pod["metadata"]["name"],
                "--grace-period=0",
                "--force",
            )
        r.settle("force delete")
        for node in r.single_writer_nodes():
            r.drain(node)
        r.step("end")
        for ev in cluster.get("events", "-n", ns):
            if ev.get("reason") == "FailedCreate":
                s.failed_create.append(
                    f"{ev['involvedObject']['kind']}/"
                    f"{ev['involvedObject']['name']}: {ev.get('message')}"
                )
    finally:
        watch.stop()
        s.max_pods, s.evidence = dict(watch.max), dict(watch.evidence)
        s.runbook_pods = list(watch.runbook_pods)
        cluster.run(
            cluster.helm, "uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s", check=False
        )
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        s.seconds = time.monotonic() - started
    print(f"\n{values}: scenario {s.seconds:.1f}s, max pods per component {s.max_pods}")
    return s


def test_lifecycle_commands_succeed(scenario: Scenario) -> None:
    """helm install/upgrade/rollback, the force deletes and the drains all exit 0."""
    failed = [
        f"{step} exited {rc}:\n{out}"
        for step, rc, out in scenario.commands
        if rc != 0
        # a drain blocked by a PodDisruptionBudget is retried after moving the pods
        and not (step.startswith("drain") and "disruption budget" in out)
    ]
    assert not failed, "\n".join(failed)


def test_every_wanted_pod_is_admitted(scenario: Scenario) -> None:
    """No FailedCreate event (e.g. a PodSecurity rejection), no PodSecurity warning, and every
    Deployment and StatefulSet rolled out after each step."""
    assert not scenario.failed_create, "\n".join(scenario.failed_create)
    assert not scenario.warnings, "\n".join(scenario.warnings)
    assert not scenario.not_ready, "\n".join(scenario.not_ready)


@pytest.mark.parametrize("component", SINGLE_WRITERS)
def test_never_two_pods_at_once(scenario: Scenario, component: str) -> None:
    """At most one non-terminated pod per single-writer component (per slot for the bridge)
    at any moment of the scenario, a pod being deleted included."""
    seen = {k: n for k, n in scenario.max_pods.items() if k.split("[")[0] == component}
    if not seen:
        pytest.skip(f"{scenario.values} deploys no {component} pod")
    over = {k: scenario.evidence[k] for k, n in seen.items() if n > 1}
    assert not over, f"{scenario.values}: " + "; ".join(f"{k}: {e}" for k, e in over.items())


def test_no_runbook_job_from_install_upgrade_or_rollback(scenario: Scenario) -> None:
    """Installing, upgrading or rolling back never runs `slotbridge failover promote`."""
    assert not scenario.runbook_jobs and not scenario.runbook_pods, (
        f"{scenario.values}: runbook Jobs {scenario.runbook_jobs}, pods {scenario.runbook_pods}"
        " (step first seen, name)"
    )


def test_probes_target_declared_ports(scenario: Scenario) -> None:
    """Every liveness/readiness/startup probe of the stored pods and pod templates names a
    port its container declares (kwok never runs the probes themselves)."""
    assert not scenario.probe_problems, "\n".join(scenario.probe_problems)
