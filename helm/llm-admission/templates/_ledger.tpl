{{/* ADMISSION_LEDGER_KEY_PREFIX: ledger.keyPrefix, or "NAMESPACE.FULLNAME" so that two releases
sharing one Redis never share gate state unless told to. Longer than the 64 characters the
service accepts: its first 55 characters, ".", and 8 hex digits of its SHA-256 (still unique). */}}
{{- define "llm-admission.ledgerKeyPrefix" -}}
{{- if .Values.ledger.keyPrefix -}}
{{- .Values.ledger.keyPrefix -}}
{{- else -}}
{{- $p := printf "%s.%s" .Release.Namespace (include "llm-admission.fullname" .) -}}
{{- if gt (len $p) 64 -}}
{{- $p = printf "%s.%s" (trunc 55 $p) (sha256sum $p | trunc 8) -}}
{{- end -}}
{{- $p -}}
{{- end -}}
{{- end -}}
