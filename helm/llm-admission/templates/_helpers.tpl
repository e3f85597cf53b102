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
The park cap the shutdown timings are sized from (Envoy's preStop drain, the pods' grace
period): the longest park any engine allows, exactly as Settings.max_park_seconds computes it (an
engine's maxParkSeconds, else admission.maxParkSeconds). Returns a number as a string; callers
convert with float64. (Envoy's own timeouts come from the generator, which reads the settings.)
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

{{/* Whole seconds, rounded up. */}}
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

{{/* Envoy's stat prefix of the inference listener (extproc/envoyconf.py INFERENCE_STAT_PREFIX;
tests/helm holds them equal); the preStop reads its downstream_rq_active. */}}
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

{{/* HOST:PORT of the admission service as Envoy's ext_proc cluster sees it: loopback in the
sidecar shape, the shared Service's cluster DNS name in the shared shape (the generator makes a
name STRICT_DNS: it resolves to the Service's ClusterIP). */}}
{{- define "llm-admission.extprocHostPort" -}}
{{- if eq .Values.shape "shared" -}}
{{- printf "%s.%s.svc.%s:%d" (include "llm-admission.extprocName" .) .Release.Namespace .Values.clusterDomain (int64 .Values.admission.grpcPort) -}}
{{- else -}}
{{- printf "127.0.0.1:%d" (int64 .Values.admission.grpcPort) -}}
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
Envoy's bootstrap comes from the admission service's own image: this init container runs
`extproc envoy-config` (extproc/envoyconf.py, the one place the Envoy config is written) with
the service's settings (llm-admission.admissionEnv, the engines file) and, as flags, what only
the chart knows: Envoy's listen, admin and health ports, where the service is (the shared
Service's DNS name in the shared shape), failureMode, the first-token allowance, and Envoy's
memory limit for the overload manager. It mounts what the service mounts (the engines file,
admission.extraVolumeMounts) and writes /etc/envoy/envoy.yaml into the "envoy-config" emptyDir
the Envoy container reads. Why an init container rather than a template: a template
re-derived every choice of the generator (park cap, margins, routes, local replies, overload
manager) in Go templates and drifted; this way there is no second copy, and the config is the
one the service's version means. A value the generator refuses (a memory limit too small for the
body cap, say) fails this container at pod start with the reason in its log
(`kubectl logs POD -c envoy-config`). Its resources are Envoy's, so it never raises the pod's
requests.
*/}}
{{- define "llm-admission.envoyConfigInit" -}}
{{- $e := .Values.envoy -}}
{{- $memory := "" -}}
{{- with $e.resources }}{{ with .limits }}{{ with .memory }}{{ $memory = . }}{{ end }}{{ end }}{{ end -}}
{{- if not $memory -}}
{{- fail "envoy.resources.limits.memory must be set: it sizes Envoy's overload manager (heap cap) and its connection cap against the per-connection buffer (admission.maxBodyBytes)" -}}
{{- end -}}
{{- if or (kindIs "float64" $memory) (kindIs "int64" $memory) (kindIs "int" $memory) }}{{ $memory = int64 $memory }}{{ end -}}
- name: envoy-config
  image: "{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
  - extproc
  - envoy-config
  - --output
  - /etc/envoy/envoy.yaml
  - --listen
  - "0.0.0.0:{{ int64 $e.port }}"
  - --admin
  - "127.0.0.1:{{ int64 $e.adminPort }}"
  - --health-listen
  - "0.0.0.0:{{ int64 $e.healthPort }}"
  - --extproc
  - {{ include "llm-admission.extprocHostPort" . | quote }}
  - --failure-mode
  - {{ .Values.admission.failureMode }}
  - --first-token-allowance
  - {{ $e.firstTokenAllowanceSeconds | toString | quote }}
  - --memory-limit
  - {{ $memory | toString | quote }}
  {{- with $e.maxDownstreamConnections }}
  - --max-downstream-connections
  - {{ int64 . | quote }}
  {{- end }}
  {{- include "llm-admission.admissionEnv" (dict "ctx" . "ledger" false) | nindent 2 }}
  resources:
    {{- toYaml $e.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
  - name: envoy-config
    mountPath: /etc/envoy
  - name: engines
    mountPath: /etc/llm-admission
    readOnly: true
  {{- include "llm-admission.tlsMount" . | nindent 2 }}
  {{- /* The service's mounts: a setting may name a file on them (estimate.tokenizer). */}}
  {{- with .Values.admission.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/*
The Envoy container, the same in both shapes: --concurrency from the CPU limit, the health
listener's probes, the preStop drain (configmap-envoy.yaml's prestop.sh, volume "envoy-hooks").
Its config is what the envoy-config init container wrote into the "envoy-config" emptyDir
(llm-admission.envoyConfigInit, llm-admission.envoyVolumes).
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
        command: [/bin/bash, /etc/envoy-hooks/prestop.sh]
  resources:
    {{- toYaml .Values.envoy.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.envoySecurityContext | nindent 4 }}
  volumeMounts:
  - name: envoy-config
    mountPath: /etc/envoy
    readOnly: true
  - name: envoy-hooks
    mountPath: /etc/envoy-hooks
    readOnly: true
  {{- include "llm-admission.tlsMount" . | nindent 2 }}
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

{{/* The volumes the Envoy container and its config init container mount (the init container
also mounts "engines", llm-admission.admissionVolumes): the generated bootstrap, written at pod
start, and the preStop hook. */}}
{{- define "llm-admission.envoyVolumes" -}}
- name: envoy-config
  emptyDir:
    sizeLimit: 1Mi
- name: envoy-hooks
  configMap:
    name: {{ include "llm-admission.fullname" . }}-envoy
{{- end -}}

{{/*
The admission service's settings as environment (and envFrom): the service container's, and the
Envoy pods' config init container's, so that both read the same settings by construction.
Argument: dict ctx, ledger (bool: include the ledger's connection settings, the Redis URL among
them; the init container leaves them out: the Envoy config does not depend on them, and the
shared shape's Envoy pods get no Redis credential; tests/unit/test_envoyconf.py holds that).
*/}}
{{- define "llm-admission.admissionEnv" -}}
{{- $ctx := .ctx -}}
{{- $a := $ctx.Values.admission -}}
{{- $shared := eq $ctx.Values.shape "shared" -}}
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
{{- if include "llm-admission.tls" $ctx }}
{{- $dir := include "llm-admission.tlsDir" $ctx }}
# mTLS (extproc.tls.secretName). The envoy-config init container reads these too: Envoy presents
# the same certificate and verifies the service with the same CA.
- name: EXTPROC_TLS_CERT
  value: "{{ $dir }}/tls.crt"
- name: EXTPROC_TLS_KEY
  value: "{{ $dir }}/tls.key"
- name: EXTPROC_TLS_CLIENT_CA
  value: "{{ $dir }}/ca.crt"
{{- end }}
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
{{- if $a.pollTimeoutSeconds }}
- name: ENGINE_POLL_TIMEOUT_SECONDS
  value: {{ $a.pollTimeoutSeconds | toString | quote }}
{{- end }}
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
- name: ADMISSION_WAIT_PREDICTION
  value: {{ $a.waitPrediction | quote }}
- name: ADMISSION_GENERATION_RESERVATION
  value: {{ $a.generationReservation | quote }}
- name: ADMISSION_GENERATION_FACTOR
  value: {{ $a.generationFactor | toString | quote }}
- name: ADMISSION_POLICY
  value: {{ $a.policy | quote }}
- name: ADMISSION_PROJECTION_QUANTILE
  value: {{ $a.projectionQuantile | toString | quote }}
- name: ADMISSION_PREEMPTION_MAX_COST_SECONDS
  value: {{ $a.preemptionMaxCostSeconds | toString | quote }}
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
- name: ADMISSION_ENGINE_DONE_AFTER_SECONDS
  value: {{ $a.engineDoneAfterSeconds | toString | quote }}
- name: ADMISSION_GATED_PATHS
  value: {{ join "," $a.gatedPaths | quote }}
- name: ADMISSION_PASS_PATHS
  value: {{ join "," $a.passPaths | quote }}
- name: ADMISSION_MODELS_REFRESH_SECONDS
  value: {{ $a.modelsRefreshSeconds | toString | quote }}
- name: EXTPROC_MAX_STREAMS
  value: {{ int64 $a.maxStreams | quote }}
- name: EXTPROC_LOG_LEVEL
  value: {{ $a.logLevel | quote }}
- name: EXTPROC_LOG_FORMAT
  value: {{ $a.logFormat | quote }}
{{- if .ledger }}
{{- $l := $ctx.Values.ledger }}
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
  value: {{ include "llm-admission.ledgerKeyPrefix" $ctx | quote }}
# The pod's name is its replica id in the shared state: a lease expiry names the pod that died.
- name: ADMISSION_REPLICA_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}
{{- end }}
{{- with $a.extraEnv }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- with $a.envFrom }}
envFrom:
{{- toYaml . | nindent 0 }}
{{- end }}
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
  {{- include "llm-admission.admissionEnv" (dict "ctx" . "ledger" true) | nindent 2 }}
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
  {{- include "llm-admission.tlsMount" . | nindent 2 }}
  {{- with $a.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* The volumes the admission container mounts (and, in the shared shape with mTLS, each Envoy
pod: the init container and Envoy mount the same Secret). */}}
{{- define "llm-admission.admissionVolumes" -}}
- name: engines
  configMap:
    name: {{ include "llm-admission.fullname" . }}-engines
{{- if include "llm-admission.tls" . }}
- name: extproc-tls
  secret:
    secretName: {{ .Values.extproc.tls.secretName | quote }}
{{- end }}
{{- end -}}

{{/* "true" when Envoy and the shared admission service speak mTLS (extproc.tls.secretName, shape
shared), else "". */}}
{{- define "llm-admission.tls" -}}
{{- if and (eq .Values.shape "shared") ((.Values.extproc).tls).secretName -}}true{{- end -}}
{{- end -}}

{{/* Where the mTLS Secret is mounted, the same path in every container that reads it: the service
(its own certificate and the client CA), the envoy-config init container (which writes these paths
into Envoy's extproc cluster) and Envoy (which reads them). */}}
{{- define "llm-admission.tlsDir" -}}/etc/llm-admission-tls{{- end -}}

{{/* The mTLS Secret's volume mount, when mTLS is on. */}}
{{- define "llm-admission.tlsMount" -}}
{{- if include "llm-admission.tls" . }}
- name: extproc-tls
  mountPath: {{ include "llm-admission.tlsDir" . }}
  readOnly: true
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
{{- if and (ne .Values.shape "shared") ((.Values.extproc).tls).secretName }}
{{- fail "extproc.tls.secretName: mTLS is for the shared shape, whose admission service other pods reach over the network. In the sidecar shape the service listens on the pod's own 127.0.0.1, which only that pod's containers reach; unset it, or use shape=shared" }}
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
