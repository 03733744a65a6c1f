{{/*
Chart name, truncated to the 63 characters of a DNS label.
*/}}
{{- define "slotbridge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: release name plus chart name (unless the release name already holds it).
*/}}
{{- define "slotbridge.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "slotbridge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Standard labels. Call with (dict "ctx" $ "component" "bridge").
*/}}
{{- define "slotbridge.labels" -}}
helm.sh/chart: {{ include "slotbridge.chart" .ctx }}
{{ include "slotbridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: slotbridge
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels (immutable on workloads: keep them minimal). Call with
(dict "ctx" $ "component" "bridge" "slot" "orders"); slot is optional.
*/}}
{{- define "slotbridge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slotbridge.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .slot }}
slotbridge.io/slot: {{ .slot | replace "_" "-" | quote }}
{{- end }}
{{- end }}

{{/*
Resource name of the bridge of one slot: <fullname>-<slot with _ as ->. Refuses names
longer than a DNS label instead of truncating them, so two slots can never collide.
*/}}
{{- define "slotbridge.bridgeName" -}}
{{- if has .slot (list "bridge" "consumer" "failover" "failover_watch" "promote" "spark") }}
{{- fail (printf "bridge.slots: slot name %q would give the bridge the name of another of the chart's resources; choose another slot name" .slot) }}
{{- end }}
{{- $name := printf "%s-%s" (include "slotbridge.fullname" .ctx) (.slot | replace "_" "-") }}
{{- if gt (len $name) 52 }}
{{- fail (printf "bridge name %q is longer than 52 characters (the StatefulSet pod name must stay a DNS label): use a shorter release name, fullnameOverride or slot name" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{- define "slotbridge.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "slotbridge.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image references: "slotbridge.image" (bridge, failover watcher and runbook; values.image)
and "slotbridge.sparkImage" (the consumer; values.sparkImage). A digest wins over the tag.
*/}}
{{- define "slotbridge.imageRef" -}}
{{- $image := index .ctx.Values .key }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .ctx.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{- define "slotbridge.image" -}}
{{- include "slotbridge.imageRef" (dict "ctx" . "key" "image") }}
{{- end }}

{{- define "slotbridge.sparkImage" -}}
{{- include "slotbridge.imageRef" (dict "ctx" . "key" "sparkImage") }}
{{- end }}

{{/*
Pod-level settings shared by every pod. Call with (dict "ctx" $ "pod" .Values.bridge).
*/}}
{{- define "slotbridge.podCommon" -}}
serviceAccountName: {{ include "slotbridge.serviceAccountName" .ctx }}
automountServiceAccountToken: {{ .ctx.Values.serviceAccount.automountServiceAccountToken }}
securityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
secretKeyRef env var, only when the Secret is named. Call with
(dict "env" "SLOTBRIDGE_SOURCE_PASSWORD" "ref" .Values.bridge.sourcePassword).
*/}}
{{- define "slotbridge.secretEnv" -}}
{{- if and .ref .ref.name }}
- name: {{ .env }}
  valueFrom:
    secretKeyRef:
      name: {{ .ref.name }}
      key: {{ .ref.key }}
{{- end }}
{{- end }}

{{/*
The bridge settings of one slot: the shared config, the slot's own config over it, and
the keys the chart owns. Call with (dict "ctx" $ "slot" $slot).
*/}}
{{- define "slotbridge.bridgeConfig" -}}
{{- $config := mergeOverwrite (deepCopy .ctx.Values.bridge.config) (deepCopy (.slot.config | default dict)) }}
{{- $_ := set $config "slot_name" .slot.name }}
{{- /* Scoped to the release: bridges of other releases on the same Kafka cluster (another
database, the same slot name) must not fence this one. */}}
{{- $_ = set $config "kafka_transactional_id" (printf "slotbridge.%s.%s.%s" .ctx.Release.Namespace (include "slotbridge.fullname" .ctx) .slot.name) }}
{{- $_ = set $config "http_host" "0.0.0.0" }}
{{- $_ = set $config "http_port" (int .ctx.Values.bridge.port) }}
{{- $_ = set $config "spool_dir" "/var/spool/slotbridge" }}
{{- toYaml $config }}
{{- end }}

{{/*
The failover settings (shared by the watcher and the runbook Job).
*/}}
{{- define "slotbridge.failoverConfig" -}}
{{- $config := deepCopy .Values.failover.config }}
{{- if and .Values.bridge.enabled (not (hasKey $config "bridge_slots")) }}
{{- $slots := list }}
{{- range .Values.bridge.slots }}
{{- $slots = append $slots .name }}
{{- end }}
{{- $_ := set $config "bridge_slots" $slots }}
{{- end }}
{{- $_ := set $config "http_host" "0.0.0.0" }}
{{- $_ = set $config "http_port" (int .Values.failover.watch.port) }}
{{- toYaml $config }}
{{- end }}

{{/*
Node password env vars of the failover service.
*/}}
{{- define "slotbridge.failoverPasswordEnv" -}}
{{- $p := .Values.failover.passwords }}
{{- include "slotbridge.secretEnv" (dict "env" "SLOTBRIDGE_PRIMARY__PASSWORD" "ref" $p.primary) }}
{{- range $node, $ref := $p.standbys }}
{{- if not (hasKey $.Values.failover.config.standbys $node) }}
{{- fail (printf "failover.passwords.standbys.%s: no such standby in failover.config.standbys" $node) }}
{{- end }}
{{- include "slotbridge.secretEnv" (dict "env" (printf "SLOTBRIDGE_STANDBYS__%s__PASSWORD" (upper $node)) "ref" $ref) }}
{{- end }}
{{- range $node, $ref := $p.subscribers }}
{{- if not (hasKey ($.Values.failover.config.subscribers | default dict) $node) }}
{{- fail (printf "failover.passwords.subscribers.%s: no such subscriber in failover.config.subscribers" $node) }}
{{- end }}
{{- include "slotbridge.secretEnv" (dict "env" (printf "SLOTBRIDGE_SUBSCRIBERS__%s__PASSWORD" (upper $node)) "ref" $ref) }}
{{- end }}
{{- end }}

{{/*
The consumer settings. In local mode the job starts Spark itself (master, jars from the
image); under the Spark operator spark-submit decides the master and the classpath.
*/}}
{{- define "slotbridge.consumerConfig" -}}
{{- $config := deepCopy .Values.consumer.config }}
{{- $_ := set $config "http_host" "0.0.0.0" }}
{{- $_ = set $config "http_port" (int .Values.consumer.port) }}
{{- if not .Values.consumer.sparkOperator.enabled }}
{{- $_ = set $config "jars_dir" "/opt/slotbridge/jars/spark" }}
{{- $_ = set $config "spark_master" .Values.consumer.localMaster }}
{{- $_ = set $config "status_path" "/tmp/slotbridge/consumer-status.json" }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/*
HTTP probes on the named port "http". Call with (dict "probe" .Values.bridge.livenessProbe
"path" "/healthz").
*/}}
{{- define "slotbridge.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: http
{{- toYaml .probe | nindent 0 }}
{{- end }}

{{/*
What the Spark operator's driver and executor pods share: the Spark ServiceAccount (the
executors' too, so an IAM role annotated on it reaches the code that writes the
warehouse), the consumer's scheduling, labels, environment and volumes. Call with
(dict "ctx" $ "labels" $labels "config" true); config: mount the settings (driver only).
*/}}
{{- define "slotbridge.sparkPod" -}}
{{- $c := .ctx.Values.consumer -}}
serviceAccount: {{ include "slotbridge.fullname" .ctx }}-spark
labels:
  {{- .labels | nindent 2 }}
  {{- with $c.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $c.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .ctx.Values.containerSecurityContext | nindent 2 }}
podSecurityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
{{- with $c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.env }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  {{- if .config }}
  - name: config
    mountPath: /etc/slotbridge
    readOnly: true
  {{- end }}
  - name: tmp
    mountPath: /tmp
  {{- if $c.dataClaim }}
  - name: data
    mountPath: /var/lib/slotbridge
  {{- end }}
  {{- with $c.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
