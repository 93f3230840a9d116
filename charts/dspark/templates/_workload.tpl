{{/*
Object bodies shared by the three dspark components. Each templates/<component>/<kind>.yaml
includes one of these with what is particular to it; none of them reads component-specific keys.
*/}}

{{/* A probe from its values: drop `enabled`, default a grpc probe's port to the component's gRPC port. With
tls.enabled a grpc probe (which kubelet runs in plaintext) becomes an exec probe of the same health service
over mutual TLS (services/common/probe.py). */}}
{{- define "dspark.probe" -}}
{{- $probe := omit (deepCopy .probe) "enabled" -}}
{{- if and (hasKey $probe "grpc") (not (hasKey $probe.grpc "port")) -}}
{{- $_ := set $probe.grpc "port" (int .port) -}}
{{- end -}}
{{- if and .tls (hasKey $probe "grpc") -}}
{{- $port := $probe.grpc.port -}}
{{- $probe = omit $probe "grpc" -}}
{{- $_ := set $probe "exec" (dict "command" (list "python3" "-m" "services.common.probe" "--port" (toString $port))) -}}
{{- end -}}
{{- toYaml $probe -}}
{{- end -}}

{{/*
Deployment of one component.
  root, component      as everywhere
  args                 list: arguments after `dspark` (component flags; extraArgs are appended here)
  env                  list: component-specific EnvVars (before extraEnv)
  initContainers       list
  volumes              list: component-specific volumes
  volumeMounts         list: component-specific mounts
  serviceAccountName   string
  automountToken       bool
  omitReplicas         bool: an autoscaler owns .spec.replicas
*/}}
{{- define "dspark.deployment" -}}
{{- $root := .root -}}
{{- $c := index $root.Values .component -}}
{{- $ports := $c.service.ports -}}
{{- $ctx := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "dspark.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" $ctx | nindent 4 }}
spec:
  {{- if not .omitReplicas }}
  replicas: {{ $c.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $c.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "dspark.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "dspark.componentLabels" $ctx | nindent 8 }}
        {{- with $c.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or $c.podAnnotations $root.Values.metrics.scrapeAnnotations }}
      annotations:
        {{- if $root.Values.metrics.scrapeAnnotations }}
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ $ports.metrics | quote }}
        prometheus.io/path: /metrics
        {{- end }}
        {{- with $c.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
    spec:
      serviceAccountName: {{ .serviceAccountName }}
      automountServiceAccountToken: {{ .automountToken }}
      enableServiceLinks: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $c.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with $c.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $c.terminationGracePeriodSeconds }}
      {{- with $c.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .initContainers }}
      initContainers:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "dspark.image" $ctx | quote }}
          imagePullPolicy: {{ include "dspark.imagePullPolicy" $ctx }}
          command: ["dspark"]
          args:
            {{- toYaml (concat .args $c.extraArgs) | nindent 12 }}
          ports:
            {{- range $name, $port := merge (dict) $ports (.extraPorts | default dict) }}
            - name: {{ $name }}
              containerPort: {{ $port }}
              protocol: TCP
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_NAMESPACE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.namespace
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: DSPARK_POD_ADDRESS
              value: "$(POD_IP):{{ $ports.grpc }}"
            {{- include "dspark.redisEnv" $root | nindent 12 }}
            {{- if $root.Values.tls.enabled }}
            - name: DSPARK_TLS_DIR
              value: {{ $root.Values.tls.mountPath | quote }}
            {{- end }}
            - name: HOME
              value: /tmp
            - name: XDG_CACHE_HOME
              value: /tmp/.cache
            - name: HF_HOME
              value: /tmp/hf
            - name: HF_HUB_OFFLINE
              value: "1"
            - name: DSPARK_MODELS_DIR
              value: {{ $root.Values.models.mountPath | quote }}
            {{- with include "dspark.otelEnv" $ctx }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $c.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- range $kind := list "startup" "readiness" "liveness" }}
          {{- $probe := index $c.probes $kind }}
          {{- if $probe.enabled }}
          {{ $kind }}Probe:
            {{- include "dspark.probe" (dict "probe" $probe "port" $ports.grpc "tls" $root.Values.tls.enabled) | nindent 12 }}
          {{- end }}
          {{- end }}
          {{- with $c.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if $root.Values.shm.enabled }}
            - name: shm
              mountPath: /dev/shm
            {{- end }}
            {{- if $root.Values.tls.enabled }}
            - name: tls
              mountPath: {{ $root.Values.tls.mountPath }}
              readOnly: true
            {{- end }}
            {{- with .volumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $c.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.tmp.sizeLimit }}
        {{- if $root.Values.shm.enabled }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.shm.sizeLimit }}
        {{- end }}
        {{- if $root.Values.tls.enabled }}
        - name: tls
          secret:
            secretName: {{ include "dspark.tlsSecretName" $ctx }}
            defaultMode: 0440
        {{- end }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $c.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}

{{/* OpenTelemetry env entries of one component (none when otel.enabled=false). */}}
{{- define "dspark.otelEnv" -}}
{{- $o := .root.Values.otel -}}
{{- if $o.enabled -}}
{{- $attrs := list "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" (printf "service.namespace=%s" .root.Release.Name) -}}
{{- range $k, $val := $o.resourceAttributes -}}
{{- $attrs = append $attrs (printf "%s=%v" $k $val) -}}
{{- end -}}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ required "otel.endpoint is required when otel.enabled=true" $o.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $o.protocol | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" $o.serviceNamePrefix .component | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $o.tracesSampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $o.tracesSamplerArg | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- end -}}
{{- end -}}

{{/* Service of one component: every named port of service.ports. */}}
{{- define "dspark.service" -}}
{{- $c := index .root.Values .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "dspark.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" . | nindent 4 }}
  {{- with $c.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ $c.service.type }}
  {{- if $c.service.headless }}
  clusterIP: None
  {{- end }}
  selector:
    {{- include "dspark.selectorLabels" . | nindent 4 }}
  ports:
    {{- range $name, $port := $c.service.ports }}
    - name: {{ $name }}
      port: {{ $port }}
      targetPort: {{ $name }}
      protocol: TCP
      {{- if eq $name "grpc" }}
      appProtocol: grpc
      {{- else }}
      appProtocol: http
      {{- end }}
    {{- end }}
{{- end -}}

{{/* PodDisruptionBudget of one component. */}}
{{- define "dspark.pdb" -}}
{{- $p := (index .root.Values .component).podDisruptionBudget -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "dspark.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" . | nindent 4 }}
spec:
  {{- if not (eq (toString $p.minAvailable) "") }}
  minAvailable: {{ $p.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $p.maxUnavailable }}
  {{- end }}
  unhealthyPodEvictionPolicy: {{ $p.unhealthyPodEvictionPolicy }}
  selector:
    matchLabels:
      {{- include "dspark.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/*
Ingress NetworkPolicy of one component.
  ports    list of dicts {port, from}: `from` is a NetworkPolicyPeer list; empty means the pods of this
           release only.
*/}}
{{- define "dspark.networkPolicy" -}}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "dspark.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" . | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "dspark.selectorLabels" . | nindent 6 }}
  policyTypes:
    - Ingress
  ingress:
    {{- range .rules }}
    - ports:
        - port: {{ .port }}
          protocol: TCP
      from:
        {{- if .from }}
        {{- toYaml .from | nindent 8 }}
        {{- else }}
        - podSelector:
            matchLabels:
              app.kubernetes.io/instance: {{ $.root.Release.Name }}
        {{- end }}
    {{- end }}
{{- end -}}

{{/* NetworkPolicyPeer selecting the pods of one component of this release. */}}
{{- define "dspark.peer" -}}
- podSelector:
    matchLabels:
      {{- include "dspark.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/* ServiceMonitor of one component (scrapes the `metrics` port of its Service). */}}
{{- define "dspark.serviceMonitor" -}}
{{- $m := .root.Values.metrics.serviceMonitor -}}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "dspark.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" . | nindent 4 }}
    {{- with $m.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "dspark.selectorLabels" . | nindent 6 }}
  namespaceSelector:
    matchNames:
      - {{ .root.Release.Namespace }}
  endpoints:
    - port: metrics
      path: /metrics
      interval: {{ $m.interval }}
      scrapeTimeout: {{ $m.scrapeTimeout }}
{{- end -}}

{{/* cert-manager Certificate of one component (tls.enabled and tls.certManager.enabled). Every one comes
from the same CA issuer, so each Secret's ca.crt trusts the others. The common name is the caller identity
verifiers and drafters key requests by; the DNS name `dspark` is the one the services check (they dial
pods by address). */}}
{{- define "dspark.certificate" -}}
{{- $cm := .root.Values.tls.certManager -}}
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ include "dspark.componentName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "dspark.componentLabels" . | nindent 4 }}
spec:
  secretName: {{ include "dspark.tlsSecretName" . }}
  commonName: {{ printf "dspark-%s" .component }}
  dnsNames:
    - dspark
    - {{ include "dspark.componentName" . }}
    - {{ printf "%s.%s.svc" (include "dspark.componentName" .) .root.Release.Namespace }}
  duration: {{ $cm.duration }}
  renewBefore: {{ $cm.renewBefore }}
  privateKey:
    algorithm: ECDSA
    size: 256
    rotationPolicy: Always
  usages:
    - server auth
    - client auth
    - digital signature
    - key encipherment
  issuerRef:
    name: {{ required "tls.certManager.issuerName is required when tls.certManager.enabled=true" $cm.issuerName }}
    kind: {{ $cm.issuerKind }}
    group: cert-manager.io
{{- end -}}
