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

{{/* The namespaces the operator watches, comma-joined ("" with clusterScope: every namespace). */}}
{{- define "loraplex.operator.namespaces" -}}
{{- if not .Values.operator.clusterScope -}}
{{- .Values.operator.watchNamespaces | default (list .Release.Namespace) | join "," -}}
{{- end -}}
{{- end -}}

{{/* The operator's ClusterKopfPeering: one per release, cluster-wide whatever the watched namespaces. */}}
{{- define "loraplex.operator.peering" -}}
{{- printf "%s-operator" (include "loraplex.fullname" .) -}}
{{- end -}}

{{/* Secrets an InferenceDeployment may mount besides operator.policy.allowedSecrets: the chart's own. */}}
{{- define "loraplex.operator.allowedSecrets" -}}
{{- $secrets := list (printf "%s/%s" .Release.Namespace (include "loraplex.secretsName" .)) -}}
{{- range $namespace := .Values.web.discovery.namespaces -}}
{{- $secrets = append $secrets (printf "%s/%s" $namespace (include "loraplex.secretsName" $)) -}}
{{- end -}}
{{- with .Values.adapterStore.existingSecret -}}
{{- $secrets = append $secrets (printf "%s/%s" $.Release.Namespace .) -}}
{{- end -}}
{{- concat $secrets .Values.operator.policy.allowedSecrets | uniq | join "," -}}
{{- end -}}

{{/* What the operator does in a namespace it watches; exactly the calls of operator/*.py and kopf. */}}
{{- define "loraplex.operator.namespacedRules" -}}
# kopf lists and watches InferenceDeployments and patches its bookkeeping annotations onto them; each
# daemon reads its object back to stop once it is gone.
- apiGroups: [loraplex.dev]
  resources: [inferencedeployments]
  verbs: [get, list, watch, patch]
# status: phase, conditions, replicas, the last scaling decision.
- apiGroups: [loraplex.dev]
  resources: [inferencedeployments/status]
  verbs: [patch]
# The engine Deployment: kopf watches the owned ones, so a deleted or edited child is restored at once.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
# The other children are read and repaired on each resync; none of them is ever deleted by the operator
# (deleting the InferenceDeployment deletes them through owner references).
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
# The HPA exists only in autoscaling.mode=hpa: leaving that mode deletes it.
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete]
# Engine pods are listed to scrape their /metrics and to report why one cannot start.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
# Events: kopf posts them; the operator's own (scaling, refusals) are read back and counted on repeat.
- apiGroups: [""]
  resources: [events]
  verbs: [get, create, patch]
{{- if .Values.inferencePools.enabled }}
# InferencePools of CRs with spec.inferencePool: read and repaired like the other children, deleted when
# the spec drops it.
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
{{- end }}
{{- end -}}
