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

{{/* A pod template's labels: the selector labels, the component, podLabels. No chart version and
no app version: a label change rolls the pods, and a chart bump must not restart the one shared
admission service (the image tag says what runs). Argument: dict ctx, component ("" for the
sidecar shape's pods). */}}
{{- define "llm-admission.podLabels" -}}
{{ include "llm-admission.selectorLabels" .ctx }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- with .ctx.Values.podLabels }}
{{ toYaml . }}
{{- end }}
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

{{/* Concurrent requests one Envoy may have on an engine's gated cluster: what the gate admits, max
in-flight (the engine's own or the default) + the engine queue slots when the KV budget is on
(extproc/envoyconf.py engine_bound). Argument: dict ctx, engine. */}}
{{- define "llm-admission.engineBound" -}}
{{- $a := .ctx.Values.admission -}}
{{- $inflight := int64 (ternary .engine.maxInflight $a.maxInflight (hasKey .engine "maxInflight")) -}}
{{- $slots := ternary (int64 $a.engineQueueSlots) 0 (and $a.kvBudget $a.localAccounting) -}}
{{- add $inflight $slots -}}
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
      max_connections: {{ .maxConnections | default .maxRequests }}
      max_pending_requests: {{ .maxConnections | default .maxRequests }}
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
          connection_keepalive:
            interval: 30s
            timeout: 5s
  {{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------------------------------
Shapes. "sidecar": one Deployment (fullname) whose pods run Envoy + the admission service.
"shared": Deployment fullname-envoy (envoy.replicas pods, Envoy alone) and Deployment + Service
fullname-extproc (the one admission service every Envoy's ext_proc cluster points at).
*/}}

{{/* fullname + "-" + suffix, within the 63 characters of a DNS label. Argument: dict ctx, suffix. */}}
{{- define "llm-admission.componentName" -}}
{{- $base := include "llm-admission.fullname" .ctx | trunc (int (sub 62 (len .suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base .suffix -}}
{{- end -}}

{{/* The shared admission service's Service and Deployment name. */}}
{{- define "llm-admission.extprocName" -}}
{{- include "llm-admission.componentName" (dict "ctx" . "suffix" "extproc") -}}
{{- end -}}

{{/* The shared Envoys' Deployment name. */}}
{{- define "llm-admission.envoyName" -}}
{{- include "llm-admission.componentName" (dict "ctx" . "suffix" "envoy") -}}
{{- end -}}

{{/* Selector labels of one component of the shared shape. Argument: dict ctx, component. */}}
{{- define "llm-admission.componentSelectorLabels" -}}
{{ include "llm-admission.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* host and port ("host port") of the admission service as Envoy's ext_proc cluster sees it:
loopback in the sidecar shape, the shared Service's cluster DNS name in the shared shape. */}}
{{- define "llm-admission.extprocHostPort" -}}
{{- if eq .Values.shape "shared" -}}
{{- printf "%s.%s.svc.%s %d" (include "llm-admission.extprocName" .) .Release.Namespace .Values.clusterDomain (int64 .Values.admission.grpcPort) -}}
{{- else -}}
{{- printf "127.0.0.1 %d" (int64 .Values.admission.grpcPort) -}}
{{- end -}}
{{- end -}}

{{/* Pod-spec fields every pod of the chart shares (image pull secrets, priority, security). No
pod talks to the Kubernetes API: no service account token is mounted. */}}
{{- define "llm-admission.podCommon" -}}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Scheduling of one kind of pod. Argument: dict ctx, component ("envoy": every pod that runs
Envoy, the sidecar shape's and the shared shape's Envoy pods; "extproc": the shared shape's
admission service) and selector (the pods' selector labels, for the default spread). Each of
nodeSelector, tolerations, affinity and topologySpreadConstraints comes from the component's own
`scheduling` when set there, else from the top-level value. Pods that run Envoy without any
topologySpreadConstraints get the default spread (topologySpread): at most maxSkew more
replicas on one node than on another, counted per ReplicaSet (matchLabelKeys
pod-template-hash), so that a node loss does not take every replica. */}}
{{- define "llm-admission.podScheduling" -}}
{{- $v := .ctx.Values -}}
{{- $own := dict -}}
{{- if eq .component "envoy" }}{{ $own = $v.envoy.scheduling | default dict }}{{ else }}{{ $own = $v.extproc.scheduling | default dict }}{{ end -}}
{{- $nodeSelector := $own.nodeSelector | default $v.nodeSelector -}}
{{- $tolerations := $own.tolerations | default $v.tolerations -}}
{{- $affinity := $own.affinity | default $v.affinity -}}
{{- $spread := $own.topologySpreadConstraints | default $v.topologySpreadConstraints -}}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $spread }}
topologySpreadConstraints:
  {{- toYaml $spread | nindent 2 }}
{{- else if and (eq .component "envoy") $v.topologySpread.enabled }}
topologySpreadConstraints:
- maxSkew: {{ int64 $v.topologySpread.maxSkew }}
  topologyKey: {{ $v.topologySpread.topologyKey }}
  whenUnsatisfiable: {{ $v.topologySpread.whenUnsatisfiable }}
  labelSelector:
    matchLabels:
      {{- .selector | nindent 6 }}
  matchLabelKeys: [pod-template-hash]
{{- end }}
{{- end -}}

{{/* terminationGracePeriodSeconds of a pod running Envoy: its preStop drain (park cap + inflight
allowance) + 2 s for Envoy to exit + 5 s margin, + the service's own --grace when the service
runs in the same pod and only starts stopping once Envoy is gone (sidecar). */}}
{{- define "llm-admission.envoyPodGrace" -}}
{{- $drain := int64 (include "llm-admission.drainSeconds" .) -}}
{{- $grace := 0 -}}
{{- if eq .Values.shape "sidecar" }}{{ $grace = int64 (ceil (float64 .Values.admission.shutdownGraceSeconds)) }}{{ end -}}
{{- add $drain 2 $grace 5 -}}
{{- end -}}

{{/*
The Envoy container, the same in both shapes: --concurrency from the CPU limit, the health
listener's probes, the preStop drain (configmap-envoy.yaml's prestop.sh). Its config volume is
"envoy-config" (llm-admission.envoyVolumes).
*/}}
{{- define "llm-admission.envoyContainer" -}}
- name: envoy
  image: "{{ .Values.envoy.image.repository }}:{{ .Values.envoy.image.tag }}"
  imagePullPolicy: {{ .Values.envoy.image.pullPolicy }}
  command: [/usr/local/bin/envoy]
  args:
  - --config-path
  - /etc/envoy/envoy.yaml
  - --concurrency
  - {{ include "llm-admission.envoyConcurrency" . | quote }}
  - --disable-hot-restart
  - --drain-time-s
  - {{ int64 .Values.envoy.drainTimeSeconds | quote }}
  - --drain-strategy
  - immediate
  - --log-level
  - {{ .Values.envoy.logLevel }}
  {{- with .Values.envoy.extraArgs }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  ports:
  - name: http
    containerPort: {{ int64 .Values.envoy.port }}
    protocol: TCP
  - name: envoy-health
    containerPort: {{ int64 .Values.envoy.healthPort }}
    protocol: TCP
  readinessProbe:
    httpGet:
      path: /ready
      port: envoy-health
    periodSeconds: 5
    failureThreshold: 2
  # /ready also answers 503 while Envoy drains; the kubelet treats liveness as passing once
  # the pod is terminating, so a drain never restarts Envoy.
  livenessProbe:
    httpGet:
      path: /ready
      port: envoy-health
    initialDelaySeconds: 5
    periodSeconds: 10
    failureThreshold: 3
  lifecycle:
    preStop:
      exec:
        command: [/bin/bash, /etc/envoy/prestop.sh]
  resources:
    {{- toYaml .Values.envoy.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.envoySecurityContext | nindent 4 }}
  volumeMounts:
  - name: envoy-config
    mountPath: /etc/envoy
    readOnly: true
  {{- with .Values.envoy.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* Volumes of every pod of the release (extraVolumes): each container's extraVolumeMounts
find theirs in whichever pod runs it. */}}
{{- define "llm-admission.extraVolumes" -}}
{{- with .Values.extraVolumes }}
{{- toYaml . }}
{{- end }}
{{- end -}}

{{/* The volume the Envoy container mounts. */}}
{{- define "llm-admission.envoyVolumes" -}}
- name: envoy-config
  configMap:
    name: {{ include "llm-admission.fullname" . }}-envoy
{{- end -}}

{{/*
The admission service's container, the same binary and settings in both shapes. Only where it
listens differs: sidecar, gRPC on 127.0.0.1 (only the pod's Envoy talks to it) and a preStop that
keeps it serving until that Envoy has drained and exited; shared, gRPC on 0.0.0.0 (every Envoy
of the release talks to it through the Service) and no preStop (no Envoy in its pod to wait for).
Its engines volume is "engines" (llm-admission.admissionVolumes).
*/}}
{{- define "llm-admission.admissionContainer" -}}
{{- $a := .Values.admission -}}
{{- $shared := eq .Values.shape "shared" -}}
{{- $grace := int64 (ceil (float64 $a.shutdownGraceSeconds)) -}}
- name: admission
  image: "{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [extproc, serve, --grace, {{ $grace | quote }}]
  env:
  - name: EXTPROC_CONFIG
    value: /etc/llm-admission/engines.yaml
  - name: EXTPROC_LISTEN
    value: "{{ ternary "0.0.0.0" "127.0.0.1" $shared }}:{{ int64 $a.grpcPort }}"
  # The full admin interface (/debug/engines: the ledger and every model) stays on loopback
  # (kubectl port-forward reaches it); the "admin" port serves only what probes and scrapes need.
  - name: EXTPROC_ADMIN_LISTEN
    value: "127.0.0.1:{{ int64 $a.debugPort }}"
  - name: EXTPROC_PROBE_LISTEN
    value: "0.0.0.0:{{ int64 $a.adminPort }}"
  - name: ADMISSION_MAX_INFLIGHT
    value: {{ int64 $a.maxInflight | quote }}
  - name: ADMISSION_KV_THRESHOLD
    value: {{ $a.kvThreshold | toString | quote }}
  - name: VLLM_MAX_QUEUE_DEPTH
    value: {{ int64 $a.maxQueueDepth | quote }}
  - name: ADMISSION_MAX_PARK_SECONDS
    value: {{ $a.maxParkSeconds | toString | quote }}
  - name: ADMISSION_RETRY_AFTER_SECONDS
    value: {{ int64 $a.retryAfterSeconds | quote }}
  - name: MAX_BODY_BYTES
    value: {{ int64 $a.maxBodyBytes | quote }}
  - name: ENGINE_POLL_INTERVAL_SECONDS
    value: {{ $a.pollIntervalSeconds | toString | quote }}
  - name: ENGINE_STALE_AFTER_POLLS
    value: {{ int64 $a.staleAfterPolls | quote }}
  - name: ADMISSION_LOCAL_ACCOUNTING
    value: {{ $a.localAccounting | toString | quote }}
  - name: ADMISSION_KV_BUDGET
    value: {{ $a.kvBudget | toString | quote }}
  - name: ADMISSION_ENGINE_QUEUE_SLOTS
    value: {{ int64 $a.engineQueueSlots | quote }}
  - name: ADMISSION_WAIT_ESTIMATES
    value: {{ $a.waitEstimates | toString | quote }}
  - name: ADMISSION_GENERATION_RESERVATION
    value: {{ $a.generationReservation | quote }}
  - name: ADMISSION_GENERATION_FACTOR
    value: {{ $a.generationFactor | toString | quote }}
  - name: ADMISSION_BACKFILL
    value: {{ $a.backfill | toString | quote }}
  - name: ADMISSION_BYTES_PER_TOKEN
    value: {{ $a.bytesPerToken | toString | quote }}
  - name: ADMISSION_ESTIMATE_SAFETY_FACTOR
    value: {{ $a.estimateSafetyFactor | toString | quote }}
  - name: ADMISSION_DEFAULT_MAX_TOKENS
    value: {{ int64 $a.defaultMaxTokens | quote }}
  {{- with $a.estimate }}
  - name: ADMISSION_ESTIMATE
    value: {{ .mode | quote }}
  {{- if .tokenizer }}
  - name: ADMISSION_TOKENIZER
    value: {{ .tokenizer | quote }}
  {{- end }}
  - name: ADMISSION_TOKENIZE_ABOVE_BYTES
    value: {{ int64 .tokenizeAboveBytes | quote }}
  - name: ADMISSION_TOKENIZE_TIMEOUT_MS
    value: {{ .tokenizeTimeoutMs | toString | quote }}
  - name: ADMISSION_LEARN_BYTES_PER_TOKEN
    value: {{ .learnBytesPerToken | toString | quote }}
  - name: ADMISSION_BYTES_PER_TOKEN_MIN
    value: {{ .bytesPerTokenMin | toString | quote }}
  - name: ADMISSION_BYTES_PER_TOKEN_MAX
    value: {{ .bytesPerTokenMax | toString | quote }}
  - name: ADMISSION_TEMPLATE_TOKENS_FIXED
    value: {{ int64 .templateTokens.fixed | quote }}
  - name: ADMISSION_TEMPLATE_TOKENS_PER_MESSAGE
    value: {{ int64 .templateTokens.perMessage | quote }}
  - name: ADMISSION_TEMPLATE_TOKENS_TOOLS
    value: {{ int64 .templateTokens.tools | quote }}
  {{- end }}
  {{- if $a.kvCapacityTokens }}
  - name: ADMISSION_KV_CAPACITY_TOKENS
    value: {{ int64 $a.kvCapacityTokens | quote }}
  {{- end }}
  - name: ADMISSION_SCRAPE_GRACE_SECONDS
    value: {{ $a.scrapeGraceSeconds | toString | quote }}
  - name: ADMISSION_GATED_PATHS
    value: {{ join "," $a.gatedPaths | quote }}
  - name: ADMISSION_MODELS_REFRESH_SECONDS
    value: {{ $a.modelsRefreshSeconds | toString | quote }}
  - name: EXTPROC_MAX_STREAMS
    value: {{ int64 $a.maxStreams | quote }}
  - name: EXTPROC_LOG_LEVEL
    value: {{ $a.logLevel | quote }}
  - name: EXTPROC_LOG_FORMAT
    value: {{ $a.logFormat | quote }}
  {{- $l := .Values.ledger }}
  - name: ADMISSION_LEDGER
    value: {{ $l.backend | quote }}
  {{- if eq $l.backend "redis" }}
  {{- /* The schema guarantees exactly one of url and existingSecret. */}}
  - name: ADMISSION_REDIS_URL
  {{- if $l.redis.existingSecret }}
    valueFrom:
      secretKeyRef:
        name: {{ $l.redis.existingSecret | quote }}
        key: {{ $l.redis.secretKey | quote }}
  {{- else }}
    value: {{ $l.redis.url | quote }}
  {{- end }}
  - name: ADMISSION_LEDGER_LEASE_SECONDS
    value: {{ $l.leaseSeconds | toString | quote }}
  - name: ADMISSION_LEDGER_TIMEOUT_MS
    value: {{ $l.timeoutMs | toString | quote }}
  - name: ADMISSION_LEDGER_KEY_PREFIX
    value: {{ include "llm-admission.ledgerKeyPrefix" . | quote }}
  # The pod's name is its replica id in the shared state: a lease expiry names the pod that died.
  - name: ADMISSION_REPLICA_ID
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  {{- end }}
  {{- with $a.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- with $a.envFrom }}
  envFrom:
  {{- toYaml . | nindent 2 }}
  {{- end }}
  ports:
  {{- if $shared }}
  - name: grpc
    containerPort: {{ int64 $a.grpcPort }}
    protocol: TCP
  {{- end }}
  - name: admin
    containerPort: {{ int64 $a.adminPort }}
    protocol: TCP
  # /readyz is not tied to engine health on purpose (an engine metrics outage makes admission
  # fail open; it must not take the gateway out of service). It turns 503 on SIGTERM.
  readinessProbe:
    httpGet:
      path: /readyz
      port: admin
    periodSeconds: 5
    failureThreshold: 2
  livenessProbe:
    httpGet:
      path: /healthz
      port: admin
    initialDelaySeconds: 5
    periodSeconds: 10
    failureThreshold: 3
  {{- if not $shared }}
  lifecycle:
    preStop:
      exec:
        # Keep serving until Envoy has drained and exited (its admin port closes), so that
        # parked and admitted requests keep their ext_proc streams to the end.
        command:
        - python
        - -c
        - |
          import socket, time
          deadline = time.monotonic() + {{ add (include "llm-admission.drainSeconds" .) 2 }}
          while time.monotonic() < deadline:
              try:
                  socket.create_connection(("127.0.0.1", {{ int64 .Values.envoy.adminPort }}), 1).close()
              except OSError:
                  break
              time.sleep(1)
  {{- end }}
  resources:
    {{- toYaml .Values.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
  - name: engines
    mountPath: /etc/llm-admission
    readOnly: true
  {{- with $a.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* The volume the admission container mounts. */}}
{{- define "llm-admission.admissionVolumes" -}}
- name: engines
  configMap:
    name: {{ include "llm-admission.fullname" . }}-engines
{{- end -}}

{{/*
Envoy's own answers in the service's shape (extproc/envoyconf.py LOCAL_REPLIES, field for field):
an OpenAI-style JSON error body, x-admission-outcome, and Retry-After where a retry makes sense.
The service's own answers (response code details admission_<outcome>) match the first mapper
and are left exactly as they are; then, first match wins: the engine cluster's breaker (UO),
the engine unreachable or gone before answering, timeouts, no route, a failed admission service
with failureMode closed, a gated request no engine was named for (several engines: the route's
direct 503), Envoy's 413/431/400, and any other local reply with Envoy's status kept.
*/}}
{{- define "llm-admission.localReplyConfig" -}}
{{- $cel := "envoy.access_loggers.extension_filters.cel" -}}
{{- $celType := "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter" -}}
{{- $details := "(%RESPONSE_CODE_DETAILS%)" -}}
{{- $replies := list
  (dict "code" "engine_overloaded" "status" 503 "type" "service_unavailable" "retry" true
        "filter" (dict "response_flag_filter" (dict "flags" (list "UO")))
        "message" "the engine is at capacity and the gateway holds no more requests for it; retry later")
  (dict "code" "engine_unavailable" "status" 503 "type" "service_unavailable" "retry" true
        "filter" (dict "response_flag_filter" (dict "flags" (list "UF" "UH" "UC" "UR" "LR" "URX" "UMSDR")))
        "message" (printf "the engine could not be reached or closed the connection before answering; retry later %s" $details))
  (dict "code" "engine_timeout" "status" 504 "type" "timeout_error" "retry" false
        "filter" (dict "response_flag_filter" (dict "flags" (list "UT" "SI")))
        "message" (printf "no answer from the engine within the gateway's timeout %s" $details))
  (dict "code" "no_route" "status" 404 "type" "not_found_error" "retry" false
        "filter" (dict "response_flag_filter" (dict "flags" (list "NR" "NC")))
        "message" (printf "no route for this request %s" $details))
  (dict "code" "admission_unavailable" "status" 503 "type" "service_unavailable" "retry" true
        "filter" (dict "extension_filter" (dict "name" $cel "typed_config" (dict "@type" $celType "expression" "response.code_details.startsWith('ext_proc_')")))
        "message" (printf "the admission service did not answer and the gateway fails closed; retry later %s" $details))
  (dict "code" "engine_not_selected" "status" 503 "type" "service_unavailable" "retry" true
        "filter" (dict "extension_filter" (dict "name" $cel "typed_config" (dict "@type" $celType "expression" "response.code_details == 'direct_response'")))
        "message" "the admission service did not say which engine serves this model (it is down or did not answer in time) and the gateway does not guess among several engines; retry later")
  (dict "code" "body_too_large" "status" 413 "type" "invalid_request_error" "retry" false
        "filter" (dict "status_code_filter" (dict "comparison" (dict "op" "EQ" "value" (dict "default_value" 413 "runtime_key" "admission.local_reply.status_413"))))
        "message" (printf "request body exceeds the gateway's buffer limit %s" $details))
  (dict "code" "headers_too_large" "status" 431 "type" "invalid_request_error" "retry" false
        "filter" (dict "status_code_filter" (dict "comparison" (dict "op" "EQ" "value" (dict "default_value" 431 "runtime_key" "admission.local_reply.status_431"))))
        "message" (printf "request headers exceed the gateway's limit %s" $details))
  (dict "code" "bad_request" "status" 400 "type" "invalid_request_error" "retry" false
        "filter" (dict "status_code_filter" (dict "comparison" (dict "op" "EQ" "value" (dict "default_value" 400 "runtime_key" "admission.local_reply.status_400"))))
        "message" (printf "malformed HTTP request %s" $details))
  (dict "code" "gateway_error" "status" 0 "type" "server_error" "retry" false
        "filter" (dict "status_code_filter" (dict "comparison" (dict "op" "GE" "value" (dict "default_value" 0 "runtime_key" "admission.local_reply.any"))))
        "message" (printf "%%LOCAL_REPLY_BODY%% %s" $details))
-}}
mappers:
- filter:
    extension_filter:
      name: {{ $cel }}
      typed_config:
        "@type": {{ $celType }}
        expression: "response.code_details.startsWith('admission_')"
{{- range $r := $replies }}
- filter:
    {{- toYaml $r.filter | nindent 4 }}
  {{- if $r.status }}
  status_code: {{ $r.status }}
  {{- end }}
  headers_to_add:
  {{- if $r.retry }}
  - header:
      key: retry-after
      value: {{ int64 $.Values.admission.retryAfterSeconds | quote }}
    append_action: OVERWRITE_IF_EXISTS_OR_ADD
  {{- end }}
  - header:
      key: x-admission-outcome
      value: {{ $r.code }}
    append_action: OVERWRITE_IF_EXISTS_OR_ADD
  body_format_override:
    json_format:
      error:
        message: {{ $r.message | quote }}
        type: {{ $r.type }}
        code: {{ $r.code }}
    content_type: application/json
{{- end }}
{{- end -}}


{{/*
Values the schema cannot check, refused at render with a message saying what to do. Every
template that reads .Values.engines includes this first, so whichever Helm renders first fails
with this message rather than a Go template error.
- engines is required: the chart ships none, so that no placeholder engine installs silently.
- each engine's url must reach ONE vLLM process: the service polls its /metrics for the gauges it
  decides on, and through a ClusterIP over several replicas each poll reads a different one. The
  chart cannot see what a name resolves to; it refuses what it can see: two engines with one url,
  and the placeholder model name of earlier chart versions.
- engine names and models unique; the shape one of the two.
*/}}
{{- define "llm-admission.validate" -}}
{{- if not (has .Values.shape (list "sidecar" "shared")) }}
{{- fail (printf "shape=%q: must be \"sidecar\" (Envoy + admission service in every pod) or \"shared\" (Envoys pointing at one admission service)" .Values.shape) }}
{{- end }}
{{- if not .Values.engines }}
{{- fail "engines is required: list the vLLM engines this gateway fronts, e.g. --set 'engines[0].name=qwen' --set 'engines[0].url=http://qwen-vllm-0.qwen-vllm:8000' --set 'engines[0].models={Qwen/Qwen3-8B}'. Each url must reach ONE vLLM process (a pod's address, or a Service over exactly one replica), not a ClusterIP over several replicas: the gate polls that url's /metrics and must always read the same engine" }}
{{- end }}
{{- $names := dict }}
{{- $models := dict }}
{{- $urls := dict }}
{{- range $i, $e := .Values.engines }}
{{- if hasKey $names $e.name }}
{{- fail (printf "engines: name %q is used twice; engine names must be unique" $e.name) }}
{{- end }}
{{- $_ := set $names $e.name true }}
{{- $url := trimSuffix "/" (lower $e.url) }}
{{- if hasKey $urls $url }}
{{- fail (printf "engines: %q and %q have the same url %s; each engine is ONE vLLM process with its own url (list every model it serves under one engine)" (get $urls $url) $e.name $e.url) }}
{{- end }}
{{- $_ := set $urls $url $e.name }}
{{- range $e.models }}
{{- if eq . "my-model" }}
{{- fail (printf "engines[%d].models: %q is the example placeholder; list the names the engine serves (vLLM --served-model-name)" $i .) }}
{{- end }}
{{- if hasKey $models . }}
{{- fail (printf "engines: model %q is listed for engines %q and %q; each model must map to exactly one engine" . (get $models .) $e.name) }}
{{- end }}
{{- $_ := set $models . $e.name }}
{{- end }}
{{- end }}
{{- end -}}


{{/* A Kubernetes memory quantity in bytes (extproc/envoyconf.py memory_bytes): an integer with
an optional unit Ki, Mi, Gi, Ti, k, M, G, T. */}}
{{- define "llm-admission.memoryBytes" -}}
{{- $q := toString . -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) }}{{ $q = toString (int64 .) }}{{ end -}}
{{- $m := regexFindAll "^([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?$" $q -1 -}}
{{- if not $m -}}
{{- fail (printf "envoy.resources.limits.memory=%q: want an integer with an optional unit Ki, Mi, Gi, Ti, k, M, G or T" $q) -}}
{{- end -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $unit := regexFind "(Ki|Mi|Gi|Ti|k|M|G|T)$" $q -}}
{{- $n := int64 (trimSuffix $unit $q) -}}
{{- if $unit }}{{ mul $n (get $units $unit) }}{{ else }}{{ $n }}{{ end -}}
{{- end -}}

{{/* Envoy's overload manager (extproc/envoyconf.py _overload_manager): heap cap 90% of the
container's memory limit; the global downstream connection cap envoy.maxDownstreamConnections,
else (heap cap - 128 MiB for Envoy itself) / (2 x admission.maxBodyBytes), since a connection may
hold its read buffer and the buffered request body, each up to the body cap. */}}
{{- define "llm-admission.overloadManager" -}}
{{- $limit := "" -}}
{{- with .Values.envoy.resources }}{{ with .limits }}{{ with .memory }}{{ $limit = . }}{{ end }}{{ end }}{{ end -}}
{{- if not $limit -}}
{{- fail "envoy.resources.limits.memory must be set: it sizes Envoy's overload manager (heap cap) and its connection cap against the per-connection buffer (admission.maxBodyBytes)" -}}
{{- end -}}
{{- $bytes := int64 (include "llm-admission.memoryBytes" $limit) -}}
{{- $heap := div (mul $bytes 90) 100 -}}
{{- $connections := 0 -}}
{{- if .Values.envoy.maxDownstreamConnections -}}
{{- $connections = int64 .Values.envoy.maxDownstreamConnections -}}
{{- else -}}
{{- $connections = div (sub $heap 134217728) (mul 2 (int64 .Values.admission.maxBodyBytes)) -}}
{{- if lt $connections 16 -}}
{{- fail (printf "envoy.resources.limits.memory=%v leaves room for %d connections of 2 x %d-byte buffers (at least 16 needed): raise the limit, lower admission.maxBodyBytes, or set envoy.maxDownstreamConnections" $limit (max $connections 0) (int64 .Values.admission.maxBodyBytes)) -}}
{{- end -}}
{{- end -}}
refresh_interval: 0.25s
resource_monitors:
- name: envoy.resource_monitors.fixed_heap
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig
    max_heap_size_bytes: {{ $heap }}
- name: envoy.resource_monitors.global_downstream_max_connections
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig
    max_active_downstream_connections: {{ $connections }}
actions:
- name: envoy.overload_actions.shrink_heap
  triggers:
  - name: envoy.resource_monitors.fixed_heap
    threshold:
      value: 0.95
- name: envoy.overload_actions.stop_accepting_requests
  triggers:
  - name: envoy.resource_monitors.fixed_heap
    threshold:
      value: 0.98
{{- end -}}


{{/*
Refuses an in-place shape change on upgrade. The two shapes' pods are different Deployments
(RELEASE-llm-admission vs RELEASE-llm-admission-envoy + -extproc): an upgrade that switches shape
deletes the old Deployment while the new pods start, and the inference Service selects only the
new shape's pods, none of them Ready yet, so clients get connection errors until they are (image
pull, probes: seconds to minutes). The previous shape is read from the live inference Service's
selector (the shared shape's selects component "envoy"). Argument: dict ctx, previous (the
Service as `lookup` returns it; empty on install and when rendering offline).
*/}}
{{- define "llm-admission.shapeChangeGuard" -}}
{{- $selector := dict -}}
{{- with .previous }}{{ with .spec }}{{ with .selector }}{{ $selector = . }}{{ end }}{{ end }}{{ end -}}
{{- if $selector -}}
{{- $previous := ternary "shared" "sidecar" (eq (get $selector "app.kubernetes.io/component" | toString) "envoy") -}}
{{- $wanted := .ctx.Values.shape -}}
{{- if and (ne $previous $wanted) (not .ctx.Values.shapeChange.allow) -}}
{{- fail (printf "shape: this release runs shape %q and the upgrade asks for %q. Changing the shape in place deletes the old pods while the new ones start, and the inference Service has no Ready pod until the new Envoys are Ready (seconds to minutes): clients get connection errors. Install the new shape as a second release, move clients to its Service, then uninstall this one; or accept the gap with --set shapeChange.allow=true" $previous $wanted) -}}
{{- end -}}
{{- end -}}
{{- end -}}
