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

{{- define "loraplex.web.databaseSecret" -}}
{{- .Values.web.database.existingSecret | default (printf "%s-database" (include "loraplex.fullname" .)) -}}
{{- end -}}

{{- define "loraplex.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .appVersion) -}}
{{- end -}}
