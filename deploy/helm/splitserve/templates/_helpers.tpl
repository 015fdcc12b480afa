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

{{/* TLS: the router's certificate Secret (existing, or the one cert-manager writes) and where the
router reads it. Sibling directories of the auth mount, so no read-only volume nests in another. */}}
{{- define "splitserve.tlsSecretName" -}}
{{- default (printf "%s-router-tls" (include "splitserve.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}
{{- define "splitserve.tlsMountPath" -}}/var/run/secrets/splitserve-tls{{- end -}}
{{- define "splitserve.clientCaMountPath" -}}/var/run/secrets/splitserve-client-ca{{- end -}}
{{- define "splitserve.testClientMountPath" -}}/var/run/secrets/splitserve-test-client{{- end -}}
{{- define "splitserve.mutualTls" -}}{{ if and .Values.tls.enabled .Values.tls.clientCA.existingSecret }}true{{ end }}{{- end -}}
{{- define "splitserve.testClientSecretName" -}}
{{- default (printf "%s-test-client-tls" (include "splitserve.fullname" .)) .Values.tls.testClientSecret -}}
{{- end -}}

{{/* The DNS names the router's certificate must carry: its Service, short and qualified. */}}
{{- define "splitserve.routerDnsNames" -}}
{{- $svc := printf "%s-router" (include "splitserve.fullname" .) -}}
{{- $ns := .Release.Namespace -}}
{{- toYaml (concat (list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns)) .Values.tls.certManager.extraDnsNames) -}}
{{- end -}}

{{/* Where Kubernetes' gRPC probes ask: the router port, or with TLS the plaintext health-only port. */}}
{{- define "splitserve.probePort" -}}
{{- if .Values.tls.enabled }}{{ .Values.tls.healthPort }}{{ else }}{{ .Values.router.port }}{{ end -}}
{{- end -}}

{{/* The flags every client command (the helm test pod's) needs to reach the router of this release. */}}
{{- define "splitserve.clientFlags" -}}
{{- $flags := list "--target" (printf "%s-router.%s.svc:%d" (include "splitserve.fullname" .) .Release.Namespace (int .Values.router.service.port)) -}}
{{- if .Values.tls.enabled -}}
{{- if .Values.tls.caKey -}}
{{- $flags = concat $flags (list "--tls-ca-file" (printf "%s/%s" (include "splitserve.tlsMountPath" .) .Values.tls.caKey)) -}}
{{- else -}}
{{- $flags = append $flags "--tls" -}}
{{- end -}}
{{- if include "splitserve.mutualTls" . -}}
{{- $dir := include "splitserve.testClientMountPath" . -}}
{{- $flags = concat $flags (list "--tls-cert-file" (printf "%s/tls.crt" $dir) "--tls-key-file" (printf "%s/tls.key" $dir)) -}}
{{- end -}}
{{- end -}}
{{- if .Values.auth.enabled -}}
{{- $flags = concat $flags (list "--auth-token-file" (printf "%s/%s" (include "splitserve.authMountPath" .) .Values.auth.secretKey)) -}}
{{- end -}}
{{- toJson $flags -}}
{{- end -}}

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
{{- if .Values.model.hubCache }}
- name: HF_HOME
  value: {{ .Values.model.hubCacheMountPath | quote }}
{{- end }}
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
{{- if .Values.model.hubCache }}
- name: hub-cache
  mountPath: {{ .Values.model.hubCacheMountPath }}
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
{{- with .Values.model.hubCache }}
- name: hub-cache
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* With model.download.enabled: the init container that fills the hub cache with model.dir (a Hub
id) before a pod that reads the model starts. `hf download` skips files the cache already holds, so
pods sharing one cache volume fetch the model once; the pod's other containers mount it read-only. */}}
{{- define "splitserve.modelDownload" -}}
{{- $download := .Values.model.download -}}
{{- if $download.enabled }}
- name: model-download
  image: {{ $download.image | default (include "splitserve.image" .) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["hf", "download", {{ .Values.model.dir | quote }}, "--revision", {{ .Values.config.model_revision | default "main" | quote }}
    {{- range $download.extraArgs }}, {{ . | quote }}{{ end }}]
  env:
    - name: HOME
      value: /tmp
    - name: HF_HOME
      value: {{ .Values.model.hubCacheMountPath | quote }}
    - name: HF_HUB_DISABLE_TELEMETRY
      value: "1"
    {{- if $download.tokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $download.tokenSecret }}
          key: {{ $download.tokenSecretKey }}
    {{- end }}
  resources:
    {{- toYaml $download.resources | nindent 4 }}
  securityContext:
    {{- include "splitserve.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: hub-cache
      mountPath: {{ .Values.model.hubCacheMountPath }}
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
{{- $model := .Values.model -}}
{{- if $model.download.enabled -}}
{{- if not $model.hubCache -}}
{{- fail "model.download.enabled: set model.hubCache to a writable volume source the download fills" -}}
{{- end -}}
{{- if or (not $model.dir) (hasPrefix "/" $model.dir) (ne (len (splitList "/" $model.dir)) 2) -}}
{{- fail (printf "model.download.enabled: model.dir must be a Hub id (ORG/NAME), got %q" $model.dir) -}}
{{- end -}}
{{- if (dig "persistentVolumeClaim" "readOnly" false $model.hubCache) -}}
{{- fail "model.download.enabled: model.hubCache.persistentVolumeClaim.readOnly must be false (the download writes to it; the serving containers still mount it read-only)" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.router.port)) -}}
{{- fail "metrics.port must differ from router.port (both listen in the router pod)" -}}
{{- end -}}
{{- if eq (int .Values.router.httpPort) (int .Values.router.port) -}}
{{- fail "router.httpPort must differ from router.port (both listen in the router pod)" -}}
{{- end -}}
{{- if and .Values.metrics.enabled (eq (int .Values.metrics.port) (int .Values.router.httpPort)) -}}
{{- fail "metrics.port must differ from router.httpPort (both listen in the router pod)" -}}
{{- end -}}
{{- $tls := .Values.tls -}}
{{- if $tls.enabled -}}
{{- if eq (int $tls.healthPort) (int .Values.router.port) -}}
{{- fail "tls.healthPort must differ from router.port (both listen in the router pod)" -}}
{{- end -}}
{{- if eq (int $tls.healthPort) (int .Values.router.httpPort) -}}
{{- fail "tls.healthPort must differ from router.httpPort (both listen in the router pod)" -}}
{{- end -}}
{{- if and .Values.metrics.enabled (eq (int $tls.healthPort) (int .Values.metrics.port)) -}}
{{- fail "tls.healthPort must differ from metrics.port (both listen in the router pod)" -}}
{{- end -}}
{{- if eq (not $tls.existingSecret) (not $tls.certManager.enabled) -}}
{{- fail "tls.enabled: set tls.existingSecret (a kubernetes.io/tls Secret) or tls.certManager.enabled, not both" -}}
{{- end -}}
{{- if and $tls.certManager.enabled (not $tls.certManager.issuerRef.name) -}}
{{- fail "tls.certManager.issuerRef.name: name the cert-manager Issuer or ClusterIssuer that signs the router's certificate" -}}
{{- end -}}
{{- if and (include "splitserve.mutualTls" .) .Values.test.enabled (not $tls.testClientSecret) (not $tls.certManager.enabled) -}}
{{- fail "tls.clientCA: the helm test pod needs a client certificate: set tls.testClientSecret (or test.enabled=false)" -}}
{{- end -}}
{{- end -}}
{{- $_ := include "splitserve.redisMode" . -}}
{{- end -}}

{{/* The router's anti-affinity: unless the release sets its own affinity, routers prefer different
nodes, so that one node's loss leaves a router serving. */}}
{{- define "splitserve.routerAffinity" -}}
{{- if .Values.router.affinity -}}
{{- toYaml .Values.router.affinity -}}
{{- else -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "splitserve.selectorLabels" (dict "ctx" . "component" "router") | nindent 12 }}
{{- end -}}
{{- end -}}

{{/* Secrets the router reads: the bearer token, its TLS certificate, the client CA (mutual TLS).
Whole-Secret volumes (no subPath), so a renewed certificate reaches the running pod. */}}
{{- define "splitserve.routerSecretMounts" -}}
{{- if .Values.auth.enabled }}
- name: auth
  mountPath: {{ include "splitserve.authMountPath" . }}
  readOnly: true
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "splitserve.tlsMountPath" . }}
  readOnly: true
{{- end }}
{{- if include "splitserve.mutualTls" . }}
- name: client-ca
  mountPath: {{ include "splitserve.clientCaMountPath" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "splitserve.routerSecretVolumes" -}}
{{- if .Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ include "splitserve.authSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.auth.secretKey }}
        path: {{ .Values.auth.secretKey }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "splitserve.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- if include "splitserve.mutualTls" . }}
- name: client-ca
  secret:
    secretName: {{ .Values.tls.clientCA.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.tls.clientCA.key }}
        path: {{ .Values.tls.clientCA.key }}
{{- end }}
{{- end -}}

{{/* What the helm test pod's containers share: environment, limits, lock-down, the secrets a client
of the release needs (token, the CA it trusts, its certificate under mutual TLS). */}}
{{- define "splitserve.testContainer" -}}
env:
  - name: HOME
    value: /tmp
resources:
  {{- toYaml .Values.test.resources | nindent 2 }}
securityContext:
  {{- include "splitserve.containerSecurityContext" . | nindent 2 }}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  {{- if .Values.auth.enabled }}
  - name: auth
    mountPath: {{ include "splitserve.authMountPath" . }}
    readOnly: true
  {{- end }}
  {{- if and .Values.tls.enabled .Values.tls.caKey }}
  - name: tls-ca
    mountPath: {{ include "splitserve.tlsMountPath" . }}
    readOnly: true
  {{- end }}
  {{- if include "splitserve.mutualTls" . }}
  - name: test-client
    mountPath: {{ include "splitserve.testClientMountPath" . }}
    readOnly: true
  {{- end }}
{{- end -}}

{{/* The router's startup, readiness and liveness probes, all asking `probe` (a Probe's handler). */}}
{{- define "splitserve.routerProbes" -}}
startupProbe:
  {{- toYaml .probe | nindent 2 }}
  periodSeconds: 10
  failureThreshold: {{ max 1 (div .router.startupSeconds 10) }}
readinessProbe:
  {{- toYaml .probe | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 3
livenessProbe:
  {{- toYaml .probe | nindent 2 }}
  periodSeconds: 15
  timeoutSeconds: 5
  failureThreshold: 4
{{- end -}}
