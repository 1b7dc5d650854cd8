"""A JSON schema of the KubeRay ``RayJob`` (``ray.io/v1``) fields StaleFlow's manifest uses, written
from KubeRay v1.7.0's CRD (``ray-operator/config/crd/bases/ray.io_rayjobs.yaml``): the same
types, enums and required fields, restricted to what we set. Unlike the API server, which prunes
unknown fields of a custom resource silently, it refuses any field it does not name, so a typo
fails here. Pod templates are plain ``PodTemplateSpec``s, checked with kubernetes-validate.
No PyPI package ships KubeRay's CRDs; the full check is ``kubectl apply --dry-run=server`` on a
cluster with the operator installed (docs/cluster.md)."""

from __future__ import annotations

from typing import Any

STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
POD_TEMPLATE = {"type": "object"}  # a core PodTemplateSpec: validated by kubernetes-validate

HEAD_GROUP: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["template"],
    "properties": {
        "rayStartParams": STRING_MAP,
        "labels": STRING_MAP,
        "resources": STRING_MAP,
        "serviceType": {"type": "string"},
        "enableIngress": {"type": "boolean"},
        "template": POD_TEMPLATE,
    },
}

WORKER_GROUP: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["groupName", "maxReplicas", "minReplicas", "template"],
    "properties": {
        "groupName": {"type": "string", "minLength": 1},
        "replicas": INT32,
        "minReplicas": INT32,
        "maxReplicas": INT32,
        "numOfHosts": INT32,
        "labels": STRING_MAP,  # Ray node labels of the group's nodes
        "resources": STRING_MAP,  # Ray custom resources of the group's nodes (quantities as strings)
        "rayStartParams": STRING_MAP,
        "idleTimeoutSeconds": INT32,
        "suspend": {"type": "boolean"},
        "template": POD_TEMPLATE,
    },
}

RAY_CLUSTER_SPEC: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["headGroupSpec"],
    "properties": {
        "rayVersion": {"type": "string"},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "authOptions": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "mode": {"enum": ["disabled", "token"]},
                "secretName": {"type": "string"},
                "enableK8sTokenAuth": {"type": "boolean"},
            },
        },
        "headGroupSpec": HEAD_GROUP,
        "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP},
    },
}

RAYJOB: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                # a DNS-1123 label: KubeRay derives the cluster's and its Services' names from it
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "labels": STRING_MAP,
                "annotations": STRING_MAP,
                "namespace": {"type": "string"},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["entrypoint", "rayClusterSpec"],
            "properties": {
                "entrypoint": {"type": "string", "minLength": 1},
                "entrypointResources": {"type": "string"},  # JSON text of {resource: amount}
                "entrypointNumCpus": {"type": "number"},
                "entrypointNumGpus": {"type": "number"},
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                "backoffLimit": INT32,
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": INT32,
                "activeDeadlineSeconds": INT32,
                "runtimeEnvYAML": {"type": "string"},
                "suspend": {"type": "boolean"},
                "rayClusterSpec": RAY_CLUSTER_SPEC,
            },
        },
    },
}
