#!/bin/bash
# Entrypoint of the slotbridge image.
#
#   <image> run --config FILE                  -> slotbridge run --config FILE
#   <image> driver|executor ...                -> Spark on Kubernetes (the Spark operator)
#
# The driver/executor branches follow Apache Spark's own Kubernetes entrypoint
# (resource-managers/kubernetes/docker/src/main/dockerfiles/spark/entrypoint.sh): the
# operator starts pods with those arguments and the SPARK_* variables they read.
set -eo pipefail

case "${1:-}" in
  driver)
    shift
    exec "$SPARK_HOME/bin/spark-submit" \
      --conf "spark.driver.bindAddress=${SPARK_DRIVER_BIND_ADDRESS}" \
      --deploy-mode client \
      "$@"
    ;;
  executor)
    shift
    mapfile -t java_opts < <(env | grep '^SPARK_JAVA_OPT_' | sort -t_ -k4 -n | sed 's/[^=]*=\(.*\)/\1/')
    # SPARK_CLASSPATH carries spark.executor.extraClassPath; the conf folder goes first.
    classpath="${SPARK_CLASSPATH:+${SPARK_CLASSPATH}:}${SPARK_HOME}/jars/*"
    if [[ -n "${SPARK_EXTRA_CLASSPATH:-}" ]]; then
      classpath="${classpath}:${SPARK_EXTRA_CLASSPATH}"
    fi
    classpath="${SPARK_CONF_DIR:-${SPARK_HOME}/conf}:${classpath}"
    exec "${JAVA_HOME}/bin/java" "${java_opts[@]}" \
      -Xms"${SPARK_EXECUTOR_MEMORY}" -Xmx"${SPARK_EXECUTOR_MEMORY}" \
      -cp "${classpath}" \
      org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
      --driver-url "${SPARK_DRIVER_URL}" \
      --executor-id "${SPARK_EXECUTOR_ID}" \
      --cores "${SPARK_EXECUTOR_CORES}" \
      --app-id "${SPARK_APPLICATION_ID}" \
      --hostname "${SPARK_EXECUTOR_POD_IP}" \
      --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID}" \
      --podName "${SPARK_EXECUTOR_POD_NAME}"
    ;;
  *)
    exec slotbridge "$@"
    ;;
esac
