#!/usr/bin/env bash
# A Delta table written to s3a:// by the Spark image, against a local S3-compatible server
# (moto from PyPI, installed once into the project cache), then read back.
#
#   helm/ci/check-s3.sh          # SPARK_IMAGE=... to check another image
#
# Prints the rows and Delta versions read back; exits 1 unless they are what was written.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="$(cd "$ROOT" && python3 -m slotbridge_dev.bootstrap --print-cache)"
TAG="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$ROOT/helm/slotbridge/Chart.yaml")"
SPARK_IMAGE="${SPARK_IMAGE:-localhost/slotbridge-spark:$TAG}"
MOTO="$CACHE/images/moto"
MOTO_VERSION="5.2.5"

if [[ ! -x "$MOTO/bin/moto_server" ]]; then
    echo "check-s3: installing moto[server]==$MOTO_VERSION into $MOTO" >&2
    python3 -m venv "$MOTO"
    "$MOTO/bin/pip" install -q "moto[server]==$MOTO_VERSION"
fi

WORK="$(mktemp -d)"
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$MOTO/bin/moto_server" -H 127.0.0.1 -p "$PORT" >"$WORK/moto.log" 2>&1 &
MOTO_PID=$!
trap 'kill "$MOTO_PID" 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 1 60); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/', timeout=1)" \
        2>/dev/null && break
    sleep 0.5
done
# CreateBucket: moto does not check signatures.
python3 -c "import urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:$PORT/lake', method='PUT'), timeout=10)"

podman --runtime runc run --rm --network host --ulimit nofile=4096:4096 \
    --ulimit nproc=4096:4096 -e "S3_PORT=$PORT" --entrypoint python "$SPARK_IMAGE" -c '
import glob, os
from pyspark.sql import SparkSession
port = os.environ["S3_PORT"]
s = (SparkSession.builder.master("local[1]")
     .config("spark.jars", ",".join(sorted(glob.glob("/opt/slotbridge/jars/spark/*.jar"))))
     .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
     .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
     .config("spark.hadoop.fs.s3a.endpoint", f"http://127.0.0.1:{port}")
     .config("spark.hadoop.fs.s3a.endpoint.region", "us-east-1")
     .config("spark.hadoop.fs.s3a.path.style.access", "true")
     .config("spark.hadoop.fs.s3a.connection.ssl.enabled", "false")
     .config("spark.hadoop.fs.s3a.access.key", "test")
     .config("spark.hadoop.fs.s3a.secret.key", "test")
     .getOrCreate())
path = "s3a://lake/slotbridge/t"
s.range(100).write.format("delta").save(path)
s.range(100, 110).write.format("delta").mode("append").save(path)
df = s.read.format("delta").load(path)
versions = [r.version for r in s.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()]
rows, top = df.count(), df.agg({"id": "max"}).first()[0]
print(f"rows {rows} max {top} versions {versions}")
s.stop()
raise SystemExit(0 if (rows, top, versions) == (110, 109, [1, 0]) else 1)
' 2>"$WORK/spark.log" || { tail -30 "$WORK/spark.log"; exit 1; }
