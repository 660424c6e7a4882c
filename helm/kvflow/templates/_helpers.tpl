{{/* Chart name. */}}
{{- define "kvflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name, used as the prefix of every resource. */}}
{{- define "kvflow.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Common labels. */}}
{{- define "kvflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvflow.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvflow
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels / selector labels of one component: (dict "ctx" $ "component" "router"). */}}
{{- define "kvflow.componentLabels" -}}
{{ include "kvflow.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvflow.componentSelector" -}}
{{ include "kvflow.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image of a role: (dict "ctx" $ "role" .Values.router). */}}
{{- define "kvflow.image" -}}
{{- $img := merge (deepCopy (default (dict) .role.image)) (deepCopy .ctx.Values.image) -}}
{{- printf "%s:%s" $img.repository (default .ctx.Chart.AppVersion $img.tag | toString) }}
{{- end }}

{{- define "kvflow.imagePullPolicy" -}}
{{- $img := merge (deepCopy (default (dict) .role.image)) (deepCopy .ctx.Values.image) -}}
{{- $img.pullPolicy }}
{{- end }}

{{- define "kvflow.routerServiceAccountName" -}}
{{- printf "%s-router" (include "kvflow.fullname" .) }}
{{- end }}

{{- define "kvflow.workerServiceAccountName" -}}
{{- printf "%s-worker" (include "kvflow.fullname" .) }}
{{- end }}

{{/* Secret name / key holding the Redis password, empty when there is none. */}}
{{- define "kvflow.redisSecretName" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- default (printf "%s-redis" (include "kvflow.fullname" .)) .Values.redis.auth.existingSecret }}
{{- else if eq .Values.redis.mode "external" }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "kvflow.redisSecretKey" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- .Values.redis.auth.existingSecretPasswordKey }}
{{- else }}
{{- .Values.redis.external.existingSecretPasswordKey }}
{{- end }}
{{- end }}

{{/*
Index URL handed to --index.  "$(KVFLOW_REDIS_PASSWORD)" is expanded by the
kubelet from the env var defined before it, so no password is in the pod spec.
*/}}
{{- define "kvflow.indexUrl" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- printf "redis://:$(KVFLOW_REDIS_PASSWORD)@%s-redis:6379/0" (include "kvflow.fullname" .) }}
{{- else if eq .Values.redis.mode "external" }}
{{- if not .Values.redis.external.url }}
{{- fail "redis.mode=external requires redis.external.url" }}
{{- end }}
{{- if and .Values.redis.external.existingSecret (not (contains "@" .Values.redis.external.url)) }}
{{- regexReplaceAll "^(rediss?://)" .Values.redis.external.url "${1}:$$(KVFLOW_REDIS_PASSWORD)@" }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- else -}}
memory
{{- end }}
{{- end }}

{{/* Env vars carrying the index settings, shared by the router and the workers. */}}
{{- define "kvflow.indexEnv" -}}
{{- $secret := include "kvflow.redisSecretName" . }}
{{- if $secret }}
- name: KVFLOW_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "kvflow.redisSecretKey" . }}
{{- end }}
- name: KVFLOW_INDEX_URL
  value: {{ include "kvflow.indexUrl" . | quote }}
{{- end }}

{{/* Secret holding the cluster token: the operator's, or the one the chart generates. */}}
{{- define "kvflow.clusterTokenSecretName" -}}
{{- default (printf "%s-cluster-token" (include "kvflow.fullname" .)) .Values.clusterAuth.existingSecret }}
{{- end }}

{{/* Env var carrying the cluster token, shared by the router and the workers. */}}
{{- define "kvflow.clusterTokenEnv" -}}
- name: KVFLOW_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvflow.clusterTokenSecretName" . }}
      key: {{ .Values.clusterAuth.existingSecretKey }}
{{- end }}

{{/* Shared engineArgs overlaid with the role's (a null in the role's map survives, to drop a flag), as JSON. */}}
{{- define "kvflow.engineArgs" -}}
{{- $args := dict }}
{{- range $key, $value := (default (dict) .ctx.Values.engineArgs) }}
{{- $_ := set $args $key $value }}
{{- end }}
{{- range $key, $value := (default (dict) .role.engineArgs) }}
{{- $_ := set $args $key $value }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/*
Engine argument lines of a worker role, one token per line:
(dict "ctx" $ "role" .Values.prefill).  Shared engineArgs are overridden by the
role's; true -> --key, false -> --no-key, null -> omitted; whole-number floats
are printed as integers (YAML numbers arrive as float64).
*/}}
{{- define "kvflow.engineArgLines" -}}
{{- $args := include "kvflow.engineArgs" . | fromJson -}}
{{- range $key, $value := $args }}
{{- if kindIs "invalid" $value }}
{{- else if kindIs "bool" $value }}
{{- if $value }}
{{ printf "--%s" $key }}
{{- else }}
{{ printf "--no-%s" $key }}
{{- end }}
{{- else }}
{{ printf "--%s" $key }}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}
{{ $value | int64 }}
{{- else }}
{{ $value | toString }}
{{- end }}
{{- end }}
{{- end }}
{{- range .role.extraArgs }}
{{ . | toString }}
{{- end }}
{{- end }}

{{/* Fail early when a role asks for more tensor-parallel ranks than GPUs. */}}
{{- define "kvflow.checkGpus" -}}
{{- $args := include "kvflow.engineArgs" . | fromJson -}}
{{- $tp := index $args "tensor-parallel-size" | default 1 | int -}}
{{- if and .ctx.Values.gpu.enabled (gt $tp (int .role.gpusPerPod)) }}
{{- fail (printf "%s: tensor-parallel-size %d needs gpusPerPod >= %d (got %d)" .name $tp $tp (int .role.gpusPerPod)) }}
{{- end }}
{{- end }}

{{/* Kubernetes must not kill a pod before its drain ends: the grace period covers preStop, the drain and the
exit. */}}
{{- define "kvflow.checkGrace" -}}
{{- $need := add (int .role.preStopSleepSeconds) (int .role.drainTimeoutSeconds) 10 -}}
{{- if lt (int .role.terminationGracePeriodSeconds) (int $need) }}
{{- fail (printf "%s: terminationGracePeriodSeconds %d must be at least preStopSleepSeconds + drainTimeoutSeconds + 10 = %d" .name (int .role.terminationGracePeriodSeconds) (int $need)) }}
{{- end }}
{{- end }}

{{/* Volume source of the model volume (the part after "- name: model"). */}}
{{- define "kvflow.modelVolume" -}}
{{- $v := .Values.model.volume }}
{{- if eq $v.type "pvc" }}
persistentVolumeClaim:
  claimName: {{ include "kvflow.fullname" . }}-models
  readOnly: {{ $v.readOnly }}
{{- else if eq $v.type "existingClaim" }}
{{- if not $v.existingClaim }}
{{- fail "model.volume.type=existingClaim requires model.volume.existingClaim" }}
{{- end }}
persistentVolumeClaim:
  claimName: {{ $v.existingClaim }}
  readOnly: {{ $v.readOnly }}
{{- else if eq $v.type "volume" }}
{{- if not $v.source }}
{{- fail "model.volume.type=volume requires model.volume.source" }}
{{- end }}
{{- toYaml $v.source }}
{{- else }}
emptyDir:
  sizeLimit: {{ $v.emptyDirSizeLimit }}
{{- end }}
{{- end }}

{{/* Worker components of the layout, as a JSON list: static -> pinned prefill + decode; adaptive -> role-free
"worker" (`kvflow worker`). */}}
{{- define "kvflow.workerComponents" -}}
{{- if eq .Values.layout "adaptive" -}}
["worker"]
{{- else if eq .Values.layout "static" -}}
["prefill", "decode"]
{{- else }}
{{- fail (printf "layout must be static or adaptive, got %q" (toString .Values.layout)) }}
{{- end }}
{{- end }}

{{/* Values key of a worker component: the role-free "worker" component's values live under `workers`. */}}
{{- define "kvflow.workerValuesKey" -}}
{{- ternary "workers" . (eq . "worker") }}
{{- end }}

{{/*
--prefill-allowlist of a component that pulls KV (empty for prefill): a decode worker pulls from the prefill
headless Service, a role-free worker from its own (the planner may move any role-free worker to the prefill pool).
The Service name resolves to its ready pods' IPs, the addresses discovery hands the router.
*/}}
{{- define "kvflow.prefillAllowlist" -}}
{{- if eq .component "decode" }}
{{- printf "%s-prefill:%d" (include "kvflow.fullname" .ctx) (int .ctx.Values.prefill.grpcPort) }}
{{- else if eq .component "worker" }}
{{- printf "%s-worker:%d" (include "kvflow.fullname" .ctx) (int .ctx.Values.workers.grpcPort) }}
{{- end }}
{{- end }}

{{/* NetworkPolicy peer selecting one component's pods (same namespace), as JSON: (dict "ctx" $ "component" "router"). */}}
{{- define "kvflow.peer" -}}
{{- toJson (dict "podSelector" (dict "matchLabels" (include "kvflow.componentSelector" . | fromYaml))) }}
{{- end }}

{{/*
Ingress NetworkPolicy of a worker component: (dict "ctx" $ "component" "prefill" "grpcFrom" (list peers...)
"linkFrom" (list peers...) "linkComment" "..."). grpcFrom reach the gRPC port; with NCCL links (kvTransfer.backend
not grpc) linkFrom reach any TCP port; networkPolicy.metricsFrom reach the metrics port.
*/}}
{{- define "kvflow.workerNetworkPolicy" -}}
{{- $ := .ctx -}}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "kvflow.fullname" $ }}-{{ .component }}
  labels:
    {{- include "kvflow.labels" $ | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "kvflow.componentSelector" (dict "ctx" $ "component" .component) | nindent 6 }}
  policyTypes: ["Ingress"]
  ingress:
    - from:
        {{- .grpcFrom | toYaml | nindent 8 }}
      ports:
        - port: grpc
          protocol: TCP
    {{- if ne $.Values.kvTransfer.backend "grpc" }}
    {{- with .linkComment }}
    # {{ . }}
    {{- end }}
    - from:
        {{- .linkFrom | toYaml | nindent 8 }}
      ports:
        - protocol: TCP
    {{- end }}
    {{- with $.Values.networkPolicy.metricsFrom }}
    - from:
        {{- toYaml . | nindent 8 }}
      ports:
        - port: metrics
          protocol: TCP
    {{- end }}
{{- end }}
