#!/usr/bin/env bash
# Run the built images the way the chart starts them (tini -> entrypoint.sh, user 10001)
# and check what each must and must not hold.
#
#   helm/ci/check-images.sh                      # localhost/slotbridge{,-spark}:<appVersion>
#   BRIDGE_IMAGE=... SPARK_IMAGE=... helm/ci/check-images.sh
#
# podman runs with runc and explicit ulimits (the defaults podman derives from this machine
# are refused by runc). Prints PASS/FAIL per check; exits 1 if any check failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TAG="${TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/helm/slotbridge/Chart.yaml")}"
BRIDGE_IMAGE="${BRIDGE_IMAGE:-localhost/slotbridge:$TAG}"
SPARK_IMAGE="${SPARK_IMAGE:-localhost/slotbridge-spark:$TAG}"
RUN=(podman --runtime runc run --rm --ulimit nofile=4096:4096 --ulimit nproc=4096:4096)
failed=0

check() {  # check <description> <expected regex in output> <podman run args...>
    local what="$1" want="$2" out rc
    shift 2
    out="$("${RUN[@]}" "$@" 2>&1)"; rc=$?
    if [[ $rc -eq 0 ]] && grep -Eq -- "$want" <<<"$out"; then
        echo "PASS $what"
    else
        echo "FAIL $what (exit $rc)"; sed 's/^/    /' <<<"$out" | tail -20; failed=1
    fi
    [[ -n "${VERBOSE:-}" ]] && sed 's/^/    | /' <<<"$out"
}

for image in "$BRIDGE_IMAGE" "$SPARK_IMAGE"; do
    check "$image: --help (the chart's default command)" "Usage: slotbridge" "$image" --help
    check "$image: slotbridge --version" "slotbridge, version $TAG" "$image" --version
    check "$image: runs as 10001:10001" "^10001:10001$" \
        --entrypoint /bin/sh "$image" -c 'echo "$(id -u):$(id -g)"'
    config="$(podman image inspect --format '{{json .Config.Entrypoint}} {{.Config.User}}' "$image")"
    if [[ "$config" == '["/usr/bin/tini","--","/opt/slotbridge/entrypoint.sh"] 10001:10001' ]]; then
        echo "PASS $image: entrypoint tini -> entrypoint.sh, user 10001:10001"
    else
        echo "FAIL $image: entrypoint/user are $config"; failed=1
    fi
    # The development tools (slotbridge_dev: local stack, demo) are not in the images.
    check "$image: no development tools" "^absent$" --entrypoint /bin/sh "$image" -c \
        'python -c "import importlib.util as u; print(\"absent\" if u.find_spec(\"slotbridge_dev\") is None else \"present\")"'
done
check "$BRIDGE_IMAGE: run --help" "--config" "$BRIDGE_IMAGE" run --help
check "$BRIDGE_IMAGE: failover watch --help" "Usage: slotbridge failover watch" \
    "$BRIDGE_IMAGE" failover watch --help
check "$BRIDGE_IMAGE: failover promote --help" "Usage: slotbridge failover promote" \
    "$BRIDGE_IMAGE" failover promote --help
check "$BRIDGE_IMAGE: failover check --help" "Usage: slotbridge failover check" \
    "$BRIDGE_IMAGE" failover check --help
# The watcher as the chart starts it (its settings file, http on 0.0.0.0:9188), with no
# database to reach: /healthz must answer while its checks fail (readiness says why).
check "$BRIDGE_IMAGE: failover watch serves /healthz" '^200 ' --entrypoint /bin/sh "$BRIDGE_IMAGE" -c '
printf "primary: {dsn: \"host=127.0.0.1 port=1 connect_timeout=1\"}\nstandbys: {s1: {dsn: \"host=127.0.0.1 port=2 connect_timeout=1\"}}\nhttp_host: 0.0.0.0\nhttp_port: 9188\n" > /tmp/failover.yaml
/opt/slotbridge/entrypoint.sh failover watch --config /tmp/failover.yaml >/tmp/watch.log 2>&1 &
for _ in $(seq 1 30); do
  python -c "import urllib.request as u; r = u.urlopen(\"http://127.0.0.1:9188/healthz\", timeout=2); print(r.status, r.read().decode())" 2>/dev/null && exit 0
  sleep 1
done
cat /tmp/watch.log; exit 1'
check "$BRIDGE_IMAGE: no Java, no pyspark" "^clean$" --entrypoint /bin/sh "$BRIDGE_IMAGE" -c \
    '! command -v java >/dev/null && ! python -c "import pyspark" 2>/dev/null && echo clean'

check "$SPARK_IMAGE: consume --help" "Usage: slotbridge consume" "$SPARK_IMAGE" consume --help
check "$SPARK_IMAGE: consumer-main.py resolves inside the image" \
    "^/opt/slotbridge/venv/lib/python3.11/site-packages/spark_consumers/main.py$" \
    --entrypoint /bin/sh "$SPARK_IMAGE" -c \
    'test -f "$(readlink -f /opt/slotbridge/consumer-main.py)" && readlink -f /opt/slotbridge/consumer-main.py'
# consumer-main.py has no --help: two arguments make it print its usage (exit 2) after all
# its imports (pyspark, delta, the settings) succeeded.
check "$SPARK_IMAGE: python /opt/slotbridge/consumer-main.py (usage)" \
    "usage: main.py \\[CONFIG\\] \\[--once\\] \\[--fail-on-quarantine\\]" \
    --entrypoint /bin/sh "$SPARK_IMAGE" -c \
    'python /opt/slotbridge/consumer-main.py a b; test $? -eq 2'
check "$SPARK_IMAGE: java 17" 'version "17' --entrypoint java "$SPARK_IMAGE" -version
check "$SPARK_IMAGE: spark-submit --version" "version 4\.0\.0" \
    --entrypoint /bin/sh "$SPARK_IMAGE" -c '"$SPARK_HOME/bin/spark-submit" --version'
check "$SPARK_IMAGE: S3A, ABFS, Kafka and Delta jars" "^ok$" --entrypoint /bin/sh "$SPARK_IMAGE" -c \
    'cd /opt/slotbridge/jars/spark && ls hadoop-aws-*.jar hadoop-azure-*.jar bundle-*.jar \
       spark-sql-kafka-0-10_*.jar delta-spark_*.jar >/dev/null && echo ok'
check "$SPARK_IMAGE: S3A and ABFS file systems load in the JVM" "^S3AFileSystem AzureBlobFileSystem$" \
    --entrypoint python "$SPARK_IMAGE" -c '
import glob
from pyspark.sql import SparkSession
jars = ",".join(sorted(glob.glob("/opt/slotbridge/jars/spark/*.jar")))
s = SparkSession.builder.master("local[1]").config("spark.jars", jars).getOrCreate()
jvm = s.sparkContext._jvm
names = [jvm.java.lang.Class.forName(c, True, jvm.Thread.currentThread().getContextClassLoader()).getSimpleName()
         for c in ("org.apache.hadoop.fs.s3a.S3AFileSystem", "org.apache.hadoop.fs.azurebfs.AzureBlobFileSystem")]
print(" ".join(names))
s.stop()'

echo "sizes:"
podman images --format '{{.Repository}}:{{.Tag}}  {{.Size}}' "$BRIDGE_IMAGE" "$SPARK_IMAGE" 2>/dev/null \
    || podman images --filter "reference=localhost/slotbridge*" --format '{{.Repository}}:{{.Tag}}  {{.Size}}'
exit "$failed"
