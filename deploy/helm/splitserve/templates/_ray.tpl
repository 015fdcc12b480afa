{{/* Pod templates of the RayCluster's head and worker groups. */}}

{{/* `ray start --resources` takes a JSON object; KubeRay pastes rayStartParams into a bash command
line unquoted, so the JSON travels inside double quotes with its own quotes escaped. */}}
{{- define "splitserve.rayResourcesParam" -}}
{{- printf "\"%s\"" (toJson . | replace "\"" "\\\"") | squote -}}
{{- end -}}

{{/* The Ray container's spec shared by every group; call with (dict "ctx" $ "role" "head"|"worker"
"resources" ... "probePort" N). */}}
{{- define "splitserve.rayContainer" -}}
{{- $ctx := .ctx -}}
name: ray-{{ .role }}
image: {{ include "splitserve.image" $ctx }}
imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
env:
  {{- include "splitserve.env" $ctx | nindent 2 }}
ports:
  {{- if eq .role "head" }}
  - name: gcs-server
    containerPort: {{ include "splitserve.port.rayGcs" $ctx }}
    protocol: TCP
  - name: client
    containerPort: {{ include "splitserve.port.rayClient" $ctx }}
    protocol: TCP
  {{- end }}
  - name: raylet
    containerPort: {{ include "splitserve.port.raylet" $ctx }}
    protocol: TCP
  {{- with .metricsPort }}
  - name: worker-metrics
    containerPort: {{ . }}
    protocol: TCP
  {{- end }}
{{- /* Explicit probes: KubeRay injects its own only where none are set, and those call the Ray
dashboard agent over HTTP, which the image's ray core install does not run. GCS (head) and raylet
ports answer as long as Ray is up. */}}
readinessProbe:
  tcpSocket:
    port: {{ .probePort }}
  periodSeconds: 5
  failureThreshold: 6
livenessProbe:
  tcpSocket:
    port: {{ .probePort }}
  initialDelaySeconds: 30
  periodSeconds: 10
  failureThreshold: 6
resources:
  {{- toYaml .resources | nindent 2 }}
securityContext:
  {{- include "splitserve.containerSecurityContext" $ctx | nindent 2 }}
volumeMounts:
  {{- include "splitserve.volumeMounts" $ctx | nindent 2 }}
{{- end -}}

{{/* A pod template of the RayCluster; call with (dict "ctx" $ "component" ... "scheduling" ...
"container" <rendered container> "token" bool). `token`: mount the service-account token (the head,
with the planner on: its controller patches the RayCluster); every other pod runs without one. */}}
{{- define "splitserve.rayPodTemplate" -}}
{{- $ctx := .ctx -}}
metadata:
  labels:
    {{- include "splitserve.labels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
spec:
  serviceAccountName: {{ include "splitserve.serviceAccountName" $ctx }}
  automountServiceAccountToken: {{ .token | default false }}
  enableServiceLinks: false
  securityContext:
    {{- include "splitserve.podSecurityContext" $ctx.Values.podSecurity | nindent 4 }}
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "splitserve.scheduling" .scheduling | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- with include "splitserve.modelDownload" $ctx | trim }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    - {{ .container | indent 6 | trim }}
  volumes:
    {{- include "splitserve.volumes" $ctx | nindent 4 }}
{{- end -}}

{{/* One worker group: `actors` Ray actors (ranks) of the pool per pod, each taking one unit of the
pool's custom resource, pool.numCpus logical CPUs and, with GPUs, one GPU. */}}
{{- define "splitserve.rayWorkerGroup" -}}
{{- $ctx := .ctx -}}
{{- $pool := .pool -}}
{{- $gpu := $ctx.Values.gpu -}}
{{- $resources := deepCopy $pool.resources -}}
{{- $scheduling := dict "affinity" $pool.affinity "nodeSelector" $pool.nodeSelector "tolerations" $pool.tolerations -}}
{{- if $gpu.enabled }}
{{- $_ := set $resources "limits" (merge (dict $gpu.resourceName (.actors | int64 | toString)) ($resources.limits | default dict)) -}}
{{- $_ = set $scheduling "nodeSelector" (merge (deepCopy ($pool.nodeSelector | default dict)) $gpu.nodeSelector) -}}
{{- $_ = set $scheduling "tolerations" (concat ($pool.tolerations | default list) $gpu.tolerations) -}}
{{- end }}
{{- $container := dict "ctx" $ctx "role" "worker" "resources" $resources "probePort" (include "splitserve.port.raylet" $ctx) -}}
{{- $_ := set $container "metricsPort" (get (include "splitserve.workerMetricsPorts" $ctx | fromYaml) .name) -}}
- groupName: {{ .name }}
  # The controller starts a fixed number of actors; with the planner on, it patches replicas (raising
  # maxReplicas as needed) and names the drained pods in scaleStrategy.workersToDelete on the way down.
  replicas: {{ $pool.replicas | int64 }}
  minReplicas: {{ $pool.replicas | int64 }}
  maxReplicas: {{ $pool.replicas | int64 }}
  rayStartParams:
    num-cpus: {{ mulf $pool.numCpus .actors | ceil | int | quote }}
    {{- if $gpu.enabled }}
    num-gpus: {{ .actors | int64 | quote }}
    {{- end }}
    resources: {{ include "splitserve.rayResourcesParam" (dict $pool.rayResource .actors) }}
    node-manager-port: {{ include "splitserve.port.raylet" $ctx | quote }}
  template:
    {{- include "splitserve.rayPodTemplate" (dict "ctx" $ctx "component" (printf "ray-%s" .name) "scheduling" $scheduling "container" (include "splitserve.rayContainer" $container)) | nindent 4 }}
{{- end -}}

{{/* The fixed metrics port of each pool's workers ({prefill: N, decode: N}; 0 or unset: none), from
config.<pool>.metrics_port: one exporter per worker pod (a decode instance's rank 0 serves it). */}}
{{- define "splitserve.workerMetricsPorts" -}}
{{- $cfg := .Values.config | default dict -}}
prefill: {{ (get ($cfg.prefill | default dict) "metrics_port") | default 0 }}
decode: {{ (get ($cfg.decode | default dict) "metrics_port") | default 0 }}
{{- end -}}
