{{/*
Model storage for the pods that load weights (verifier, drafter). models.source picks one of:
  image          weights baked into the image under models.mountPath: nothing to mount
  pvc            an existing claim, mounted read-only
  hostPath       a node directory, mounted read-only
  initContainer  an init container fetches HF-style URIs into an emptyDir, mounted read-only after
Called with (dict "root" $ "component" <name> "fetch" (list (dict "key" <value name> "uri" .. "dir" .. ["globs" (list ..)]) ...)):
globs limits a fetch to matching files (the scheduler needs only the tokenizer, the verifier only the
drafter's config.json).
*/}}

{{/* Path of a model directory inside the containers. */}}
{{- define "dspark.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.models.mountPath) .dir -}}
{{- end -}}

{{- define "dspark.modelVolumes" -}}
{{- $m := .root.Values.models -}}
{{- if eq $m.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ required "models.pvc.claimName is required when models.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: models
  hostPath:
    path: {{ required "models.hostPath.path is required when models.source=hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "initContainer" }}
- name: models
  emptyDir:
    sizeLimit: {{ $m.initContainer.sizeLimit }}
{{- else if ne $m.source "image" }}
{{- fail (printf "models.source must be image, pvc, hostPath or initContainer; got %s" $m.source) }}
{{- end }}
{{- end -}}

{{- define "dspark.modelVolumeMounts" -}}
{{- $m := .root.Values.models -}}
{{- if ne $m.source "image" }}
- name: models
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Script of the fetch init container: argv is a list of "<uri>=<dir>[|<glob>,<glob>...]". */}}
{{- define "dspark.fetchScript" -}}
import sys
from huggingface_hub import snapshot_download
for spec in sys.argv[1:]:
    spec, _, globs = spec.partition("|")
    uri, dest = spec.rsplit("=", 1)
    repo, _, revision = uri.removeprefix("hf://").partition("@")
    snapshot_download(repo_id=repo, revision=revision or None, local_dir=dest,
                      allow_patterns=globs.split(",") if globs else None)
    print(f"fetched {uri} -> {dest}", flush=True)
{{- end -}}

{{- define "dspark.modelInitContainers" -}}
{{- $root := .root -}}
{{- $m := $root.Values.models -}}
{{- if eq $m.source "initContainer" }}
{{- $i := $m.initContainer -}}
{{- $ctx := dict "root" $root "component" .component -}}
{{- $args := list -}}
{{- range .fetch }}
{{- $uri := required (printf "models.initContainer.%s is required when models.source=initContainer" .key) .uri }}
{{- $spec := printf "%s=%s" $uri (include "dspark.modelPath" (dict "root" $root "dir" .dir)) }}
{{- with .globs }}{{ $spec = printf "%s|%s" $spec (join "," .) }}{{ end }}
{{- $args = append $args $spec }}
{{- end }}
- name: fetch-models
  image: {{ printf "%s:%s" (default $root.Values.image.repository $i.image.repository) (default (default $root.Chart.AppVersion $root.Values.image.tag) $i.image.tag) | quote }}
  imagePullPolicy: {{ default $root.Values.image.pullPolicy $i.image.pullPolicy }}
  {{- if $i.command }}
  command:
    {{- toYaml $i.command | nindent 4 }}
  {{- else }}
  command:
    - python
    - -c
    - {{ include "dspark.fetchScript" . | quote }}
  {{- end }}
  args:
    {{- toYaml $args | nindent 4 }}
  env:
    - name: HOME
      value: /tmp
    - name: HF_HOME
      value: /tmp/hf
    - name: HF_HUB_OFFLINE  # the image sets 1 for the services
      value: "0"
    {{- with $i.tokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ required "models.initContainer.tokenSecret.key is required when tokenSecret.name is set" $i.tokenSecret.key }}
    {{- end }}
  {{- with $i.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: models
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- end -}}
