{{/* Names, labels and the pieces every pod of the release shares. */}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
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

{{/* KubeRay names the head Service "<cluster>-head-svc" and trims names over 50 characters from
the front; 41 characters keep the name the router dials exactly the one KubeRay creates. */}}
{{- define "splitserve.rayClusterName" -}}
{{- include "splitserve.fullname" . | trunc 41 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.rayAddress" -}}
{{- printf "ray://%s-head-svc.%s.svc:%d" (include "splitserve.rayClusterName" .) .Release.Namespace (include "splitserve.port.rayClient" . | int) -}}
{{- end -}}

{{/* Fixed Ray ports: KubeRay's defaults for GCS and the Ray client, and a pinned raylet port so that
the worker liveness probe has something to dial (Ray picks a random one otherwise). */}}
{{- define "splitserve.port.rayGcs" -}}6379{{- end -}}
{{- define "splitserve.port.rayClient" -}}10001{{- end -}}
{{- define "splitserve.port.raylet" -}}6380{{- end -}}
{{- define "splitserve.port.redis" -}}6379{{- end -}}

{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that select the release's pods; call with (dict "ctx" $ "component" "router"). */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
helm.sh/chart: {{ include "splitserve.chart" .ctx }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Where the prefix index lives: external-url, external-secret, bundled or none. */}}
{{- define "splitserve.redisMode" -}}
{{- $ext := .Values.redis.external -}}
{{- if and $ext.url $ext.existingSecret -}}
{{- fail "redis.external: set url or existingSecret, not both" -}}
{{- else if $ext.url -}}external-url
{{- else if $ext.existingSecret -}}external-secret
{{- else if .Values.redis.enabled -}}bundled
{{- else -}}none
{{- end -}}
{{- end -}}

{{- define "splitserve.authSecretName" -}}
{{- default (printf "%s-auth" (include "splitserve.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The token file sits outside /etc/splitserve so the two read-only volumes never nest. */}}
{{- define "splitserve.authMountPath" -}}/var/run/secrets/splitserve{{- end -}}

{{- define "splitserve.configPath" -}}/etc/splitserve/cluster.yaml{{- end -}}

{{/* The pod-level security context every pod of the release runs with. */}}
{{- define "splitserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .runAsUser | int64 }}
runAsGroup: {{ .runAsGroup | int64 }}
fsGroup: {{ .fsGroup | int64 }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "splitserve.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The root filesystem is read-only: HOME (caches, compiled kernels, Ray's session files) and
/tmp live on a scratch volume. */}}
{{- define "splitserve.env" -}}
- name: HOME
  value: /tmp
- name: HF_HUB_OFFLINE
  value: "1"
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- end -}}

{{- define "splitserve.volumeMounts" -}}
- name: config
  mountPath: /etc/splitserve
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "splitserve.volumes" -}}
- name: config
  configMap:
    name: {{ include "splitserve.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- with .Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Scheduling keys of one component; call with the component's values (and gpu for workers). */}}
{{- define "splitserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Cross-field rules the values schema cannot express. */}}
{{- define "splitserve.validate" -}}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.router.port)) -}}
{{- fail "metrics.port must differ from router.port (both listen in the router pod)" -}}
{{- end -}}
{{- if eq (int .Values.router.httpPort) (int .Values.router.port) -}}
{{- fail "router.httpPort must differ from router.port (both listen in the router pod)" -}}
{{- end -}}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.router.httpPort)) -}}
{{- fail "metrics.port must differ from router.httpPort (both listen in the router pod)" -}}
{{- end -}}
{{- $_ := include "splitserve.redisMode" . -}}
{{- end -}}
