#!/usr/bin/env bash
# Chart checks for CI: helm lint --strict, helm template and offline kubernetes-validate
# --strict, for every values file in helm/ci/*-values.yaml. Installs helm first if missing.
#
#   helm/ci/check.sh
#
# Kinds that are CRDs (ServiceMonitor, PrometheusRule, SparkApplication) have no schema in
# kubernetes-validate and are left out of validation explicitly; everything else must pass.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CHART="$ROOT/helm/slotbridge"
PY="$ROOT/.venv/bin/python"
KUBE_VERSIONS=(1.30.0 1.37.0)          # the chart's kubeVersion floor and a current release
SKIP_KINDS="ServiceMonitor,PrometheusRule,SparkApplication"

HELM="$("$ROOT/helm/ci/install-tools.sh")"
if [[ ! -x "$ROOT/.venv/bin/kubernetes-validate" ]]; then
    echo "check: kubernetes-validate missing from .venv; run python3 -m slotbridge_dev.bootstrap" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
summary=()
failed=0

step() {  # step NAME COMMAND... : run, remember PASS/FAIL for the summary
    local name="$1"; shift
    if "$@" >"$work/step.log" 2>&1; then
        summary+=("PASS  $name")
    else
        summary+=("FAIL  $name")
        failed=1
        sed 's/^/    /' "$work/step.log" >&2
    fi
}

validate() {  # validate RENDERED VERSION
    "$PY" - "$1" "$work/filtered.yaml" "$SKIP_KINDS" <<'PYEOF'
import sys
import yaml
src, dst, skip = sys.argv[1], sys.argv[2], set(sys.argv[3].split(","))
docs = [d for d in yaml.safe_load_all(open(src)) if d]
kept = [d for d in docs if d["kind"] not in skip]
skipped = sorted({d["kind"] for d in docs if d["kind"] in skip})
with open(dst, "w") as out:
    yaml.safe_dump_all(kept, out, sort_keys=False)
print(f"{len(kept)} objects to validate; not validated (CRDs): {', '.join(skipped) or 'none'}")
PYEOF
    "$ROOT/.venv/bin/kubernetes-validate" --strict --quiet -k "$2" "$work/filtered.yaml"
}

for values in "$ROOT"/helm/ci/*-values.yaml; do
    name="$(basename "$values" .yaml)"
    step "$name: helm lint --strict" "$HELM" lint --strict "$CHART" -f "$values"
    rendered="$work/$name.yaml"
    step "$name: helm template" \
        bash -c '"$1" template slotbridge "$2" -f "$3" --namespace slotbridge --kube-version "$4" > "$5"' \
        _ "$HELM" "$CHART" "$values" "${KUBE_VERSIONS[-1]}" "$rendered"
    for version in "${KUBE_VERSIONS[@]}"; do
        step "$name: kubernetes-validate --strict (Kubernetes $version)" validate "$rendered" "$version"
    done
done

echo
echo "helm chart checks ($("$HELM" version --short)):"
printf '  %s\n' "${summary[@]}"
exit "$failed"
