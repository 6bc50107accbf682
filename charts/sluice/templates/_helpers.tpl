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

{{/* The namespaces whose pools the operator serves and the gateway routes to: one list for
both (watchNamespaces; empty: the release namespace), as JSON. ["*"]: every namespace. */}}
{{- define "sluice.watchNamespaces" -}}
{{- $ns := .Values.watchNamespaces | default (list .Release.Namespace) | uniq -}}
{{- if and (has "*" $ns) (gt (len $ns) 1) -}}
{{- fail "watchNamespaces: \"*\" (every namespace) cannot be combined with namespaces" -}}
{{- end -}}
{{- toJson $ns -}}
{{- end -}}

{{/* "true" when the chart serves every namespace: ClusterRoles, a ClusterKopfPeering. */}}
{{- define "sluice.clusterWide" -}}
{{- if has "*" (include "sluice.watchNamespaces" . | fromJsonArray) }}true{{ end -}}
{{- end -}}

{{/* The pools' one namespace, when the chart serves exactly one (Envoy's engines Service
lives there); empty when it serves several or every namespace. */}}
{{- define "sluice.poolNamespace" -}}
{{- $ns := include "sluice.watchNamespaces" . | fromJsonArray -}}
{{- if and (eq (len $ns) 1) (ne (first $ns) "*") }}{{ first $ns }}{{ end -}}
{{- end -}}

{{/* The pools' namespace for what exists once: the one watched namespace, else the
release namespace. */}}
{{- define "sluice.gatewayNamespace" -}}
{{- include "sluice.poolNamespace" . | default .Release.Namespace -}}
{{- end -}}

{{/* Fully qualified DNS names Envoy resolves (no reliance on the pod's search path). */}}
{{- define "sluice.pickerHost" -}}
{{- printf "%s-picker-headless.%s.svc.%s" (include "sluice.fullname" .) .Release.Namespace .Values.gateway.clusterDomain -}}
{{- end -}}

{{/* Settings that only work together, checked once for every template that uses them. */}}
{{- define "sluice.checkGie" -}}
{{- if .Values.gie.enabled }}
{{- if not .Values.gateway.enabled }}
{{- fail "gie.enabled needs gateway.enabled: the GIE InferencePools name the chart's picker as their endpoint picker" }}
{{- end }}
{{- $ns := include "sluice.watchNamespaces" . | fromJsonArray }}
{{- if not (or (has .Release.Namespace $ns) (has "*" $ns)) }}
{{- fail "gie.enabled needs the release namespace among watchNamespaces: an InferencePool's endpointPickerRef names a Service in its own namespace" }}
{{- end }}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.gatewayFrom) }}
{{- fail "gie.enabled needs networkPolicy.gatewayFrom (the Gateway's data-plane pods, e.g. a namespaceSelector): without it the picker's port 9002 and the engines' port 8000 would be open to every pod" }}
{{- end }}

{{- end }}
{{- end -}}

{{/* CURVE on the KV-event sockets: "true" when both ends are this chart's (its picker, and
engines its operator renders). */}}
{{- define "sluice.kvEventsCurve" -}}
{{- if and .Values.kvEventsCurve.enabled .Values.gateway.enabled .Values.operator.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* CURVE on prefill/decode pools' KV-transfer sockets: "true" when the operator renders them. */}}
{{- define "sluice.kvTransferCurve" -}}
{{- if and .Values.kvTransferCurve.enabled .Values.operator.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* The CURVE keys hook Job (templates/kv-events-curve.yaml) runs: "true" when either needs keys. */}}
{{- define "sluice.curveKeys" -}}
{{- if or (include "sluice.kvEventsCurve" .) (include "sluice.kvTransferCurve" .) -}}
true
{{- end -}}
{{- end -}}

{{/* The gateway's TLS Secret (envoy.tls), checked: a Secret of yours or cert-manager's. */}}
{{/* "true" when the engines carry the chart's key and the picker adds it to each answer.
Not in GIE mode: there any Gateway's data plane reads the picker's answers (the key would
travel to them), and a Gateway that fails open has no key to send; the engines admit only
networkPolicy.gatewayFrom and the chart's own components instead. */}}
{{- define "sluice.engineKey" -}}
{{- if and .Values.engineApiKey.enabled .Values.gateway.enabled .Values.operator.enabled (not .Values.gie.enabled) }}true{{ end -}}
{{- end -}}

{{/* The Secret holding the picker's certificate; empty: self-signed at start. */}}
{{- define "sluice.pickerTlsSecret" -}}
{{- $tls := .Values.picker.tls -}}
{{- if and $tls.enabled $tls.certManager.enabled (not $tls.certManager.issuerRef.name) -}}
{{- fail "picker.tls.certManager.enabled needs picker.tls.certManager.issuerRef.name" -}}
{{- end -}}
{{- if $tls.enabled -}}
{{- $tls.secretName | default (ternary (printf "%s-picker-tls" (include "sluice.fullname" .)) "" $tls.certManager.enabled) -}}
{{- end -}}
{{- end -}}

{{- define "sluice.gatewayTlsSecret" -}}
{{- $tls := .Values.envoy.tls -}}
{{- if and $tls.certManager.enabled (not $tls.certManager.issuerRef.name) -}}
{{- fail "envoy.tls.certManager.enabled needs envoy.tls.certManager.issuerRef.name" -}}
{{- end -}}
{{- if not (or $tls.secretName $tls.certManager.enabled) -}}
{{- fail "envoy.tls.enabled needs envoy.tls.secretName (a kubernetes.io/tls Secret) or envoy.tls.certManager.enabled" -}}
{{- end -}}
{{- $tls.secretName | default (printf "%s-gateway-tls" (include "sluice.fullname" .)) -}}
{{- end -}}

{{/* checkov skip annotations, each with its reason (tests/test_chart_checkov.py holds the
chart to the checks it does not skip, and fails a skip no longer needed):
include "sluice.checkovSkips" (list "CKV_K8S_38" ...). An item "ID=reason" gives its own. */}}
{{- define "sluice.checkovSkips" -}}
{{- $reasons := dict
  "CKV_K8S_11" "no CPU limit on purpose: CFS throttling stalls latency-bound serving; CPU requests and memory limits are set"
  "CKV_K8S_15" "pinned tags with IfNotPresent: Always would make every pod start depend on the registry"
  "CKV_K8S_43" "tags pinned in values; to pin digests, give each image.tag as TAG@sha256:DIGEST"
  "CKV_K8S_35" "the program reads this secret from its environment, set by secretKeyRef: never in the manifest, argv or logs"
  "CKV_K8S_38" "this pod calls the API server, as its own least-privilege ServiceAccount" }}
{{- $lines := list }}
{{- range $i, $item := . }}
{{- $id := regexReplaceAll "=.*" $item "" }}
{{- $reason := ternary (trimPrefix (printf "%s=" $id) $item) (get $reasons $id) (contains "=" $item) }}
{{- $lines = append $lines (printf "checkov.io/skip%d: %s" (add1 $i) (printf "%s=%s" $id $reason | quote)) }}
{{- end }}
{{- join "\n" $lines }}
{{- end -}}

{{/*
The ConfigMap holding the picker's EndpointPickerConfig (picker.config): the chart's own for
`inline`, else the user's `configMap.name`; empty: a shipped `picker.routing` configuration.
*/}}
{{- define "sluice.routingConfig" -}}
{{- $c := .Values.picker.config -}}
{{- if and $c.inline $c.configMap.name -}}
{{- fail "picker.config: set inline or configMap.name, not both" -}}
{{- end -}}
{{- if $c.inline -}}
{{- printf "%s-picker-routing" (include "sluice.fullname" .) -}}
{{- else -}}
{{- $c.configMap.name -}}
{{- end -}}
{{- end -}}

{{- define "sluice.routingConfigKey" -}}
{{- ternary "config.yaml" .Values.picker.config.configMap.key (not (empty .Values.picker.config.inline)) -}}
{{- end -}}
