{{/*
Bodies shared by several components: PodDisruptionBudget, HorizontalPodAutoscaler,
ServiceMonitor and NetworkPolicy. Each `<component>-<kind>.yaml` template calls one of
these with a dict naming its component.
*/}}

{{/* dict: ctx, component, pdb */}}
{{- define "pagoda.pdb" -}}
{{- if .pdb.enabled }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pagoda.componentName" (list .ctx .component) }}
  labels:
    {{- include "pagoda.labels" (list .ctx .component) | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "pagoda.selectorLabels" (list .ctx .component) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* dict: ctx, component, autoscaling (enabled, min/maxReplicas, targets) */}}
{{- define "pagoda.hpa" -}}
{{- $a := .autoscaling -}}
{{- if $a.enabled }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "pagoda.componentName" (list .ctx .component) }}
  labels:
    {{- include "pagoda.labels" (list .ctx .component) | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "pagoda.componentName" (list .ctx .component) }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- if $a.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $a.targetCPUUtilizationPercentage }}
    {{- end }}
    {{- if $a.targetNumRequestsWaiting }}
    - type: Pods
      pods:
        metric:
          name: {{ $a.numRequestsWaitingMetric }}
        target:
          type: AverageValue
          averageValue: {{ $a.targetNumRequestsWaiting | quote }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* dict: ctx, component, service (Service name), endpoints (list of dict port, path) */}}
{{- define "pagoda.serviceMonitor" -}}
{{- $sm := .ctx.Values.global.serviceMonitor -}}
{{- if $sm.enabled }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "pagoda.componentName" (list .ctx .component) }}
  labels:
    {{- include "pagoda.labels" (list .ctx .component) | nindent 4 }}
    {{- with $sm.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "pagoda.selectorLabels" (list .ctx .component) | nindent 6 }}
  endpoints:
    {{- range .endpoints }}
    - port: {{ .port }}
      path: {{ .path | default "/metrics" }}
      interval: {{ $sm.interval }}
    {{- end }}
{{- end }}
{{- end -}}

{{/*
dict: ctx, component, restricted (list of dict port (0: every port), from: list of
components allowed),
inCluster (ports any pod of any namespace may reach, e.g. metrics for Prometheus),
public (ports open to everyone, outside the cluster too: only the gateway's).
*/}}
{{- define "pagoda.networkPolicy" -}}
{{- if .ctx.Values.global.networkPolicy.enabled }}
{{- $ctx := .ctx }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "pagoda.componentName" (list .ctx .component) }}
  labels:
    {{- include "pagoda.labels" (list .ctx .component) | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "pagoda.selectorLabels" (list .ctx .component) | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    {{- range .restricted }}
    {{- if .port }}
    - ports:
        - port: {{ .port }}
          protocol: TCP
      from:
    {{- else }}
    - from:  # every port
    {{- end }}
        {{- range .from }}
        - podSelector:
            matchLabels:
              {{- include "pagoda.selectorLabels" (list $ctx .) | nindent 14 }}
        {{- end }}
    {{- end }}
    {{- with .inCluster }}
    - ports:
        {{- range . }}
        - port: {{ . }}
          protocol: TCP
        {{- end }}
      from:
        - namespaceSelector: {}
    {{- end }}
    {{- with .public }}
    - ports:
        {{- range . }}
        - port: {{ . }}
          protocol: TCP
        {{- end }}
    {{- end }}
{{- end }}
{{- end -}}
