{{/*
Pool autoscaling on the scheduler's signal dspark_desired_replicas{pool=...} (also in Redis at
dspark:autoscale:desired:<pool>). The signal is already a replica count, so every target is an
AverageValue of 1: desired = ceil(signal / 1). Called with (dict "root" $ "component" <pool>).
*/}}

{{/* HPA behavior (stabilisation windows) of one pool; shared by the HPA and KEDA's generated HPA. */}}
{{- define "dspark.hpaBehavior" -}}
{{- $b := index .root.Values.autoscaling .component -}}
scaleUp:
  stabilizationWindowSeconds: {{ $b.scaleUpStabilizationWindowSeconds }}
scaleDown:
  stabilizationWindowSeconds: {{ $b.scaleDownStabilizationWindowSeconds }}
{{- end -}}

{{- define "dspark.scaledObject" -}}
{{- $root := .root -}}
{{- $k := $root.Values.autoscaling.keda -}}
{{- $b := index $root.Values.autoscaling .component -}}
{{- $name := include "dspark.componentName" . -}}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  pollingInterval: {{ $k.pollingInterval }}
  cooldownPeriod: {{ $k.cooldownPeriod }}
  minReplicaCount: {{ $b.minReplicas }}
  maxReplicaCount: {{ $b.maxReplicas }}
  advanced:
    horizontalPodAutoscalerConfig:
      name: {{ $name }}
      behavior:
        {{- include "dspark.hpaBehavior" . | nindent 8 }}
  triggers:
    {{- if eq $k.trigger "prometheus" }}
    - type: prometheus
      metricType: AverageValue
      metadata:
        serverAddress: {{ required "autoscaling.keda.prometheus.serverAddress is required when autoscaling.keda.trigger=prometheus" $k.prometheus.serverAddress | quote }}
        query: {{ tpl $k.prometheus.query (dict "pool" .component "Release" $root.Release "Template" $root.Template) | quote }}
        threshold: "1"
      {{- with $k.prometheus.authenticationRef }}
      authenticationRef:
        name: {{ . }}
      {{- end }}
    {{- else if eq $k.trigger "redis" }}
    {{- $url := urlParse (include "dspark.redisUrl" $root) }}
    - type: redis
      metricType: AverageValue
      metadata:
        address: {{ $url.host | quote }}
        # a list whose length is the desired replica count (the scheduler rewrites it atomically)
        listName: {{ printf "dspark:autoscale:replicas:%s" .component | quote }}
        listLength: "1"
        databaseIndex: {{ default "0" (trimPrefix "/" $url.path) | quote }}
        enableTLS: {{ eq $url.scheme "rediss" | quote }}
      {{- if $root.Values.redis.auth.existingSecret }}
      authenticationRef:
        name: {{ include "dspark.fullname" $root }}-redis-auth
      {{- end }}
    {{- else }}
    {{- fail (printf "autoscaling.keda.trigger must be prometheus or redis; got %s" $k.trigger) }}
    {{- end }}
{{- end -}}

{{- define "dspark.hpa" -}}
{{- $root := .root -}}
{{- $h := $root.Values.autoscaling.hpa -}}
{{- $b := index $root.Values.autoscaling .component -}}
{{- $name := include "dspark.componentName" . -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  minReplicas: {{ $b.minReplicas }}
  maxReplicas: {{ $b.maxReplicas }}
  behavior:
    {{- include "dspark.hpaBehavior" . | nindent 4 }}
  metrics:
    {{- if eq $h.metricType "External" }}
    - type: External
      external:
        metric:
          name: {{ $h.metricName }}
          selector:
            matchLabels:
              pool: {{ .component }}
        target:
          type: AverageValue
          averageValue: "1"
    {{- else if eq $h.metricType "Object" }}
    - type: Object
      object:
        describedObject:
          apiVersion: v1
          kind: Service
          name: {{ include "dspark.componentName" (dict "root" $root "component" "scheduler") }}
        metric:
          name: {{ $h.metricName }}
          selector:
            matchLabels:
              pool: {{ .component }}
        target:
          type: AverageValue
          averageValue: "1"
    {{- else }}
    {{- fail (printf "autoscaling.hpa.metricType must be External or Object; got %s" $h.metricType) }}
    {{- end }}
{{- end -}}
