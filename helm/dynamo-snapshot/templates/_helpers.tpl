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

{{/*
What the workers the agent launches itself (runc + launchWorkloads) see read-only besides agent.hostBinds:
the agent image's own system directories (DEFAULT_HOST_BINDS in dynamo_snapshot/agent/runtime/runc.py).
*/}}
{{- define "dynamo-snapshot.imageBinds" -}}
["/usr","/etc","/opt"]
{{- end -}}

{{/*
A bind's volume name, from its path alone (a reordered list renames nothing): a DNS-1123 label of at most
7 + 1 + 40 + 1 + 8 = 57 characters. The hash of the exact path keeps apart paths whose readable part is
the same once lowercased, stripped of other characters or cut short.
*/}}
{{- define "dynamo-snapshot.bindVolumeName" -}}
{{- $slug := regexReplaceAll "[^a-z0-9]+" (lower .path) "-" | trimAll "-" | trunc 40 | trimSuffix "-" -}}
{{- $hash := sha256sum .path | trunc 8 -}}
{{- if $slug -}}
{{- printf "%s-%s-%s" .prefix $slug $hash -}}
{{- else -}}
{{- printf "%s-%s" .prefix $hash -}}
{{- end -}}
{{- end -}}

{{/*
agent.hostBinds and agent.writableBinds as the DaemonSet mounts them (a JSON list of {name, path,
readOnly}; empty unless runc + launchWorkloads, the only case where the agent binds them), after the checks
the schema cannot express (it has already made each path absolute, normalized and unique in its list):
- no path at or under a system directory of the agent image: the mount would hide the agent's own files
  (and the workers see the image's /usr, /etc and /opt anyway);
- no writable bind at or under a read-only one (the agent refuses to start: CRIU does not restore a bind
  nested in another);
- no two agent mounts at one path (the API server refuses the pod).
*/}}
{{- define "dynamo-snapshot.agentBinds" -}}
{{- $a := .Values.agent -}}
{{- $under := list "/usr" "/etc" "/opt" "/bin" "/sbin" "/lib" "/lib32" "/lib64" "/libx32" "/proc" "/sys" "/dev" -}}
{{- $exact := list "/run" "/var" -}}
{{- $readOnly := concat (include "dynamo-snapshot.imageBinds" . | fromJsonArray) $a.hostBinds -}}
{{- range $key, $paths := dict "hostBinds" $a.hostBinds "writableBinds" $a.writableBinds -}}
{{- range $paths -}}
{{- $p := . -}}
{{- range $under -}}
{{- if or (eq $p .) (hasPrefix (printf "%s/" .) $p) -}}
{{- fail (printf "agent.%s: %s would hide the agent container's own %s; bind a directory outside it" $key $p .) -}}
{{- end -}}
{{- end -}}
{{- if has $p $exact -}}
{{- fail (printf "agent.%s: %s would hide the agent container's own %s; bind a directory below it" $key $p $p) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $w := $a.writableBinds -}}
{{- range $readOnly -}}
{{- if or (eq $w .) (hasPrefix (printf "%s/" .) $w) -}}
{{- fail (printf "agent.writableBinds: %s is or lies inside the read-only bind %s (the agent would refuse to start)" $w .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $a.launchWorkloads (eq $a.runtime "containerd") -}}
{{- fail "agent.launchWorkloads starts workers without a kubelet: set agent.runtime to runc or local (containerd's containers are the kubelet's)" -}}
{{- end -}}
{{- $binds := list -}}
{{- if and $a.launchWorkloads (eq $a.runtime "runc") -}}
{{- range $a.hostBinds -}}
{{- $binds = append $binds (dict "name" (include "dynamo-snapshot.bindVolumeName" (dict "prefix" "bind-ro" "path" .)) "path" . "readOnly" true) -}}
{{- end -}}
{{- range $a.writableBinds -}}
{{- $binds = append $binds (dict "name" (include "dynamo-snapshot.bindVolumeName" (dict "prefix" "bind-rw" "path" .)) "path" . "readOnly" false) -}}
{{- end -}}
{{- end -}}
{{- /* Every mount of the agent container, by cleaned path. */ -}}
{{- $mounts := dict -}}
{{- $fixed := list (list "/etc/dynamo-snapshot" "the agent's config") (list .Values.artifacts.mountPath "artifacts.mountPath") (list $a.controlRoot "agent.controlRoot") (list $a.stateRoot "agent.stateRoot") -}}
{{- if ne $a.runtime "local" -}}
{{- range $a.runtimeHostPaths -}}
{{- $fixed = append $fixed (list . "agent.runtimeHostPaths") -}}
{{- end -}}
{{- end -}}
{{- range $binds -}}
{{- $fixed = append $fixed (list .path (ternary "agent.hostBinds" "agent.writableBinds" .readOnly)) -}}
{{- end -}}
{{- range $fixed -}}
{{- $path := clean (index . 0) -}}
{{- if hasKey $mounts $path -}}
{{- fail (printf "%s and %s both mount %s in the agent" (get $mounts $path) (index . 1) $path) -}}
{{- end -}}
{{- $_ := set $mounts $path (index . 1) -}}
{{- end -}}
{{- $names := dict -}}
{{- range $binds -}}
{{- if hasKey $names .name -}}
{{- fail (printf "agent binds %s and %s got one volume name %s" (get $names .name) .path .name) -}}
{{- end -}}
{{- $_ := set $names .name .path -}}
{{- end -}}
{{- toJson $binds -}}
{{- end -}}

{{/*
Refuses, at install and upgrade (lookup answers only against a cluster: helm install/upgrade, or helm
template --dry-run=server), to take over a DynamoGraphDeployment CRD this release does not own: NVIDIA's
Dynamo operator's (no label snapshot.nvidia.com/crd-owner=dynamo-snapshot), or ours applied outside this
release. Helm would otherwise replace the operator's schema with ours, or stop at its own ownership check
with a message that names no way out.
*/}}
{{- define "dynamo-snapshot.dgdCrdGuard" -}}
{{- $name := "dynamographdeployments.nvidia.com" -}}
{{- $crd := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" $name -}}
{{- if $crd -}}
{{- $labels := $crd.metadata.labels | default dict -}}
{{- $annotations := $crd.metadata.annotations | default dict -}}
{{- $release := get $annotations "meta.helm.sh/release-name" -}}
{{- $releaseNs := get $annotations "meta.helm.sh/release-namespace" -}}
{{- if ne (get $labels "snapshot.nvidia.com/crd-owner") "dynamo-snapshot" -}}
{{- fail (printf "mode=standalone installs dynamo-snapshot's DynamoGraphDeployment CRD, but the cluster has a CustomResourceDefinition %s that is not dynamo-snapshot's (no label snapshot.nvidia.com/crd-owner=dynamo-snapshot; NVIDIA's Dynamo operator installs one of this name). To install beside that operator, set mode=dynamo-operator. If an older dynamo-snapshot chart installed it (those CRDs carry no such label), label it as dynamo-snapshot's and install again: kubectl label crd %s snapshot.nvidia.com/crd-owner=dynamo-snapshot" $name $name) -}}
{{- else if not $release -}}
{{- fail (printf "the CustomResourceDefinition %s is dynamo-snapshot's but belongs to no Helm release (applied from crds/, or by a chart version that kept it in crds/). Adopt it into this release, then install again: kubectl annotate crd %s meta.helm.sh/release-name=%s meta.helm.sh/release-namespace=%s && kubectl label crd %s app.kubernetes.io/managed-by=Helm" $name $name .Release.Name .Release.Namespace $name) -}}
{{- else if or (ne $release .Release.Name) (ne $releaseNs .Release.Namespace) -}}
{{- fail (printf "the CustomResourceDefinition %s belongs to the dynamo-snapshot release %s in namespace %s: one release per cluster runs mode=standalone. Upgrade that release instead" $name $release $releaseNs) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The controller webhook's Service name, its TLS Secret and the CA the apiserver trusts for it, as YAML
(service, secretName, crt, key, caBundle; crt and key empty with webhook.certs.existingSecret). Made once
per render and kept in .Values: the restore webhook (webhook.yaml) and the DGD CRD's conversion webhook
(crd-dynamographdeployments.yaml) must trust the same generated CA.
*/}}
{{- define "dynamo-snapshot.webhookPki" -}}
{{- $w := .Values.webhook -}}
{{- if not (hasKey $w "_pki") -}}
{{- $name := include "dynamo-snapshot.componentName" (dict "root" . "component" "controller") -}}
{{- $service := printf "%s-webhook" $name -}}
{{- $pki := dict "service" $service "secretName" (printf "%s-webhook-tls" $name) "crt" "" "key" "" -}}
{{- if $w.certs.existingSecret -}}
{{- $_ := set $pki "caBundle" (required "webhook.certs.caBundle (base64 PEM of the CA that signed webhook.certs.existingSecret) is required with webhook.certs.existingSecret" $w.certs.caBundle) -}}
{{- else -}}
{{- /* An installed release keeps its CA and certificate: the apiserver trusts the caBundle it already has. */ -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $pki.secretName -}}
{{- $data := ($existing.data | default dict) -}}
{{- if and (index $data "tls.crt") (index $data "tls.key") (index $data "ca.crt") -}}
{{- $_ := set $pki "crt" (index $data "tls.crt") -}}
{{- $_ = set $pki "key" (index $data "tls.key") -}}
{{- $_ = set $pki "caBundle" (index $data "ca.crt") -}}
{{- else -}}
{{- $days := int $w.certs.validityDays -}}
{{- $ca := genCA (printf "%s-webhook-ca" $name) $days -}}
{{- $host := printf "%s.%s.svc" $service .Release.Namespace -}}
{{- $sans := list $service (printf "%s.%s" $service .Release.Namespace) $host (printf "%s.cluster.local" $host) -}}
{{- $cert := genSignedCert $host nil $sans $days $ca -}}
{{- $_ := set $pki "crt" ($cert.Cert | b64enc) -}}
{{- $_ = set $pki "key" ($cert.Key | b64enc) -}}
{{- $_ = set $pki "caBundle" ($ca.Cert | b64enc) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $w "_pki" $pki -}}
{{- end -}}
{{- toYaml (get $w "_pki") -}}
{{- end -}}

{{/* "true" where the agent keeps a node cache: asked for, or storage.type s3 (its fetched copies go there). */}}
{{- define "dynamo-snapshot.agentCache" -}}
{{- if or .Values.agent.cache.enabled (eq .Values.storage.type "s3") }}true{{ end }}
{{- end }}
