#!/usr/bin/env bash
# Build the two slotbridge images without Docker and without a registry.
#
#   helm/ci/build-images.sh              # base (once) + bridge + spark images
#   helm/ci/build-images.sh base         # only the pinned base image
#   helm/ci/build-images.sh bridge       # base (once) + the bridge image
#   helm/ci/build-images.sh spark        # base (once) + the spark image
#   helm/ci/build-images.sh lock         # re-lock helm/image/requirements-*.txt
#
# Images (tag = the chart's appVersion unless TAG is set):
#   localhost/slotbridge:<tag>        the `slotbridge` CLI (bridge, failover watch/promote/check)
#   localhost/slotbridge-spark:<tag>  Java 17, pyspark, the Spark/Delta/S3A/ABFS jars and the
#                                     consumer (/opt/slotbridge/consumer-main.py)
#
# The base is not pulled from a registry (none is reachable here): it is a
# `debootstrap --variant=minbase bookworm` root filesystem with python3, python3-venv and
# ca-certificates, plus this machine's CA bundle (pip and Maven inside the build go through
# it), built once into <cache>/images/ and imported with `podman import` as
# localhost/slotbridge-base:bookworm-<date of the debootstrap>. Its digest is recorded in
# <cache>/images/base.env. Delete <cache>/images/ to rebuild it.
#
# podman runs with runc: crun fails on this machine's cgroups (hybrid mode).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="$(cd "$ROOT" && python3 -m slotbridge_dev.bootstrap --print-cache)"
IMAGES="$CACHE/images"
mkdir -p "$IMAGES"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
WHAT="${1:-all}"
TAG="${TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/helm/slotbridge/Chart.yaml")}"
PODMAN=(podman --runtime runc)

say() { printf '[build-images] %s\n' "$*" >&2; }

# --- tools ---------------------------------------------------------------------------------
missing=()
for tool in podman buildah debootstrap runc; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]} with apt"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        podman buildah debootstrap runc fuse-overlayfs uidmap
fi

# --- lock files ----------------------------------------------------------------------------
# helm/ci/build-images.sh lock: re-resolve helm/image/requirements-{bridge,spark}.txt from
# pyproject.toml with hashes (pip-tools in <cache>/images/pip-tools, run with python3.11 like
# the images; setuptools, the build backend, is locked too so /src builds without the index).
if [[ "$WHAT" == lock ]]; then
    tools="$IMAGES/pip-tools"
    [[ -x "$tools/bin/pip-compile" ]] || { python3 -m venv "$tools" && "$tools/bin/pip" install -q pip-tools; }
    cd "$ROOT"
    for set in bridge spark; do
        extra=(); [[ "$set" == spark ]] && extra=(--extra spark)
        PIP_FIND_LINKS="" CUSTOM_COMPILE_COMMAND="helm/ci/build-images.sh lock" "$tools/bin/pip-compile" -q --generate-hashes --allow-unsafe \
            --strip-extras --all-build-deps --no-emit-index-url --no-emit-find-links \
            "${extra[@]}" \
            -o "helm/image/requirements-$set.txt" pyproject.toml
    done
    exit 0
fi

# --- base ----------------------------------------------------------------------------------
build_base() {
    local rootfs="$IMAGES/rootfs" tarball="$IMAGES/base-rootfs.tar" date
    if [[ ! -f "$tarball" ]]; then
        say "debootstrap --variant=minbase bookworm into $rootfs (several minutes, once)"
        local started=$SECONDS
        rm -rf "$rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$rootfs" "$MIRROR"
        # This machine's CA bundle (with any local CAs): pip reads the bundle; the CAs also go
        # to /usr/local/share/ca-certificates so that update-ca-certificates keeps them and
        # Java's cacerts (built from /etc/ssl/certs when a JRE is installed) trusts them too.
        if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
            cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
            chroot "$rootfs" update-ca-certificates >/dev/null
        fi
        cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
        chroot "$rootfs" apt-get clean
        rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
        date -u +%Y%m%d > "$rootfs/etc/slotbridge-base-date"
        tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" .
        mv "$tarball.tmp" "$tarball"
        rm -rf "$rootfs"
        say "base root filesystem done in $((SECONDS - started)) s"
    fi
    date="$(tar -xOf "$tarball" ./etc/slotbridge-base-date)"
    BASE_IMAGE="localhost/slotbridge-base:bookworm-$date"
    if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
        say "podman import $tarball as $BASE_IMAGE"
        "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' \
            --message "debootstrap --variant=minbase bookworm, $date" "$tarball" "$BASE_IMAGE"
    fi
    BASE_DIGEST="$("${PODMAN[@]}" image inspect --format '{{.Digest}}' "$BASE_IMAGE")"
    BASE_ID="$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$BASE_IMAGE")"
    printf 'BASE_IMAGE=%s\nBASE_DIGEST=%s\nBASE_ID=%s\n' "$BASE_IMAGE" "$BASE_DIGEST" "$BASE_ID" \
        > "$IMAGES/base.env"
    say "base $BASE_IMAGE digest $BASE_DIGEST id $BASE_ID"
}
build_base
[[ "$WHAT" == base ]] && exit 0

# --- images --------------------------------------------------------------------------------
# BASE_IMAGE is the dated local tag (base.env has its digest). --network host: the build fetches from PyPI, Debian and Maven Central.
# The image the tag left behind is removed: every rebuild would otherwise keep one more
# untagged image of 0.2-2 GB (the layer cache, which CI's next build uses, stays).
build() {  # build <name> <dockerfile> <image>
    local started=$SECONDS old new
    old="$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$3" 2>/dev/null || true)"
    say "building $3 from $2"
    "${PODMAN[@]}" build --network host --layers \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" \
        --ignorefile "$ROOT/helm/Dockerfile.bridge.dockerignore" \
        -f "$ROOT/$2" -t "$3" "$ROOT"
    new="$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$3")"
    if [[ -n "$old" && "$old" != "$new" ]]; then
        "${PODMAN[@]}" rmi "$old" >/dev/null 2>&1 \
            && say "removed the replaced image ${old:0:12}" \
            || say "kept the replaced image ${old:0:12} (in use)"
    fi
    say "$1 image built in $((SECONDS - started)) s"
}
case "$WHAT" in
    all|bridge) build bridge helm/Dockerfile.bridge "localhost/slotbridge:$TAG" ;;&
    all|spark) build spark helm/Dockerfile.spark "localhost/slotbridge-spark:$TAG" ;;
    bridge) ;;
    *) say "unknown target $WHAT (all, base, bridge, spark)"; exit 2 ;;
esac

say "sizes:"
"${PODMAN[@]}" images --filter "reference=localhost/slotbridge*" \
    --format '{{.Repository}}:{{.Tag}}  {{.Size}}  {{.ID}}' >&2
