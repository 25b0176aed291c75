{{/* Names, labels and small derived values shared by the templates. */}}

{{- define "dynamo-snapshot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dynamo-snapshot.fullname" -}}
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

{{- define "dynamo-snapshot.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Component-qualified object names ("<fullname>-controller"); 52 leaves room for the suffix. */}}
{{- define "dynamo-snapshot.componentName" -}}
{{- printf "%s-%s" (include "dynamo-snapshot.fullname" .root | trunc 52 | trimSuffix "-") .component -}}
{{- end -}}

{{/*
Labels. Not app.kubernetes.io/managed-by=dynamo-snapshot: that value is what the controller's informers
select its own worker pods and Jobs by, so Helm keeps its usual "Helm" there.
*/}}
{{- define "dynamo-snapshot.labels" -}}
helm.sh/chart: {{ include "dynamo-snapshot.chart" .root }}
{{ include "dynamo-snapshot.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: dynamo-snapshot
{{- end -}}

{{- define "dynamo-snapshot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dynamo-snapshot.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "dynamo-snapshot.serviceAccountName" -}}
{{- $sa := index .root.Values.serviceAccount .component -}}
{{- if $sa.create -}}
{{- default (include "dynamo-snapshot.componentName" .) $sa.name -}}
{{- else -}}
{{- required (printf "serviceAccount.%s.name is required when serviceAccount.%s.create is false" .component .component) $sa.name -}}
{{- end -}}
{{- end -}}

{{- define "dynamo-snapshot.image" -}}
{{- $img := (index .root.Values .component).image -}}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag) -}}
{{- end -}}

{{- define "dynamo-snapshot.leaseNamespace" -}}
{{- default .Release.Namespace .Values.controller.leaseNamespace -}}
{{- end -}}

{{- define "dynamo-snapshot.artifactsClaim" -}}
{{- default (include "dynamo-snapshot.componentName" (dict "root" . "component" "artifacts")) .Values.artifacts.persistence.existingClaim -}}
{{- end -}}

{{- define "dynamo-snapshot.seccompProfilePath" -}}
{{- printf "profiles/%s" .Values.agent.seccompProfile.fileName -}}
{{- end -}}
