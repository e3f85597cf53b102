{{/*
Names and labels.
*/}}
{{- define "llm-admission.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llm-admission.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "llm-admission.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llm-admission.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "llm-admission.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "llm-admission.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
The park cap Envoy's timeouts are sized from: the longest park any engine allows, exactly as
Settings.max_park_seconds computes it (an engine's maxParkSeconds, else admission.maxParkSeconds).
Returns a number as a string; callers convert with float64.
*/}}
{{- define "llm-admission.parkCap" -}}
{{- $max := 0.0 -}}
{{- range .Values.engines -}}
{{- $park := float64 $.Values.admission.maxParkSeconds -}}
{{- if hasKey . "maxParkSeconds" }}{{ $park = float64 .maxParkSeconds }}{{ end -}}
{{- if gt $park $max }}{{ $max = $park }}{{ end -}}
{{- end -}}
{{- $max -}}
{{- end -}}

{{/* Whole seconds, rounded up, as extproc/envoyconf.py's _seconds does. */}}
{{- define "llm-admission.ceilSeconds" -}}
{{- int64 (ceil (float64 .)) -}}
{{- end -}}

{{/*
Envoy's worker count. Envoy starts one worker per core of the NODE unless told otherwise (the
same defect as Go's GOMAXPROCS in the reference gateway): on a 96-core node with a 2-CPU limit
that is 96 workers fighting for 2 CPUs of CFS quota, each with its own connection pool to the
engine and the admission service. So: envoy.concurrency if set, else the CPU limit rounded up.
*/}}
{{- define "llm-admission.envoyConcurrency" -}}
{{- if .Values.envoy.concurrency -}}
{{- int64 .Values.envoy.concurrency -}}
{{- else -}}
{{- $limit := "" -}}
{{- with .Values.envoy.resources }}{{ with .limits }}{{ with .cpu }}{{ $limit = toString . }}{{ end }}{{ end }}{{ end -}}
{{- if not $limit -}}
{{- fail "envoy.resources.limits.cpu or envoy.concurrency must be set: without either Envoy starts one worker per node core, not per CPU it may use" -}}
{{- end -}}
{{- $cores := 0.0 -}}
{{- if hasSuffix "m" $limit -}}
{{- $cores = divf (float64 (trimSuffix "m" $limit)) 1000.0 -}}
{{- else -}}
{{- $cores = float64 $limit -}}
{{- end -}}
{{- max 1 (int64 (ceil $cores)) -}}
{{- end -}}
{{- end -}}

{{/* How long Envoy's preStop waits for in-flight requests: a request parked just before the
drain can wait the whole park cap, then needs time to generate. */}}
{{- define "llm-admission.drainSeconds" -}}
{{- add (include "llm-admission.ceilSeconds" (include "llm-admission.parkCap" .)) (int64 .Values.shutdown.inflightAllowanceSeconds) -}}
{{- end -}}

{{/* Envoy's stat prefix of the inference listener; the preStop reads its downstream_rq_active. */}}
{{- define "llm-admission.statPrefix" -}}inference{{- end -}}

{{/* "host port" of an http:// URL (the schema only admits http://host[:port][/path]). */}}
{{- define "llm-admission.hostPort" -}}
{{- $u := urlParse . -}}
{{- $hp := splitList ":" $u.host -}}
{{- if eq (len $hp) 2 -}}
{{- printf "%s %s" (lower (index $hp 0)) (index $hp 1) -}}
{{- else -}}
{{- printf "%s 80" (lower $u.host) -}}
{{- end -}}
{{- end -}}

{{/* An Envoy cluster, as extproc/envoyconf.py's _cluster builds it. Arguments: dict with name,
host, port, http2 (bool), maxRequests, connectTimeout. */}}
{{- define "llm-admission.envoyCluster" -}}
{{- $isIP := regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$" .host -}}
- name: {{ .name }}
  type: {{ ternary "STATIC" "STRICT_DNS" $isIP }}
  connect_timeout: {{ .connectTimeout }}
  circuit_breakers:
    thresholds:
    - priority: DEFAULT
      max_connections: {{ .maxRequests }}
      max_pending_requests: {{ .maxRequests }}
      max_requests: {{ .maxRequests }}
      max_retries: 3
  load_assignment:
    cluster_name: {{ .name }}
    endpoints:
    - lb_endpoints:
      - endpoint:
          address:
            socket_address:
              address: {{ .host }}
              port_value: {{ .port }}
  {{- if not $isIP }}
  dns_lookup_family: V4_PREFERRED
  {{- end }}
  {{- if .http2 }}
  typed_extension_protocol_options:
    envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
      "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
      explicit_http_config:
        http2_protocol_options:
          max_concurrent_streams: {{ .maxRequests }}
  {{- end }}
{{- end -}}
