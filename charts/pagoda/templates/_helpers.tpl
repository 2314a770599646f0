{{/*
Names, labels and the pieces every pod shares. Component names are the service names of
the `pagoda <service>` CLI: gateway, tokenizer, scheduler, kv-cache-manager, redis.
Containers set only `args`: the image's entrypoint is `tini -- pagoda` (docker/Dockerfile),
so args start with the service name.
*/}}

{{- define "pagoda.fullname" -}}
{{- if contains "pagoda" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-pagoda" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* (list $ "component") -> "<fullname>-<component>" */}}
{{- define "pagoda.componentName" -}}
{{- printf "%s-%s" (include "pagoda.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{- define "pagoda.selectorLabels" -}}
app.kubernetes.io/name: pagoda
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pagoda.labels" -}}
{{ include "pagoda.selectorLabels" . }}
app.kubernetes.io/part-of: pagoda
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ (index . 0).Release.Service }}
helm.sh/chart: {{ printf "%s-%s" (index . 0).Chart.Name (index . 0).Chart.Version }}
{{- end -}}

{{- define "pagoda.image" -}}
{{- $img := .Values.global.image -}}
{{- $tag := $img.tag | default (printf "%s-%s" .Chart.AppVersion .Values.global.device) -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}

{{/* Addresses the services are given for each other. */}}
{{- /* Every Ready tokenizer pod (the headless Service's A records): the gateway balances
over them round-robin and retries an idempotent call on another one. */}}
{{- define "pagoda.tokenizerAddr" -}}
{{- printf "dns:///%s.%s.svc.%s:%v" (include "pagoda.componentName" (list . "tokenizer")) .Release.Namespace .Values.global.clusterDomain .Values.tokenizer.port -}}
{{- end -}}

{{- define "pagoda.kvCacheManagerAddr" -}}
{{- printf "%s:%v" (include "pagoda.componentName" (list . "kv-cache-manager")) .Values.kvCacheManager.port -}}
{{- end -}}

{{/*
The engine pods' components: "scheduler" (colocated replicas, the default), or "prefill"
and "decode" with disaggregation.enabled. Comma-separated (splitList "," to range).
*/}}
{{- define "pagoda.engineComponents" -}}
{{- ternary "prefill,decode" "scheduler" .Values.disaggregation.enabled -}}
{{- end -}}

{{/*
The engine pools, as a JSON list (fromJsonArray), one per engine component: its name, KV
role ("" colocated: the engine's default kv_both) and the values that may differ between
pools (tensor-parallel size included: KV blocks travel whole between differently split
workers). A pool value of 0 or {} takes the scheduler's / gpuWorker's.
*/}}
{{- define "pagoda.enginePools" -}}
{{- $s := .Values.scheduler -}}
{{- $w := .Values.gpuWorker -}}
{{- $pools := list -}}
{{- if .Values.disaggregation.enabled -}}
{{- range $name := list "prefill" "decode" -}}
{{- $p := index $.Values.disaggregation $name -}}
{{- $pools = append $pools (dict "component" $name
      "kvRole" (ternary "kv_producer" "kv_consumer" (eq $name "prefill"))
      "replicas" $p.replicas "autoscaling" $p.autoscaling "keda" $p.keda "pdb" $p.pdb
      "tensorParallelSize" ($p.tensorParallelSize | default $.Values.global.tensorParallelSize)
      "maxNumSeqs" ($p.maxNumSeqs | default $s.maxNumSeqs)
      "maxNumBatchedTokens" ($p.maxNumBatchedTokens | default $s.maxNumBatchedTokens)
      "resources" ($p.resources | default $s.resources)
      "gpuWorkerResources" ($p.gpuWorkerResources | default $w.resources)
      "extraArgs" (concat $s.extraArgs $p.extraArgs)
      "gpuWorkerExtraArgs" (concat $w.extraArgs $p.gpuWorkerExtraArgs)) -}}
{{- end -}}
{{- else -}}
{{- $pools = list (dict "component" "scheduler" "kvRole" ""
      "replicas" $s.replicas "autoscaling" $s.autoscaling "keda" $s.keda "pdb" $s.pdb
      "tensorParallelSize" .Values.global.tensorParallelSize
      "maxNumSeqs" $s.maxNumSeqs "maxNumBatchedTokens" $s.maxNumBatchedTokens
      "resources" $s.resources "gpuWorkerResources" $w.resources
      "extraArgs" $s.extraArgs "gpuWorkerExtraArgs" $w.extraArgs) -}}
{{- end -}}
{{- toJson $pools -}}
{{- end -}}

{{/* (list $ component) -> an engine pool's headless Service: its EndpointSlices (or its
A records) are the pool's replicas. */}}
{{- define "pagoda.headless" -}}
{{- printf "%s-headless" (include "pagoda.componentName" .) -}}
{{- end -}}

{{- define "pagoda.schedulerHeadless" -}}
{{- include "pagoda.headless" (list . "scheduler") -}}
{{- end -}}

{{/* --scheduler-addrs of the gateway: every engine pool's headless Service, comma-separated
(with disaggregation the gateway reads each replica's role from GetModelInfo). */}}
{{- define "pagoda.schedulerAddrs" -}}
{{- $addrs := list -}}
{{- range $component := splitList "," (include "pagoda.engineComponents" .) -}}
{{- $name := include "pagoda.headless" (list $ $component) -}}
{{- if eq $.Values.gateway.schedulerDiscovery "k8s" -}}
{{- $addrs = append $addrs (printf "k8s://%s/%s:%v" $.Release.Namespace $name $.Values.scheduler.port) -}}
{{- else -}}
{{- $addrs = append $addrs (printf "dns:///%s.%s.svc.%s:%v" $name $.Release.Namespace $.Values.global.clusterDomain $.Values.scheduler.port) -}}
{{- end -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* The endpoint picker's replicas: the pool's schedulers by DNS (every pod IP; the picker
names a member by its IP at the pool's target port). */}}
{{- define "pagoda.eppSchedulerAddrs" -}}
{{- $component := ternary "decode" "scheduler" .Values.disaggregation.enabled -}}
{{- printf "dns:///%s.%s.svc.%s:%v" (include "pagoda.headless" (list . $component)) .Release.Namespace .Values.global.clusterDomain .Values.scheduler.port -}}
{{- end -}}

{{- define "pagoda.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:%v/0" (include "pagoda.componentName" (list . "redis")) .Values.redis.port -}}
{{- else -}}
{{- .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Pod-level hardening shared by every Pagoda pod (the image runs as uid 10001). */}}
{{- define "pagoda.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "pagoda.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "pagoda.imagePullSecrets" -}}
{{- with .Values.global.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Environment of every Pagoda container: HOME on the writable /tmp volume (the root
filesystem is read-only), the model cache as HF_HOME, then the component's extraEnv.
Call with (list $ extraEnv).
*/}}
{{- define "pagoda.env" -}}
{{- $ := index . 0 -}}
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
- name: HF_HOME
  value: {{ printf "%s/huggingface" $.Values.global.modelCache.mountPath | quote }}
{{- range index . 1 }}
- name: {{ .name }}
  value: {{ .value | quote }}
{{- end }}
{{- end -}}

{{/* "true" when global.model is a Hugging Face id (anything but an absolute path). */}}
{{- define "pagoda.modelFromHub" -}}
{{- if not (hasPrefix "/" .Values.global.model) }}true{{ end -}}
{{- end -}}

{{/*
The init container of a pod that loads the model (engine pod, tokenizer pod) when
global.model is a Hugging Face id: `pagoda download` into the model cache. It is the only
container that gets the token (HF_TOKEN from global.hfTokenSecret); the pod's containers
start after it, offline (`pagoda.modelEnv`). Call with (list $ tokenizerOnly resources).
*/}}
{{- define "pagoda.downloadInitContainer" -}}
{{- $ := index . 0 -}}
{{- $g := $.Values.global -}}
{{- if include "pagoda.modelFromHub" $ }}
initContainers:
  - name: download-model
    image: {{ include "pagoda.image" $ }}
    imagePullPolicy: {{ $g.image.pullPolicy }}
    args:
      - download
      - {{ $g.model | quote }}
      {{- with $g.revision }}
      - {{ printf "--revision=%s" . | quote }}
      {{- end }}
      {{- if index . 1 }}
      - --tokenizer-only
      {{- end }}
    env:
      {{- include "pagoda.env" (list $ (list)) | nindent 6 }}
      {{- with $g.hfTokenSecret }}
      {{- if .name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ .name }}
            key: {{ .key }}
      {{- end }}
      {{- end }}
    resources:
      {{- toYaml (index . 2) | nindent 6 }}
    securityContext:
      {{- include "pagoda.containerSecurityContext" $ | nindent 6 }}
    volumeMounts:
      {{- include "pagoda.volumeMounts" (list $ true) | nindent 6 }}
{{- end }}
{{- end -}}

{{/*
Environment of a container that loads the model, after its pod's download init container:
HF_HUB_OFFLINE=1, so it reads the cache and never downloads (nor races its pod's other
container writing the same files).
*/}}
{{- define "pagoda.modelEnv" -}}
{{- if include "pagoda.modelFromHub" . }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- end -}}

{{/* Volumes: writable /tmp for every Pagoda pod; the model cache for those that load it;
the gRPC TLS Secret when global.grpcTls is on. */}}
{{- define "pagoda.volumes" -}}
- name: tmp
  emptyDir: {}
{{- with (index . 0).Values.global.grpcTls.secretName }}
- name: grpc-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- if index . 1 }}
{{- with (index . 0).Values.global.modelCache }}
- name: model-cache
{{- if .existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .sizeLimit }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pagoda.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if index . 1 }}
- name: model-cache
  mountPath: {{ (index . 0).Values.global.modelCache.mountPath }}
{{- end }}
{{- end -}}

{{/*
Probes of a gRPC service: startup and readiness use the standard gRPC health protocol on
its port (readiness decides whether it receives traffic); liveness asks HTTP /health on the
metrics port. The startup probe allows probes.startupTimeoutSeconds for loading the model.
With `overHttp` (gRPC port under mutual TLS, which the kubelet's gRPC probe cannot speak,
or bound to 127.0.0.1) startup and readiness ask HTTP /health too.
Call with (list grpcPort metricsPort probes overHttp).
*/}}
{{- define "pagoda.grpcProbes" -}}
{{- $grpc := index . 0 -}}
{{- $metrics := index . 1 -}}
{{- $p := index . 2 -}}
{{- $check := dict "grpc" (dict "port" $grpc) -}}
{{- if index . 3 -}}
{{- $check = dict "httpGet" (dict "path" "/health" "port" $metrics) -}}
{{- end }}
startupProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: {{ include "pagoda.startupFailures" $p }}
readinessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: {{ $p.periodSeconds }}
  failureThreshold: 2
livenessProbe:
  httpGet:
    path: /health
    port: {{ $metrics }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{- define "pagoda.startupFailures" -}}
{{- $period := int .periodSeconds -}}
{{- max 1 (div (add (int .startupTimeoutSeconds) $period -1) $period) -}}
{{- end -}}

{{- define "pagoda.schedulingConstraints" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Engine flags of one model replica. The scheduler and the gpu-worker parse the same engine
arguments, so both containers get this one list: they cannot disagree on the model, block
size, KV-cache sizing or parallel layout. Call with (list $ pool) (pagoda.enginePools):
only the pool's batch limits differ between pools; the rest is set once for all of them.
*/}}
{{- define "pagoda.engineArgs" -}}
{{- $ := index . 0 -}}
{{- $pool := index . 1 -}}
{{- $g := $.Values.global -}}
{{- $s := $.Values.scheduler -}}
{{- $w := $.Values.gpuWorker -}}
- {{ printf "--model=%s" $g.model | quote }}
{{- with $g.revision }}
- {{ printf "--revision=%s" . | quote }}
{{- end }}
- --device={{ $g.device }}
- --dtype={{ $w.dtype }}
- --block-size={{ $g.blockSize }}
{{- if $s.maxModelLen }}
- --max-model-len={{ $s.maxModelLen }}
{{- end }}
- --max-num-seqs={{ int $pool.maxNumSeqs }}
- --max-waiting-requests={{ $s.maxWaitingRequests }}
- --max-num-batched-tokens={{ int $pool.maxNumBatchedTokens }}
- {{ ternary "--enable-prefix-caching" "--no-enable-prefix-caching" $s.enablePrefixCaching }}
{{- if $s.numGpuBlocksOverride }}
- --num-gpu-blocks-override={{ $s.numGpuBlocksOverride }}
{{- end }}
- --gpu-memory-utilization={{ $w.gpuMemoryUtilization }}
- --tensor-parallel-size={{ int $pool.tensorParallelSize }}
- --pipeline-parallel-size={{ $g.pipelineParallelSize }}
{{- with $g.lora }}
{{- if .enabled }}
- --enable-lora
- --max-loras={{ .maxLoras }}
- --max-lora-rank={{ .maxLoraRank }}
{{- if .maxCpuLoras }}
- --max-cpu-loras={{ .maxCpuLoras }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The gateway's LoRA flags (global.lora): the adapters served by name, in vLLM's JSON form.
*/}}
{{- define "pagoda.gatewayLoraArgs" -}}
{{- with .Values.global.lora }}
{{- if .modules }}
- --lora-modules
{{- range .modules }}
{{- $m := dict "name" .name "path" .path }}
{{- with .baseModelName }}{{- $_ := set $m "base_model_name" . }}{{- end }}
- {{ toJson $m | quote }}
{{- end }}
{{- end }}
{{- if .allowRuntimeUpdating }}
- --allow-runtime-lora-updating
{{- end }}
{{- end }}
{{- end -}}

{{/*
Mutual TLS on the gRPC ports (global.grpcTls): the flags every Pagoda service gets, and the
read-only mount of the Secret they name. "pagoda.grpcTlsOn" is "true" when it is on.
*/}}
{{- define "pagoda.grpcTlsOn" -}}
{{- if .Values.global.grpcTls.secretName }}true{{ end -}}
{{- end -}}

{{- define "pagoda.grpcTlsArgs" -}}
{{- if include "pagoda.grpcTlsOn" . -}}
- --grpc-tls-cert=/etc/pagoda/grpc-tls/tls.crt
- --grpc-tls-key=/etc/pagoda/grpc-tls/tls.key
- --grpc-tls-ca=/etc/pagoda/grpc-tls/ca.crt
- --grpc-tls-server-name={{ .Values.global.grpcTls.serverName }}
{{- end }}
{{- end -}}

{{- define "pagoda.grpcTlsMount" -}}
{{- if include "pagoda.grpcTlsOn" . -}}
- name: grpc-tls
  mountPath: /etc/pagoda/grpc-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The Redis password's Secret (redis.auth): an existing one, or the chart's own
(redis-secret.yaml). REDIS_PASSWORD from it, for the containers that need it.
*/}}
{{- define "pagoda.redisPasswordSecret" -}}
{{- .Values.redis.auth.existingSecret | default (include "pagoda.componentName" (list . "redis")) -}}
{{- end -}}

{{- define "pagoda.redisPasswordEnv" -}}
{{- if .Values.redis.auth.enabled -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pagoda.redisPasswordSecret" . }}
      key: {{ .Values.redis.auth.secretKey }}
{{- end }}
{{- end -}}
