{{/* The egress rules every policy of networkpolicy.yaml has: DNS, the engines' ports, Redis (when
redisPort is set), networkPolicy.extraEgress. Argument: dict ctx, enginePorts (a dict whose keys
are the ports), redisPort ("" for none). */}}
{{- define "llm-admission.networkPolicyEgress" -}}
{{- $np := .ctx.Values.networkPolicy -}}
- to:
    {{- toYaml $np.dns.to | nindent 4 }}
  ports:
  - port: 53
    protocol: UDP
  - port: 53
    protocol: TCP
- ports:
  {{- range $port := keys .enginePorts | sortAlpha }}
  - port: {{ $port }}
    protocol: TCP
  {{- end }}
  {{- with $np.enginesTo }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- if .redisPort }}
- ports:
  - port: {{ .redisPort }}
    protocol: TCP
  {{- with $np.redisTo }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- with $np.extraEgress }}
{{ toYaml . }}
{{- end }}
{{- end -}}
