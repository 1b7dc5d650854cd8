"""deploy/k8s, checked offline: core objects with kubernetes-validate (strict, two Kubernetes
versions), the RayJob against the schema of the KubeRay fields we use, and what the objects must
agree on (placement, token, volumes, the job file). What needs a cluster (KubeRay's operator,
scheduling, storage classes) is stated untested in docs/cluster.md."""

from __future__ import annotations

import json
import shlex
from pathlib import Path, PurePosixPath

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.kuberay_rayjob_schema import RAYJOB

from staleflow.config import JobConfig

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
KUBERNETES_VERSIONS = ["1.33.0", "1.37.0"]  # shipped by kubernetes-validate; the oldest and newest we claim
ROLES = ("control", "rollout", "trainer")
JOB = "staleflow-exp1"


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def manifest() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in documents("staleflow.yaml")}


def rayjob() -> dict:
    return manifest()[("RayJob", JOB)]


def groups() -> dict[str, dict]:
    return {g["groupName"]: g for g in rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"]}


def container(group: dict) -> dict:
    (only,) = group["template"]["spec"]["containers"]
    return only


def job_file(name: str) -> JobConfig:
    (config_map,) = documents(name)
    return JobConfig.model_validate(yaml.safe_load(config_map["data"]["job.yaml"]))


def mounts(group: dict) -> dict[str, dict]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes[m["name"]] for m in container(group).get("volumeMounts", [])}


def core_objects() -> list[dict]:
    objects = [d for name in ("staleflow.yaml", "job-sqlite.yaml", "job-postgres.yaml") for d in documents(name)
               if d["kind"] != "RayJob"]
    spec = rayjob()["spec"]["rayClusterSpec"]
    for name, group in [("head", spec["headGroupSpec"]), *groups().items()]:  # the pod templates inside the RayJob
        objects.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{JOB}-{name}"},
                        "template": group["template"]})
    return objects


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_objects_are_valid_kubernetes(version: str) -> None:
    objects = core_objects()
    assert {o["kind"] for o in objects} == {"PersistentVolumeClaim", "Service", "NetworkPolicy", "ConfigMap",
                                            "PodTemplate"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)  # raises, naming the field


def test_the_rayjob_matches_kuberays_schema() -> None:
    jsonschema.validate(rayjob(), RAYJOB)


def test_a_misspelt_rayjob_field_is_caught() -> None:
    """The API server would drop it silently; the schema must not."""
    job = rayjob()
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.validate(job, RAYJOB)


def test_the_head_does_no_staleflow_work() -> None:
    head = rayjob()["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    assert not head.get("resources") and not head.get("labels")
    limits = container(head)["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits
    assert not container(head).get("volumeMounts"), "no state, token or job file on the head"


def test_worker_groups_carry_the_labels_and_resources_the_launcher_selects() -> None:
    found = groups()
    assert tuple(found) == ROLES
    job_fields = JobConfig.model_fields
    for role, group in found.items():
        assert group["labels"] == {"staleflow.io/role": role}
        assert float(group["resources"][f"staleflow_{role}"]) > 0 and len(group["resources"]) == 1
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"], "a fixed-size group"
        assert group["template"]["metadata"]["labels"]["staleflow.io/role"] == role
        if "cluster" in job_fields:  # the Ray launcher's defaults select the nodes marked for each role: these
            from staleflow.launch.ray.placement import role_marker

            assert getattr(JobConfig(engine="sim").cluster, role) is None, "the job file names no nodes: the defaults"
            mark = role_marker(role)
            assert mark.labels.items() <= group["labels"].items() and mark.resource in group["resources"]


def test_the_job_file_fits_the_groups() -> None:
    job = job_file("job-sqlite.yaml")
    found = groups()

    def gpus(role: str) -> int:
        return found[role]["replicas"] * int(container(found[role])["resources"]["limits"]["nvidia.com/gpu"])

    assert job.instances == gpus("rollout"), "one instance per rollout GPU"
    assert job.trainer.world_size == gpus("trainer"), "one rank per trainer GPU"


def test_the_entrypoint_runs_the_ray_launcher_on_the_control_node() -> None:
    spec = rayjob()["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:5] == ["staleflow", "up", "--launcher", "ray", "--resume"]
    config = argv[argv.index("--config") + 1]
    assert json.loads(spec["entrypointResources"]).keys() == {"staleflow_control"}
    control = mounts(groups()["control"])
    assert control[config]["configMap"]["name"] == f"{JOB}-job"
    for name in ("job-sqlite.yaml", "job-postgres.yaml"):
        (config_map,) = documents(name)
        assert config_map["metadata"]["name"] == f"{JOB}-job" and "job.yaml" in config_map["data"]


def test_durable_state_is_on_volumes() -> None:
    job = job_file("job-sqlite.yaml")
    objects = manifest()
    found = groups()
    state, trainer_state = str(job.state_dir), str(PurePosixPath(job.state_dir) / "trainer")

    def claim(role: str, path: str) -> dict:
        name = mounts(found[role])[path]["persistentVolumeClaim"]["claimName"]
        return objects[("PersistentVolumeClaim", name)]

    assert claim("control", state)["spec"]["accessModes"] == ["ReadWriteOnce"], "SQLite wants block storage"
    # the driver on the control pod reads the step log the trainer pods write
    assert claim("control", trainer_state) is claim("trainer", trainer_state)
    assert claim("trainer", trainer_state)["spec"]["accessModes"] == ["ReadWriteMany"]
    model = str(job.model)
    for role in ROLES:  # vLLM, the trainer and the trajectory server's tokenizer
        assert any(model.startswith(f"{path}/") for path in mounts(found[role])), f"{role} cannot see {model}"


def test_tokens_come_from_files_and_ray_requires_its_token() -> None:
    spec = rayjob()["spec"]["rayClusterSpec"]
    assert spec["authOptions"] == {"mode": "token"}
    templates = [spec["headGroupSpec"], *groups().values()]
    for group in templates:
        env = {e["name"]: e for e in container(group).get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert "STALEFLOW_TOKEN" not in env, "the token never goes into the environment"
        assert not any("valueFrom" in e for e in env.values())
    for role, group in groups().items():
        env = {e["name"]: e.get("value") for e in container(group)["env"]}
        token_file = PurePosixPath(env["STALEFLOW_TOKEN_FILE"])
        volume = mounts(group)[str(token_file.parent)]
        assert volume["secret"]["secretName"] == f"{JOB}-token" and volume["secret"]["defaultMode"] == 0o400
        assert "optional" not in volume["secret"], f"{role}: no token, no start"


def test_the_postgres_job_file_reads_its_url_from_the_mounted_secret() -> None:
    sqlite, postgres = job_file("job-sqlite.yaml"), job_file("job-postgres.yaml")
    assert sqlite.db_url is None and sqlite.db_url_file is None and postgres.db_url is None
    assert postgres.model_copy(update={"db_url_file": None}) == sqlite, "the two job files differ in the database only"
    url_file = PurePosixPath(postgres.db_url_file)
    volume = mounts(groups()["control"])[str(url_file.parent)]
    assert volume["secret"]["secretName"] == f"{JOB}-postgres" and url_file.name == "url"


def test_the_service_and_network_policy_select_the_jobs_pods() -> None:
    objects = manifest()
    spec = rayjob()["spec"]["rayClusterSpec"]
    labels = {name: g["template"]["metadata"]["labels"] for name, g in groups().items()}
    labels["head"] = spec["headGroupSpec"]["template"]["metadata"]["labels"]
    service = objects[("Service", f"{JOB}-control")]["spec"]
    assert [n for n, lab in labels.items() if service["selector"].items() <= lab.items()] == ["control"]
    policy = objects[("NetworkPolicy", JOB)]["spec"]
    for name, lab in labels.items():
        assert policy["podSelector"]["matchLabels"].items() <= lab.items(), f"{name} pods are not covered"
    assert policy["ingress"][0]["from"][0]["podSelector"] == policy["podSelector"], "the job's pods reach each other"
    images = {container(g)["image"] for g in [spec["headGroupSpec"], *groups().values()]}
    assert len(images) == 1, "one image for every node"
