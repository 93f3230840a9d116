{{/*
Names, labels, images and validation shared by every template.
Component templates call these with a dict: (dict "root" $ "component" "drafter").
*/}}

{{- define "dspark.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name prefix, at most 63 characters. */}}
{{- define "dspark.fullname" -}}
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

{{/* Name of one component's objects: <fullname>-<component>. */}}
{{- define "dspark.componentName" -}}
{{- printf "%s-%s" (include "dspark.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "dspark.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "dspark.labels" -}}
helm.sh/chart: {{ include "dspark.chart" . }}
app.kubernetes.io/name: {{ include "dspark.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dspark
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component; immutable once installed. */}}
{{- define "dspark.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dspark.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of one component's objects. */}}
{{- define "dspark.componentLabels" -}}
{{ include "dspark.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Name of the ServiceAccount the dspark pods run as. */}}
{{- define "dspark.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dspark.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference of a dspark component: the component's image fields override the top-level image. */}}
{{- define "dspark.image" -}}
{{- $top := .root.Values.image -}}
{{- $own := (index .root.Values .component).image -}}
{{- $repository := default $top.repository $own.repository -}}
{{- $tag := default (default .root.Chart.AppVersion $top.tag) $own.tag -}}
{{- printf "%s:%s" (required "image.repository is required" $repository) (toString $tag) -}}
{{- end -}}

{{- define "dspark.imagePullPolicy" -}}
{{- default .root.Values.image.pullPolicy (index .root.Values .component).image.pullPolicy -}}
{{- end -}}

{{/* Redis URL the services connect to (never contains the password). */}}
{{- define "dspark.redisUrl" -}}
{{- if .Values.redis.bundled.enabled -}}
{{- printf "redis://%s:%d/0" (include "dspark.componentName" (dict "root" . "component" "redis")) (int .Values.redis.bundled.port) -}}
{{- else -}}
{{- required "redis.external.url is required when redis.bundled.enabled=false" .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* REDIS_URL and REDIS_PASSWORD env entries. */}}
{{- define "dspark.redisEnv" -}}
- name: REDIS_URL
  value: {{ include "dspark.redisUrl" . | quote }}
{{- with .Values.redis.auth.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ required "redis.auth.existingSecretPasswordKey is required" $.Values.redis.auth.existingSecretPasswordKey }}
{{- end }}
{{- end -}}

{{/* Name of a component's TLS Secret (tls.crt, tls.key, ca.crt): cert-manager's, or tls.existingSecrets. */}}
{{- define "dspark.tlsSecretName" -}}
{{- $given := index .root.Values.tls.existingSecrets .component -}}
{{- if and $given (not .root.Values.tls.certManager.enabled) -}}
{{- $given -}}
{{- else -}}
{{- printf "%s-tls" (include "dspark.componentName" .) -}}
{{- end -}}
{{- end -}}

{{/* True (non-empty) when an external engine (KEDA or HPA) or the built-in scaler owns the pool replica counts. */}}
{{- define "dspark.poolsAutoscaled" -}}
{{- if or .Values.autoscaling.keda.enabled .Values.autoscaling.hpa.enabled (and .Values.scheduler.enabled .Values.scheduler.autoscaler.enabled) -}}
true
{{- end -}}
{{- end -}}

{{/* Chart-wide validation; rendered (to nothing) by templates/validate.yaml. */}}
{{- define "dspark.validate" -}}
{{- $v := .Values -}}
{{- $engines := 0 -}}
{{- if $v.autoscaling.keda.enabled }}{{ $engines = add1 $engines }}{{ end -}}
{{- if $v.autoscaling.hpa.enabled }}{{ $engines = add1 $engines }}{{ end -}}
{{- if $v.scheduler.autoscaler.enabled }}{{ $engines = add1 $engines }}{{ end -}}
{{- if gt $engines 1 -}}
{{- fail "enable at most one of autoscaling.keda.enabled, autoscaling.hpa.enabled and scheduler.autoscaler.enabled" -}}
{{- end -}}
{{- if and $v.scheduler.autoscaler.enabled (not $v.scheduler.enabled) -}}
{{- fail "scheduler.autoscaler.enabled needs scheduler.enabled" -}}
{{- end -}}
{{- if and $v.autoscaling.hpa.enabled (eq $v.autoscaling.hpa.metricType "Object") (not $v.scheduler.enabled) -}}
{{- fail "autoscaling.hpa.metricType=Object describes the scheduler Service: it needs scheduler.enabled" -}}
{{- end -}}
{{- range $pool := list "drafter" "verifier" -}}
{{- $b := index $v.autoscaling $pool -}}
{{- if gt (int $b.minReplicas) (int $b.maxReplicas) -}}
{{- fail (printf "autoscaling.%s.minReplicas (%v) must not exceed maxReplicas (%v)" $pool $b.minReplicas $b.maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- range $c := list "scheduler" "verifier" "drafter" -}}
{{- $svc := (index $v $c).service -}}
{{- if and $svc.headless (ne $svc.type "ClusterIP") -}}
{{- fail (printf "%s.service.headless needs %s.service.type=ClusterIP; got %s" $c $c $svc.type) -}}
{{- end -}}
{{- end -}}
{{- if eq $v.models.source "pvc" -}}
{{- $_ := required "models.pvc.claimName is required when models.source=pvc" $v.models.pvc.claimName -}}
{{- else if eq $v.models.source "hostPath" -}}
{{- $_ := required "models.hostPath.path is required when models.source=hostPath" $v.models.hostPath.path -}}
{{- else if eq $v.models.source "initContainer" -}}
{{- $_ := required "models.initContainer.targetUri is required when models.source=initContainer" $v.models.initContainer.targetUri -}}
{{- if $v.drafter.enabled -}}
{{- $_ := required "models.initContainer.drafterUri is required when models.source=initContainer" $v.models.initContainer.drafterUri -}}
{{- end -}}
{{- end -}}
{{- if $v.otel.enabled -}}
{{- $_ := required "otel.endpoint is required when otel.enabled=true" $v.otel.endpoint -}}
{{- end -}}
{{- $_ := include "dspark.redisUrl" . -}}
{{- end -}}

{{/* "true" when the drafters run as their own pool (drafter.enabled, not drafter.besideVerifier), else "false". */}}
{{- define "dspark.drafterPool" -}}
{{- and .Values.drafter.enabled (not .Values.drafter.besideVerifier) -}}
{{- end -}}
