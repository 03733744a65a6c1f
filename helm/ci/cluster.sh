#!/usr/bin/env bash
# A throwaway Kubernetes control plane with kwok fake nodes, everything under one folder.
#
#   helm/ci/cluster.sh up DIR     # etcd, kube-apiserver, controller-manager, scheduler, kwok,
#                                 # 3 fake nodes; writes DIR/kubeconfig (admin, system:masters)
#   helm/ci/cluster.sh down DIR   # stops what `up DIR` started (safe to call twice)
#
# Binaries come from helm/ci/k8s-tools.sh ($CACHE/k8s/bin); `up` fails, naming that script,
# when they are missing. Ports are free ones picked at start (DIR/ports.env); certificates and
# the service-account signing key are made with openssl in DIR/pki; logs go to DIR/logs.
# The apiserver authorizes with RBAC, admits with PodSecurity among the usual plugins.
# Debian's etcd 3.4.23 lacks the watch progress notifications that streaming lists
# (sendInitialEvents) rely on, so they are switched off everywhere: every process gets
# KUBE_FEATURE_WatchListClient=false (client-go reads it; kwok, kubectl, helm), the controller
# manager and scheduler --feature-gates WatchListClient=false (they replace client-go's gates
# with their own), and the apiserver --feature-gates WatchList=false: with it on, the apiserver
# turns every watch from resourceVersion 0 into a streaming list and refuses it; kwok watches
# that way, so its informers failed and relisted with backoff (pods took 1-60 s to turn Ready).
#
# kwok plays the kubelet: fake nodes turn Ready, scheduled pods turn Running and Ready at once
# (no container is run, so no probe is ever executed), Job pods succeed, and a deleted pod
# disappears KWOK_POD_DELETE_DELAY_MS (default 2000) after its deletion was requested, standing
# in for a container that takes that long to stop on SIGTERM (a force delete, grace period 0,
# removes it at once).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NODES="${KWOK_NODES:-3}"
POD_DELETE_DELAY_MS="${KWOK_POD_DELETE_DELAY_MS:-2000}"
export KUBE_FEATURE_WatchListClient=false

log() { echo "cluster: $*" >&2; }
die() { log "$*"; exit 1; }

usage() { die "usage: $0 up|down DIR"; }
(($# == 2)) || usage
cmd="$1"
mkdir -p "$2"
DIR="$(cd "$2" && pwd)"

# pid files: DIR/pids/NAME. A pid is only signalled while /proc/PID/cmdline still names DIR,
# so a recycled pid of some other process is never touched.
ours() {
    local pid="$1"
    [[ -r "/proc/$pid/cmdline" ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$DIR/"
}

down() {
    local f pid name waited
    [[ -d "$DIR/pids" ]] || { log "nothing running under $DIR"; return 0; }
    # Reverse start order: kwok and the controllers before the apiserver, etcd last.
    for name in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do
        f="$DIR/pids/$name"
        [[ -f "$f" ]] || continue
        pid="$(cat "$f")"
        if ours "$pid"; then
            kill -TERM "$pid" 2>/dev/null || true
            waited=0
            while ours "$pid" && ((waited < 100)); do sleep 0.1; waited=$((waited + 1)); done
            if ours "$pid"; then
                kill -KILL "$pid" 2>/dev/null || true
                log "$name ($pid) did not stop on SIGTERM in 10s: killed"
            fi
        fi
        rm -f "$f"
    done
    log "stopped everything under $DIR"
}

free_ports() {  # free_ports N: N distinct free TCP ports on 127.0.0.1, one a line
    python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
for s in socks:
    print(s.getsockname()[1])
    s.close()
EOF
}

start() {  # start NAME COMMAND...: detached, output to DIR/logs/NAME.log, pid to DIR/pids/NAME
    local name="$1"; shift
    setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$DIR/pids/$name"
}

wait_for() {  # wait_for WHAT SECONDS COMMAND...
    local what="$1" limit="$2" deadline; shift 2
    deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            log "$what not ready after ${limit}s; last log lines:"
            tail -n 30 "$DIR/logs/"*.log >&2 || true
            return 1
        fi
        sleep 0.3
    done
}

alive() {  # alive NAME: the process is still running
    local pid
    pid="$(cat "$DIR/pids/$1" 2>/dev/null)" && ours "$pid"
}

pki() {
    local p="$DIR/pki"
    mkdir -p "$p"
    cd "$p"
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout ca.key -out ca.crt \
        -subj "/CN=slotbridge-e2e-ca" 2>/dev/null
    cat >apiserver.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
    openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr \
        -subj "/CN=kube-apiserver" 2>/dev/null
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' >client.ext
    # system:masters: the admin kubeconfig shared by the test, the controllers and kwok.
    openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr \
        -subj "/O=system:masters/CN=slotbridge-e2e-admin" 2>/dev/null
    openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
        -extfile client.ext -out admin.crt 2>/dev/null
    # The service-account token signing key.
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    cd - >/dev/null
}

kubeconfig() {
    local p="$DIR/pki"
    cat >"$DIR/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $(base64 -w0 "$p/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $(base64 -w0 "$p/admin.crt")
    client-key-data: $(base64 -w0 "$p/admin.key")
contexts:
- name: e2e
  context: {cluster: e2e, user: admin}
current-context: e2e
EOF
}

kwok_config() {
    local stages="$1" f
    # Stages only: a KwokConfiguration document here would replace kwok's option defaults
    # (parallelism 0 and the like); options go on the command line.
    {
        for f in node-initialize node-heartbeat pod-ready pod-complete; do
            cat "$stages/$f.yaml"
            echo "---"
        done
        # kwok's fast pod-delete stage, with a delay: the container "stops" this long after
        # the deletion request (a force delete sets no grace period and is immediate).
        cat <<EOF
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
  delay:
    durationMilliseconds: $POD_DELETE_DELAY_MS
  next:
    delete: true
EOF
    } >"$DIR/kwok.yaml"
}

nodes_manifest() {
    local i
    for ((i = 0; i < NODES; i++)); do
        cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-$i
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: kwok-node-$i
    topology.kubernetes.io/zone: zone-$i
spec: {}
status:
  allocatable: {cpu: "32", memory: 256Gi, pods: "110", ephemeral-storage: 1Ti}
  capacity: {cpu: "32", memory: 256Gi, pods: "110", ephemeral-storage: 1Ti}
EOF
    done
}

up() {
    local CACHE BIN t0 missing=() b
    t0="$(date +%s.%N)"
    CACHE="$(cd "$ROOT" && python3 -m slotbridge_dev.bootstrap --print-cache)"
    BIN="$CACHE/k8s/bin"
    for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok; do
        [[ -x "$BIN/$b" ]] || missing+=("$b")
    done
    ((${#missing[@]} == 0)) || die "${missing[*]} not in $BIN: run helm/ci/k8s-tools.sh"
    [[ -s "$CACHE/k8s/kwok-stages/pod-ready.yaml" ]] || die "kwok stages missing: run helm/ci/k8s-tools.sh"
    if [[ -d "$DIR/pids" ]] && compgen -G "$DIR/pids/*" >/dev/null; then
        die "$DIR already has a cluster (pids/); run: $0 down $DIR"
    fi
    mkdir -p "$DIR/logs" "$DIR/pids"
    rm -rf "$DIR/etcd"
    UP_DONE=0
    trap 'if ((UP_DONE == 0)); then log "bring-up failed; stopping what started"; down; fi' EXIT

    local ports
    mapfile -t ports < <(free_ports 5)
    ETCD_PORT="${ports[0]}"; ETCD_PEER_PORT="${ports[1]}"; API_PORT="${ports[2]}"
    KCM_PORT="${ports[3]}"; SCHED_PORT="${ports[4]}"
    printf 'ETCD_PORT=%s\nETCD_PEER_PORT=%s\nAPI_PORT=%s\nKCM_PORT=%s\nSCHED_PORT=%s\n' \
        "$ETCD_PORT" "$ETCD_PEER_PORT" "$API_PORT" "$KCM_PORT" "$SCHED_PORT" >"$DIR/ports.env"

    pki
    kubeconfig
    kwok_config "$CACHE/k8s/kwok-stages"
    local p="$DIR/pki" kc="$DIR/kubeconfig" kubectl=("$BIN/kubectl" --kubeconfig "$DIR/kubeconfig")

    local etcd_extra=()
    # --unsafe-no-fsync (etcd 3.5+) when the etcd has it; Debian's 3.4.23 does not list it.
    if "$BIN/etcd" --help 2>&1 | grep -q -- '--unsafe-no-fsync'; then etcd_extra+=(--unsafe-no-fsync); fi
    start etcd "$BIN/etcd" --name e2e --data-dir "$DIR/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "e2e=http://127.0.0.1:$ETCD_PEER_PORT" \
        --log-level warn "${etcd_extra[@]}"
    wait_for etcd 30 curl -sf "http://127.0.0.1:$ETCD_PORT/health"

    start kube-apiserver "$BIN/kube-apiserver" \
        --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
        --tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" \
        --client-ca-file "$p/ca.crt" \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-account-key-file "$p/sa.pub" \
        --service-account-signing-key-file "$p/sa.key" \
        --service-cluster-ip-range 10.96.0.0/16 \
        --authorization-mode RBAC \
        --enable-admission-plugins NamespaceLifecycle,LimitRanger,ServiceAccount,PodSecurity,DefaultStorageClass,DefaultTolerationSeconds,ResourceQuota,StorageObjectInUseProtection,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook \
        --allow-privileged=false --profiling=false --feature-gates WatchList=false \
        --cert-dir "$DIR/pki/apiserver-generated" ${KUBE_APISERVER_EXTRA_ARGS:-}
    wait_for kube-apiserver 60 "${kubectl[@]}" get --raw /readyz

    start kube-controller-manager "$BIN/kube-controller-manager" \
        --kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
        --bind-address 127.0.0.1 --secure-port "$KCM_PORT" --cert-dir "$DIR/pki/kcm-generated" \
        --leader-elect=false --use-service-account-credentials=true \
        --service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
        --cluster-signing-cert-file "$p/ca.crt" --cluster-signing-key-file "$p/ca.key" \
        --node-monitor-grace-period 120s --profiling=false --feature-gates WatchListClient=false
    start kube-scheduler "$BIN/kube-scheduler" \
        --kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
        --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" --cert-dir "$DIR/pki/sched-generated" \
        --leader-elect=false --profiling=false --feature-gates WatchListClient=false
    start kwok "$BIN/kwok" --kubeconfig "$kc" --config "$DIR/kwok.yaml" \
        --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
        --node-ip 127.0.0.1 --cidr 10.244.0.1/16

    wait_for kube-controller-manager 60 curl -sfk "https://127.0.0.1:$KCM_PORT/healthz"
    wait_for kube-scheduler 60 curl -sfk "https://127.0.0.1:$SCHED_PORT/healthz"
    for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do
        alive "$b" || { tail -n 30 "$DIR/logs/$b.log" >&2; die "$b exited"; }
    done

    nodes_manifest | "${kubectl[@]}" apply -f - >/dev/null
    wait_for "kwok nodes Ready" 60 "${kubectl[@]}" wait --for=condition=Ready nodes --all --timeout=1s
    # The node lifecycle controller tainted the nodes not-ready before kwok made them Ready.
    "${kubectl[@]}" taint nodes --all node.kubernetes.io/not-ready- >/dev/null 2>&1 || true
    # Pods need their namespace's default ServiceAccount (made by the controller-manager).
    wait_for "default ServiceAccount" 60 "${kubectl[@]}" -n default get serviceaccount default
    UP_DONE=1

    local took
    took="$(python3 -c "import sys,time; print(f'{time.time()-float(sys.argv[1]):.1f}')" "$t0")"
    echo "$took" >"$DIR/bringup-seconds"
    log "up in ${took}s: apiserver https://127.0.0.1:$API_PORT, $NODES kwok nodes, kubeconfig $DIR/kubeconfig"
    echo "$DIR/kubeconfig"
}

case "$cmd" in
    up) up ;;
    down) down ;;
    *) usage ;;
esac
