#!/usr/bin/env bash
# Install the pinned helm binary into the project cache (idempotent).
#
#   helm/ci/install-tools.sh        # prints the path of the helm binary on its last line
#
# helm is a Go module, so it is built with `go install` through the Go module proxy into
# $(python3 -m slotbridge_dev.bootstrap --print-cache)/bin. A second run with the right
# version already there does nothing. kubernetes-validate is not installed here: it is a
# dev dependency of the project and lives in .venv (python3 -m slotbridge_dev.bootstrap).
set -euo pipefail

HELM_VERSION="v3.22.0"
# The Kubernetes version helm assumes without a cluster (helm template, helm lint): helm's
# release builds set it with -ldflags from the k8s.io/client-go version they are built with
# (v0.37 for helm v3.22.0); a plain go install would otherwise say 1.20.
KUBE_MINOR="37"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="$(cd "$ROOT" && python3 -m slotbridge_dev.bootstrap --print-cache)"
BIN="$CACHE/bin"
HELM="$BIN/helm"

if ! command -v go >/dev/null 2>&1; then
    echo "install-tools: go is missing; install Go (helm is built with go install)" >&2
    exit 1
fi

# The build info of an installed binary names its module version and -ldflags.
info=""
if [[ -x "$HELM" ]]; then
    info="$(go version -m "$HELM" 2>/dev/null || true)"
fi
if [[ "$info" =~ [[:space:]]mod[[:space:]]+helm\.sh/helm/v3[[:space:]]+${HELM_VERSION//./\\.}[[:space:]] \
      && "$info" == *"chartutil.k8sVersionMinor=$KUBE_MINOR"* ]]; then
    echo "install-tools: helm $HELM_VERSION already in $BIN" >&2
else
    mkdir -p "$BIN"
    echo "install-tools: go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION -> $BIN" >&2
    started=$SECONDS
    # -ldflags: what `helm version` prints and the default Kubernetes version, set
    # the way helm's own release builds set them.
    GOBIN="$BIN" go install \
        -ldflags "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
                  -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
                  -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$KUBE_MINOR \
                  -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 \
                  -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$KUBE_MINOR" \
        "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
    echo "install-tools: helm $HELM_VERSION built in $((SECONDS - started))s" >&2
fi
echo "$HELM"
