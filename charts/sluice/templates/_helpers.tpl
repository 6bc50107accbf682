{{/* Chart name, truncated to a DNS label. */}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name used as the prefix of every object. */}}
{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "sluice.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "sluice.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: sluice
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: include "sluice.selector" (list . "gateway") */}}
{{- define "sluice.selector" -}}
app.kubernetes.io/name: {{ include "sluice.name" (index . 0) }}-{{ index . 1 }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "sluice.image" -}}
{{- $img := index . 0 -}}{{- $root := index . 1 -}}
{{- printf "%s:%s" $img.repository (default $root.Chart.AppVersion $img.tag) -}}
{{- end -}}

{{/* The Redis URL as an env var entry (from a Secret when one is given). */}}
{{/* Redis ACL rules (after "on >password"): the index's keys only, no admin commands. */}}
{{- define "sluice.redisAclPicker" -}}
~sluice:* resetchannels &sluice:* +@all -@dangerous -@admin
{{- end -}}
{{- define "sluice.redisAclOperator" -}}
~sluice:* resetchannels +@all -@dangerous -@admin -@pubsub
{{- end -}}

{{/* The Redis URL env of a component: (list $ "picker"|"operator"). The chart's Redis has
a user per component, whose password the URL carries (an earlier variable, so the kubelet
expands it). */}}
{{- define "sluice.redisEnv" -}}
{{- $root := index . 0 }}{{- $user := index . 1 }}
{{- if $root.Values.redis.existingSecret }}
- name: SLUICE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.redis.existingSecret }}
      key: {{ $root.Values.redis.existingSecretKey }}
{{- else if $root.Values.redis.enabled }}
- name: SLUICE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "sluice.fullname" $root }}-redis-auth
      key: {{ $user }}
- name: SLUICE_REDIS_URL
  value: {{ printf "redis://%s:$(SLUICE_REDIS_PASSWORD)@%s-redis:6379/0" $user (include "sluice.fullname" $root) | quote }}
{{- else if $root.Values.redis.externalUrl }}
- name: SLUICE_REDIS_URL
  value: {{ $root.Values.redis.externalUrl | quote }}
{{- end }}
{{- end -}}

{{- define "sluice.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "sluice.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "sluice.gatewayNamespace" -}}
{{- default .Release.Namespace .Values.gateway.watchNamespace -}}
{{- end -}}

{{/* Fully qualified DNS names Envoy resolves (no reliance on the pod's search path). */}}
{{- define "sluice.pickerHost" -}}
{{- printf "%s-picker-headless.%s.svc.%s" (include "sluice.fullname" .) .Release.Namespace .Values.gateway.clusterDomain -}}
{{- end -}}

{{- define "sluice.enginesHost" -}}
{{- printf "%s-engines.%s.svc.%s" (include "sluice.fullname" .) (include "sluice.gatewayNamespace" .) .Values.gateway.clusterDomain -}}
{{- end -}}

{{/* Settings that only work together, checked once for every template that uses them. */}}
{{- define "sluice.checkGie" -}}
{{- if .Values.gie.enabled }}
{{- if not .Values.gateway.enabled }}
{{- fail "gie.enabled needs gateway.enabled: the GIE InferencePools name the chart's picker as their endpoint picker" }}
{{- end }}
{{- if ne (include "sluice.gatewayNamespace" .) .Release.Namespace }}
{{- fail "gie.enabled needs gateway.watchNamespace empty or the release namespace: an InferencePool's endpointPickerRef names a Service in its own namespace" }}
{{- end }}
{{- end }}
{{- end -}}
