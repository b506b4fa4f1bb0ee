"""`ganscale k8s`: the JobSet manifest it writes is valid against JobSet's published schema, and the pods' own
command and environment, run as local processes, rendezvous and train as `--nproc` would."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ganscale.config import ConfigError

from test_cli import clean_env, ganscale

jsonschema = pytest.importorskip("jsonschema", reason="the test extra's jsonschema validates the manifest")

SCHEMA = Path(__file__).parent / "data" / "jobset-v1alpha2.schema.json"
TINY = ["--set", "train.steps=3", "--set", "train.batch_size=6", "--set", "log.sample_every=0",
        "--set", "log.tensorboard=false"]
LAYOUT = ["--nodes", "2", "--gpus-per-node", "1", "--image", "example/ganscale:1", "--volume", "runs:/mnt/runs"]


def strict(schema: dict) -> dict:
    """`schema` with unknown fields refused where Kubernetes would drop them (a structural schema prunes every
    field it does not name, unless x-kubernetes-preserve-unknown-fields): a misspelt field fails the test instead
    of vanishing on the cluster. The other x-kubernetes-* keys are ignored, as jsonschema ignores unknown keys."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    tightened = {key: strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        tightened["additionalProperties"] = False
    return tightened


@pytest.fixture(scope="module")
def validator():
    return jsonschema.Draft7Validator(strict(json.loads(SCHEMA.read_text())))


def write_manifest(tmp_path: Path, *args: str) -> list[dict]:
    result = ganscale("k8s", *TINY, *LAYOUT, "--run-dir", "run", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    path = tmp_path / "run" / "k8s" / "job.yaml"
    assert f"kubectl apply -f {path.relative_to(tmp_path)}" in result.stdout
    return list(yaml.safe_load_all(path.read_text()))


def test_the_config_map_keeps_file_paths_as_given_for_the_pods_to_read(tmp_path):
    from PIL import Image

    (tmp_path / "data" / "facades").mkdir(parents=True)
    Image.new("L", (8, 8)).save(tmp_path / "data" / "facades" / "0.png")
    config_map, _ = write_manifest(tmp_path, "--set", "data.kind=folder", "--set", "data.path=data/facades",
                                   "--set", "eval.inception_weights=weights/inception.pt")
    mounted = yaml.safe_load(config_map["data"]["config.yaml"])
    assert mounted["data"]["path"] == "data/facades"  # a pod's working directory, not this machine's
    assert mounted["eval"]["inception_weights"] == "weights/inception.pt"


def test_the_manifest_is_a_valid_jobset_holding_everything_the_user_passed(tmp_path, validator):
    config_map, jobset = write_manifest(tmp_path, "--max-restarts", "3", "--namespace", "gans", "--set",
                                        "data.workers=0")
    validator.validate(jobset)
    assert jobset["kind"] == "JobSet" and jobset["spec"]["failurePolicy"] == {"maxRestarts": 3}
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) == ("Indexed", 2, 2, 0)
    container = job["template"]["spec"]["containers"][0]
    assert container["image"] == "example/ganscale:1"
    assert container["resources"] == {"requests": {"cpu": 1, "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "seccompProfile": {"type": "RuntimeDefault"}}
    command = " ".join(container["command"])
    assert "--nnodes 2 --nproc-per-node 1 --node-rank $(GANSCALE_NODE_RANK) --rdzv-backend c10d" in command
    assert command.endswith("--run-dir /mnt/runs/run --resume auto")
    assert {"name": "run", "mountPath": "/mnt/runs"} in container["volumeMounts"]
    # /dev/shm in memory, not the container's 64 MiB: DataLoader workers and NCCL pass data through it
    assert {"name": "shared-memory", "mountPath": "/dev/shm"} in container["volumeMounts"]
    volumes = job["template"]["spec"]["volumes"]
    assert {"name": "shared-memory", "emptyDir": {"medium": "Memory"}} in volumes
    assert {m["metadata"]["namespace"] for m in (config_map, jobset)} == {"gans"}
    embedded = yaml.safe_load(config_map["data"]["config.yaml"])
    assert (embedded["train"]["steps"], embedded["train"]["batch_size"], embedded["log"]["tensorboard"]) == (3, 6, False)


@pytest.mark.parametrize("args, requests, limits", [
    (["--set", "data.workers=3"], {"cpu": 8}, {}),  # a CPU for each of the 2 workers and each of their 3 loaders
    (["--cpus-per-node", "5", "--memory-per-node", "64Gi"], {"cpu": 5, "memory": "64Gi"}, {"memory": "64Gi"}),
])
def test_each_pod_requests_cpus_for_its_workers_and_loaders_and_the_memory_asked(tmp_path, validator, args, requests,
                                                                                  limits):
    _, jobset = write_manifest(tmp_path, "--gpus-per-node", "2", "--set", "train.batch_size=8", *args)
    validator.validate(jobset)
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    gpus = {"nvidia.com/gpu": 2}
    assert container["resources"] == {"requests": {**requests, **gpus}, "limits": {**limits, **gpus}}


@pytest.mark.parametrize("break_it", [
    lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0].pop("name"),
    lambda js: js["spec"]["replicatedJobs"][0].pop("template"),
    lambda js: js["spec"]["failurePolicy"].update(maxRestarts="3"),
    lambda js: js["spec"].update(replicatedJob=js["spec"].pop("replicatedJobs")),
], ids=["container without name", "job without template", "maxRestarts a string", "misspelt field"])
def test_a_broken_manifest_fails_the_schema(tmp_path, validator, break_it):
    _, jobset = write_manifest(tmp_path)
    broken = copy.deepcopy(jobset)
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)


@pytest.mark.parametrize("args, option", [
    (["--nodes", "0", "--image", "i", "--volume", "c:/p"], "--nodes"),
    (["--nodes", "2", "--image", "i", "--volume", "claim"], "--volume"),
    (["--nodes", "2", "--image", "i", "--volume", "c:relative"], "--volume"),
    (["--nodes", "2", "--image", "i"], "--volume"),
    (["--nodes", "2", "--volume", "c:/p"], "--image"),
    (["--nodes", "5", "--gpus-per-node", "1", "--image", "i", "--volume", "c:/p"], "train.batch_size"),
    (["--image", "i", "--set", "train.steps=-1"], "train.steps"),
    (["--nodes", "1000000001", "--image", "i", "--volume", "c:/p"], "--nodes"),  # pod names past 63 characters
    (["--image", "example/ganscale:1\nkind: Secret"], "--image"),
    (["--image", "reg/g:1 --privileged"], "--image"),  # was written into the manifest
    (["--image", "example/GanScale:1"], "--image"),
    (["--image", "i", "--namespace", "My Team"], "--namespace"),
    (["--nodes", "2", "--image", "i", "--volume", "c:/p\tq"], "--volume"),
    (["--nodes", "2", "--image", "i", "--volume", "c:/mnt/$(GANSCALE_NODE_RANK)"], "--volume"),
    (["--image", "i", "--out", "run/job.json"], "--out"),  # a manifest is YAML
    (["--image", "i", "--gpus-per-node", "2", "--set", "train.batch_size=8", "--cpus-per-node", "1"],
     "--cpus-per-node"),  # fewer CPUs than workers
    (["--image", "i", "--memory-per-node", "64GB"], "--memory-per-node"),
    (["--image", "i", "--memory-per-node", "0Gi"], "--memory-per-node"),
    (["--image", "i", "--memory-per-node", "1Gi\nkind: Secret"], "--memory-per-node"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, option):
    result = ganscale("k8s", *args, "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and f"'{option}'" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()
    if option == "train.batch_size":
        assert "(--nodes 5 x --gpus-per-node 1)" in result.stderr


@pytest.mark.parametrize("volume, max_restarts, said", [
    ("c:/etc/ganscale", 0, "'/etc/ganscale' would hide or clash with the config's mount /etc/ganscale"),
    ("c:/etc/ganscale/runs", 0, "clash with the config's mount"),  # two mountPaths Kubernetes refuses, or nested
    ("c:/dev/shm", 0, "clash with the shared memory's mount /dev/shm"),
    ("c:/", 0, "'/' would hide or clash with the container's /"),  # the claim over the image's root
    ("c:/usr/", 0, "the container's /usr"),
    ("PVC_Bad:/runs", 0, "'PVC_Bad' is not a PersistentVolumeClaim's name"),  # was "is not CLAIM:/path"
    ("c:/runs", 2**31, "2147483648 is not a restart count Kubernetes takes"),  # maxRestarts is an int32
])
def test_a_volume_or_restart_count_kubernetes_would_refuse_is_refused_naming_why(volume, max_restarts, said):
    """Each was written into a manifest that `kubectl apply` or the pods then refuse."""
    from ganscale.k8s import Layout, check_layout

    with pytest.raises(ConfigError) as refused:
        check_layout(Layout(2, 1, "i", "default", volume, max_restarts))
    assert said in refused.value.problem, refused.value
    assert check_layout(Layout(2, 1, "i", "default", "c:/data//runs/", 2**31 - 1)).mount == "/data/runs"


def test_the_kubectl_line_quotes_the_manifest_s_path(tmp_path):
    result = ganscale("k8s", *TINY, *LAYOUT, "--run-dir", "it's a run", cwd=tmp_path)
    assert result.returncode == 0 and """kubectl apply -f 'it'"'"'s a run/k8s/job.yaml'""" in result.stdout, \
        result.stdout + result.stderr


@pytest.mark.parametrize("image, valid", [
    ("i", True), ("example/ganscale:1", True), ("localhost:5000/team/gan_scale__x--y:v1.0-rc", True),
    ("ghcr.io/team/ganscale@sha256:" + "0" * 64, True), ("[::1]:5000/g:latest@sha256:" + "a" * 64, True),
    ("reg/g:1 --privileged", False), ("reg/g:1\t", False), ("Reg/G", False), ("a//b", False), ("a/b:", False),
    ("a:b:c", False), ("a/b:-x", False), ("a@sha256:abc", False), ("a-", False), ("r/g:" + "t" * 129, False),
    ("r/" + "g" * 254, False), ("r/g\u00e9", False),
])
def test_the_image_is_an_oci_reference(image, valid):
    from ganscale import k8s
    from ganscale.config import ConfigError

    layout = k8s.Layout(1, 1, image, "default", None, 0)
    if valid:
        k8s.check_layout(layout)
    else:
        with pytest.raises(ConfigError, match="^config error at '--image'"):
            k8s.check_layout(layout)


@pytest.mark.parametrize("run_dir", ["/", "runs/lr$(GANSCALE_NODE_RANK)", "runs/a$$b", "runs/a\nb", "runs/a\rb"])
def test_a_run_directory_the_pods_cannot_share_is_refused(tmp_path, run_dir):
    """No folder name (the root), or one Kubernetes rewrites in the pods' command ($(VAR): each pod's own value;
    $$: $) or that would break a line: one line naming --run-dir, nothing written."""
    out = tmp_path / "job.yaml"  # not RUN_DIR/k8s/job.yaml: with `/` that is /k8s/job.yaml
    result = ganscale("k8s", "--image", "i", "--run-dir", run_dir, "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "'--run-dir'" in result.stderr, result.stderr
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_each_run_directory_gets_its_own_names_within_kubernetes_limits(tmp_path, validator):
    """Names were cut to 40 characters and lower-cased: two runs of a sweep, or exp_1 and exp.1, shared one
    ConfigMap and JobSet, and applying the second replaced the first's config. A name Kubernetes takes is kept."""
    from ganscale import config
    from ganscale.k8s import MAX_NODES, Layout, job_name, manifest

    cfg = config.load("digits", (), files_here=False)
    layout = Layout(MAX_NODES, 1, "i", "default", "runs:/mnt/runs", 0)  # the longest pod index allowed
    sweep = "digits-dcgan-sweep-batch64-width32-seed0"
    folders = [f"{sweep}-lr0.0001", f"{sweep}-lr0.0002", "exp_1", "exp.1", "Exp-1", "0run", "___"]
    names = set()
    for folder in folders:
        config_map, jobset = manifest(cfg, layout, tmp_path / folder)
        validator.validate(jobset)
        name = jobset["metadata"]["name"]
        assert config_map["metadata"]["name"] == f"{name}-config"
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40, name
        longest_pod = f"{name}-node-0-{layout.nodes - 1}-abcde"  # JobSet's check: the Job's 5-character suffix too
        assert len(longest_pod) <= 63, longest_pod
        pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        command = pod["containers"][0]["command"]
        assert command[command.index("--run-dir") + 1] == f"/mnt/runs/{folder}"  # the folder as named
        names.add(name)
    assert len(names) == len(folders), names
    assert job_name("exp_1") == "exp-1-dd8fdeed"  # the same in every process and release: a rerun updates its job
    assert [job_name(n) for n in ("run", "exp1", "a--b", "x" * 40)] == ["run", "exp1", "a--b", "x" * 40]


def test_the_run_directory_is_resolved_before_its_name_is_taken(tmp_path):
    """`--run-dir .` trained in the whole volume (/mnt/runs/) under the name gan; `runs/x/..` in /mnt/runs/..."""
    (tmp_path / "exp2" / "runs").mkdir(parents=True)
    for run_dir, folder in [(".", "exp2"), ("runs/x/..", "runs")]:
        result = ganscale("k8s", *LAYOUT, "--run-dir", run_dir, "--out", f"{folder}.yaml", cwd=tmp_path / "exp2")
        assert result.returncode == 0, result.stderr
        _, jobset = yaml.safe_load_all((tmp_path / "exp2" / f"{folder}.yaml").read_text())
        pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        command = pod["containers"][0]["command"]
        assert command[command.index("--run-dir") + 1] == f"/mnt/runs/{folder}"
        assert jobset["metadata"]["name"] == folder


def test_an_existing_manifest_is_kept_unless_forced(tmp_path):
    out = tmp_path / "job.yaml"
    out.write_text("mine\n")
    refused = ganscale("k8s", "--image", "i", "--out", str(out), cwd=tmp_path)
    assert refused.returncode == 2 and "--force" in refused.stderr and out.read_text() == "mine\n"
    forced = ganscale("k8s", "--image", "i", "--out", str(out), "--force", cwd=tmp_path)
    assert forced.returncode == 0 and "kind: JobSet" in out.read_text()


def pod_process(config_map: dict, jobset: dict, index: int, node: Path, volume: Path) -> subprocess.Popen:
    """Pod `index` of the JobSet as a local process: its container's command and environment as Kubernetes makes
    them, with pod 0's DNS name replaced by 127.0.0.1 (no cluster DNS here; that env value is the only place the
    name appears) and the container's mounts by local folders (the ConfigMap's files, the shared volume)."""
    name = jobset["metadata"]["name"]
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{name}-node-0-{index}"}  # what the controllers add
    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            key = re.fullmatch(r"metadata\.annotations\['(.+)'\]", var["valueFrom"]["fieldRef"]["fieldPath"])[1]
            env[var["name"]] = annotations[key]
    assert env["GANSCALE_RDZV_HOST"] == f"{name}-node-0-0.{name}"  # pod 0 under the JobSet's headless service
    env["GANSCALE_RDZV_HOST"] = "127.0.0.1"
    config = node / "config"
    config.mkdir(parents=True)
    for file, text in config_map["data"].items():
        (config / file).write_text(text)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    local = {"run": volume, "config": config, "shared-memory": "/dev/shm"}  # this machine's own
    mounts = {m["mountPath"]: str(local[m["name"]]) for m in container["volumeMounts"]}

    def in_pod(arg: str) -> str:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg)  # Kubernetes' $(VAR) expansion
        for mount, folder in mounts.items():
            arg = re.sub(rf"^{re.escape(mount)}(?=/|$)", folder, arg)
        return arg

    command = [in_pod(arg) for arg in container["command"]]
    assert command[0] == "python"
    return subprocess.Popen([sys.executable, *command[1:]], cwd=node, env={**clean_env(), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_pods_command_and_environment_rendezvous_and_train_as_nproc_does(tmp_path):
    config_map, jobset = write_manifest(tmp_path)
    volume = tmp_path / "volume"
    pods = [pod_process(config_map, jobset, index, tmp_path / f"pod{index}", volume) for index in range(2)]
    outputs = [pod.communicate(timeout=300) for pod in pods]
    for pod, (_, err) in zip(pods, outputs):
        assert pod.returncode == 0, err[-3000:]
    on_pods = json.loads((volume / "run" / "summary.json").read_text())
    assert (on_pods["world_size"], on_pods["steps"]) == (2, 3)

    local = ganscale("train", *TINY, "--nproc", "2", "--run-dir", "local", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    by_nproc = json.loads((tmp_path / "local" / "summary.json").read_text())
    trained = ("loss_d", "loss_g", "grad_norm_d", "grad_norm_g")
    assert {k: on_pods["final"][k] for k in trained} == {k: by_nproc["final"][k] for k in trained}
