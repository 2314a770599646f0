{{/*
Rules across values that values.schema.json cannot express. Each one fails the render
with a message naming the values, so no combination of values silently disagrees.
*/}}
{{- define "pagoda.validate" -}}
{{- $v := .Values -}}

{{- if $v.redis.enabled -}}
{{- if or $v.redis.externalUrl $v.redis.externalUrlSecret.name -}}
{{- fail "redis: set redis.enabled=false to use redis.externalUrl or redis.externalUrlSecret.name (the chart's own Redis would be ignored)" -}}
{{- end -}}
{{- else -}}
{{- if not (or $v.redis.externalUrl $v.redis.externalUrlSecret.name) -}}
{{- fail "redis: with redis.enabled=false set redis.externalUrl or redis.externalUrlSecret.name" -}}
{{- end -}}
{{- if and $v.redis.externalUrl $v.redis.externalUrlSecret.name -}}
{{- fail "redis: set only one of redis.externalUrl and redis.externalUrlSecret.name" -}}
{{- end -}}
{{- end -}}

{{- if and (not $v.redis.enabled) $v.redis.auth.enabled (not $v.redis.auth.existingSecret) -}}
{{- fail "redis.auth: with an external Redis set redis.auth.existingSecret (a Secret holding its password), or redis.auth.enabled=false when the URL in redis.externalUrlSecret carries the password" -}}
{{- end -}}

{{- with $v.inferencePool -}}
{{- if and .enabled .httpRoute.enabled (not .httpRoute.parentRefs) -}}
{{- fail "inferencePool.httpRoute.parentRefs: name the Gateway(s) the route attaches to, or set inferencePool.httpRoute.enabled=false" -}}
{{- end -}}
{{- if and .enabled (eq (int .targetPort) (int $v.scheduler.port)) -}}
{{- fail "inferencePool.targetPort must differ from scheduler.port (both listen in the scheduler pod)" -}}
{{- end -}}
{{- end -}}

{{- with $v.global.lora -}}
{{- if and (not .enabled) (or .modules .allowRuntimeUpdating) -}}
{{- fail "global.lora: modules and allowRuntimeUpdating need global.lora.enabled=true (the replicas must run with --enable-lora)" -}}
{{- end -}}
{{- if and .maxCpuLoras (lt (int .maxCpuLoras) (int .maxLoras)) -}}
{{- fail "global.lora.maxCpuLoras must be 0 or at least maxLoras" -}}
{{- end -}}
{{- end -}}

{{- if and $v.gateway.apiKey.value $v.gateway.apiKey.existingSecret -}}
{{- fail "gateway.apiKey: set only one of value and existingSecret" -}}
{{- end -}}

{{- $drain := add $v.scheduler.drain.preStopSleepSeconds $v.scheduler.drain.timeoutSeconds 5 -}}
{{- if lt (int $v.scheduler.terminationGracePeriodSeconds) (int $drain) -}}
{{- fail (printf "scheduler.terminationGracePeriodSeconds (%v) must be at least drain.preStopSleepSeconds + drain.timeoutSeconds + 5 = %v, or Kubernetes kills replicas mid-drain" $v.scheduler.terminationGracePeriodSeconds $drain) -}}
{{- end -}}
{{- if le (int $v.gateway.terminationGracePeriodSeconds) (add $v.gateway.preStopSleepSeconds 5) -}}
{{- fail "gateway.terminationGracePeriodSeconds must exceed gateway.preStopSleepSeconds + 5 (in-flight streams get the difference less 5 s to finish: --shutdown-grace-period)" -}}
{{- end -}}

{{- if and $v.scheduler.autoscaling.enabled $v.scheduler.keda.enabled -}}
{{- fail "scheduler: enable either autoscaling (HPA) or keda (which creates its own HPA), not both" -}}
{{- end -}}
{{- with $v.scheduler.autoscaling -}}
{{- if and .enabled (not (or .targetCPUUtilizationPercentage .targetNumRequestsWaiting)) -}}
{{- fail "scheduler.autoscaling: set targetCPUUtilizationPercentage or targetNumRequestsWaiting above 0" -}}
{{- end -}}
{{- end -}}
{{- range $name := list "gateway" "tokenizer" "scheduler" -}}
{{- $c := index $v $name -}}
{{- if $c.autoscaling.enabled -}}
{{- if gt (int $c.autoscaling.minReplicas) (int $c.autoscaling.maxReplicas) -}}
{{- fail (printf "%s.autoscaling: minReplicas exceeds maxReplicas" $name) -}}
{{- end -}}
{{- if and $c.autoscaling.targetCPUUtilizationPercentage (not (and $c.resources.requests $c.resources.requests.cpu)) -}}
{{- fail (printf "%s.autoscaling: CPU utilization needs %s.resources.requests.cpu" $name $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.scheduler.keda.enabled (gt (int $v.scheduler.keda.minReplicas) (int $v.scheduler.keda.maxReplicas)) -}}
{{- fail "scheduler.keda: minReplicas exceeds maxReplicas" -}}
{{- end -}}

{{- with $v.disaggregation -}}
{{- if .enabled -}}
{{- $g := $v.global -}}
{{- if or $v.scheduler.autoscaling.enabled $v.scheduler.keda.enabled -}}
{{- fail "disaggregation: scheduler.autoscaling and scheduler.keda do not apply to the prefill and decode pools; use disaggregation.prefill/decode.autoscaling or .keda" -}}
{{- end -}}
{{- if le (float64 .kvLeaseTimeoutSeconds) (float64 .kvTransferTimeoutSeconds) -}}
{{- fail (printf "disaggregation.kvLeaseTimeoutSeconds (%v) must exceed kvTransferTimeoutSeconds (%v): a lease that ends first frees blocks a decode replica is still pulling" .kvLeaseTimeoutSeconds .kvTransferTimeoutSeconds) -}}
{{- end -}}
{{- range $name := list "prefill" "decode" -}}
{{- $p := index $v.disaggregation $name -}}
{{- if and $p.autoscaling.enabled $p.keda.enabled -}}
{{- fail (printf "disaggregation.%s: enable either autoscaling (HPA) or keda (which creates its own HPA), not both" $name) -}}
{{- end -}}
{{- with $p.autoscaling -}}
{{- if .enabled -}}
{{- if not (or .targetCPUUtilizationPercentage .targetNumRequestsWaiting) -}}
{{- fail (printf "disaggregation.%s.autoscaling: set targetCPUUtilizationPercentage or targetNumRequestsWaiting above 0" $name) -}}
{{- end -}}
{{- if gt (int .minReplicas) (int .maxReplicas) -}}
{{- fail (printf "disaggregation.%s.autoscaling: minReplicas exceeds maxReplicas" $name) -}}
{{- end -}}
{{- $requests := ($p.resources | default $v.scheduler.resources).requests | default dict -}}
{{- if and .targetCPUUtilizationPercentage (not $requests.cpu) -}}
{{- fail (printf "disaggregation.%s.autoscaling: CPU utilization needs disaggregation.%s.resources.requests.cpu (or scheduler.resources.requests.cpu)" $name $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $p.keda.enabled (gt (int $p.keda.minReplicas) (int $p.keda.maxReplicas)) -}}
{{- fail (printf "disaggregation.%s.keda: minReplicas exceeds maxReplicas" $name) -}}
{{- end -}}
{{- range $key := list "extraArgs" "gpuWorkerExtraArgs" -}}
{{- range $arg := index $p $key -}}
{{- if regexMatch "^(--(model|revision|tokenizer|block-size|dtype|kv-cache-dtype|quantization|device|prefix-cache-hash-seed|prefix-caching-hash-algo|tensor-parallel-size|pipeline-parallel-size|kv-transfer-config|kv-advertise-host)|-tp|-pp|-q)(=|$)" $arg -}}
{{- fail (printf "disaggregation.%s.%s: %s is set once for both pools (global, gpuWorker.dtype) or by the chart per pool, so prefill and decode cannot disagree" $name $key $arg) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $arg := concat $v.scheduler.extraArgs $v.gpuWorker.extraArgs -}}
{{- if regexMatch "^--(kv-transfer-config|kv-advertise-host)(=|$)" $arg -}}
{{- fail (printf "scheduler/gpuWorker.extraArgs: %s is set per pool by the chart while disaggregation.enabled" $arg) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- $enginePorts := list (int $v.scheduler.port) (int $v.scheduler.metricsPort) (int $v.gpuWorker.port) (int $v.gpuWorker.metricsPort) -}}
{{- if ne (len (uniq $enginePorts)) 4 -}}
{{- fail (printf "scheduler.port, scheduler.metricsPort, gpuWorker.port and gpuWorker.metricsPort share one pod's network and must differ (got %v)" $enginePorts) -}}
{{- end -}}
{{- range $name := list "tokenizer" "kvCacheManager" -}}
{{- $c := index $v $name -}}
{{- if eq (int $c.port) (int $c.metricsPort) -}}
{{- fail (printf "%s.port and %s.metricsPort must differ" $name $name) -}}
{{- end -}}
{{- end -}}

{{- range $section := list "requests" "limits" -}}
{{- if hasKey ($v.gpuWorker.resources | default dict) $section -}}
{{- if hasKey (index $v.gpuWorker.resources $section) "nvidia.com/gpu" -}}
{{- fail "gpuWorker.resources: do not set nvidia.com/gpu; the chart requests global.tensorParallelSize x global.pipelineParallelSize GPUs when global.device is cuda" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
