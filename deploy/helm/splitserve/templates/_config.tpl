{{/* The cluster config (common/config.py ClusterConfig.from_dict) the release runs with.
Chart-owned keys come from the chart's own values, everything else from `config` verbatim; the
values schema keeps the two sets apart, so no key has two sources. The Ray address is not in it: the
router's command line names it (`--ray-address`). */}}

{{- define "splitserve.poolConfig" -}}
{{- $pool := .pool -}}
{{- $owned := dict "replicas" $pool.replicas "tp_size" .tpSize "num_cpus" $pool.numCpus "ray_resource" $pool.rayResource -}}
{{- $_ := set $owned "num_gpus" (ternary 1 0 .gpu) -}}
{{- with .spec }}{{ $_ := set $owned "speculative_config" . }}{{ end -}}
{{- toYaml (merge $owned (deepCopy (.extra | default dict))) -}}
{{- end -}}

{{/* The planner's profile: a file of the config ConfigMap (mounted at /etc/splitserve on every pod). */}}
{{- define "splitserve.plannerProfileFile" -}}planner-profile.json{{- end -}}

{{- define "splitserve.clusterConfig" -}}
{{- $v := .Values -}}
{{- $cfg := deepCopy $v.config -}}
{{- $_ := set $cfg "cluster_name" (include "splitserve.fullname" .) -}}
{{- with $v.model.dir }}{{ $_ := set $cfg "model_dir" . }}{{ end -}}
{{- $_ = set $cfg "kv_cache_dtype" $v.quantization.kvCacheDtype -}}
{{- $_ = set $cfg "quantization" $v.quantization.weights -}}
{{- with $v.quantization.groupSize }}{{ $_ := set $cfg "quantization_group_size" . }}{{ end -}}
{{- $prefill := dict "pool" $v.prefill "tpSize" 1 "gpu" $v.gpu.enabled "extra" $cfg.prefill -}}
{{- $_ := set $cfg "prefill" (include "splitserve.poolConfig" $prefill | fromYaml) -}}
{{- $decode := dict "pool" $v.decode "tpSize" $v.decode.tpSize "gpu" $v.gpu.enabled "extra" $cfg.decode "spec" $v.decode.speculativeConfig -}}
{{- $_ = set $cfg "decode" (include "splitserve.poolConfig" $decode | fromYaml) -}}
{{- $router := deepCopy ($cfg.router | default dict) -}}
{{- $_ = set $router "host" "0.0.0.0" -}}
{{- $_ = set $router "port" $v.router.port -}}
{{- $_ = set $router "http_port" $v.router.httpPort -}}
{{- with $v.router.policy }}{{ $_ := set $router "policy" . }}{{ end -}}
{{- if $v.auth.enabled }}
{{- $_ = set $router "auth_token_file" (printf "%s/%s" (include "splitserve.authMountPath" .) $v.auth.secretKey) -}}
{{- end }}
{{- if $v.metrics.enabled }}
{{- $_ = set $router "metrics_port" $v.metrics.port -}}
{{- end }}
{{- if $v.tls.enabled }}
{{- $dir := include "splitserve.tlsMountPath" . -}}
{{- $_ = set $router "tls_cert_file" (printf "%s/tls.crt" $dir) -}}
{{- $_ = set $router "tls_key_file" (printf "%s/tls.key" $dir) -}}
{{- $_ = set $router "health_port" $v.tls.healthPort -}}
{{- if include "splitserve.mutualTls" . }}
{{- $_ = set $router "tls_client_ca_file" (printf "%s/%s" (include "splitserve.clientCaMountPath" .) $v.tls.clientCA.key) -}}
{{- end }}
{{- end }}
{{- $_ = set $cfg "router" $router -}}
{{- $planner := deepCopy ($cfg.planner | default dict) -}}
{{- $_ = set $planner "enabled" $v.planner.enabled -}}
{{- if $v.planner.enabled }}
{{- $_ = set $planner "profile_path" (printf "/etc/splitserve/%s" (include "splitserve.plannerProfileFile" .)) -}}
{{- $_ = set $planner "raycluster_name" (include "splitserve.rayClusterName" .) -}}
{{- $_ = set $planner "raycluster_namespace" .Release.Namespace -}}
{{- end }}
{{- $_ = set $cfg "planner" $planner -}}
{{- $mode := include "splitserve.redisMode" . -}}
{{- if eq $mode "external-url" }}
{{- $_ = set $cfg "redis_url" $v.redis.external.url -}}
{{- else if eq $mode "bundled" }}
{{- $_ = set $cfg "redis_url" (printf "redis://%s-redis.%s.svc:%s/0" (include "splitserve.fullname" .) .Release.Namespace (include "splitserve.port.redis" .)) -}}
{{- end }}
{{- toYaml $cfg -}}
{{- end -}}
