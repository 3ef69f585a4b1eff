{{/* Names and labels shared by every template. */}}
{{- define "loraplex.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.labels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplex
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "loraplex.operator.selector" -}}
app.kubernetes.io/name: loraplex-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loraplex.web.selector" -}}
app.kubernetes.io/name: loraplex-web
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loraplex.postgresql.selector" -}}
app.kubernetes.io/name: loraplex-postgresql
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The Secret holding the database URL: the user's, or the one this chart makes (external URL or in-chart Postgres). */}}
{{- define "loraplex.databaseSecret" -}}
{{- .Values.database.existingSecret | default (printf "%s-database" (include "loraplex.fullname" .)) -}}
{{- end -}}

{{- define "loraplex.databaseSecretKey" -}}
{{- if .Values.database.existingSecret -}}{{ .Values.database.secretKey }}{{- else -}}database-url{{- end -}}
{{- end -}}

{{/* The Secret shared by every control-plane replica (key pepper, session secret, internal and admin tokens). */}}
{{- define "loraplex.secretsName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "loraplex.fullname" .)) -}}
{{- end -}}

{{- define "loraplex.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .appVersion) -}}
{{- end -}}

{{/* Pod Security "restricted": a numeric non-root user, the runtime's seccomp profile. */}}
{{- define "loraplex.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .uid | default 65532 }}
runAsGroup: {{ .uid | default 65532 }}
fsGroup: {{ .uid | default 65532 }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "loraplex.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Where the control plane reads its database, its shared secrets and the adapter store: web pods and the migration Job alike. */}}
{{- define "loraplex.web.env" -}}
- name: LORAPLEX_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "loraplex.databaseSecret" . }}
      key: {{ include "loraplex.databaseSecretKey" . }}
# Scratch space only: state lives in the database and the adapter store.
- name: LORAPLEX_DATA_DIR
  value: /tmp/loraplex
{{- end -}}
