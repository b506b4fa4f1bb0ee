"""`ganscale k8s`: a JobSet manifest that runs a training as torchrun across pods.

One replicated Job of N indexed pods (one per node), each running torchrun with G processes. JobSet's headless
service gives pod 0 a stable DNS name, which hosts the c10d rendezvous; the node rank is the pod's completion
index. The resolved config travels in a ConfigMap of the same manifest, the run directory lives on a shared
volume, and a failed pod restarts the whole group (failurePolicy.maxRestarts), which resumes with `--resume auto`.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ganscale import config as config_mod
from ganscale import slurm
from ganscale.config import Config, ConfigError, refuse_control_characters

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "node"
CONTAINER = "ganscale"
RDZV_PORT = 29500
CONFIG_MOUNT = "/etc/ganscale"
# A container's /dev/shm is 64 MiB unless a volume replaces it: DataLoader workers pass batches through it and NCCL
# its buffers between the processes of a pod.
SHARED_MEMORY_MOUNT = "/dev/shm"
SCRATCH_MOUNT = "/runs"  # the run volume's mount point without --volume (one node only)
# Set by the Job controller on each pod of an Indexed Job; read through the downward API.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # RFC 1123, as a namespace's name
DNS_LABEL_LIMIT = 63
DNS_SUBDOMAIN_LIMIT = 253  # RFC 1123 subdomain: a PersistentVolumeClaim's name
INT32_MAX = 2**31 - 1
# A run volume mounted at one of these hides what the container runs on.
SYSTEM_FOLDERS = {"/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/sys", "/usr"}
# JobSet's webhook requires its longest pod name, <name>-node-0-<index>-<5 random characters>, to be a DNS label:
# a name of at most 40 characters leaves the index 9 digits, so --nodes may reach 10**9.
NAME_LIMIT = 40
MAX_NODES = 10 ** (DNS_LABEL_LIMIT - len("-abcde") - NAME_LIMIT - len(f"-{REPLICATED_JOB}-0-"))
NAME_HASH_CHARS = 8  # 32 bits: two of 1000 changed names share a hash with odds of about 1 in 10,000
# An image reference as the OCI distribution grammar has it (distribution/reference's regexp.go):
# [registry[:port]/]path[:tag][@digest], path components lower-case; the name (registry and path) 255 at most.
_ALNUM = r"[a-z0-9]+"
_PATH_COMPONENT = rf"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"
_HOST_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_HOST_COMPONENT}(?:\.{_HOST_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(rf"(?P<name>(?:{_HOST}(?::[0-9]+)?/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
                             rf"(?::\w[\w.-]{{0,127}})?(?:@{_DIGEST})?", re.ASCII)
IMAGE_NAME_LIMIT = 255
# Kubernetes rewrites these in a container's command: $(VAR) becomes the variable's value (GANSCALE_NODE_RANK
# differs per pod, so would the run directory), and $$ becomes $.
EXPANDED = ("$(", "$$")
# A memory quantity as Kubernetes reads one (resource.Quantity), above zero, in bytes: 64Gi, 500M, 1.5Ti.
MEMORY = re.compile(r"(?=[0-9.]*[1-9])[0-9]+(?:\.[0-9]+)?(?:[KMGTPE]i|[kMGTPE])?")
# No privilege the training needs: no setuid gain, the runtime's default syscall filter (Pod Security's baseline
# and part of restricted; runAsNonRoot and dropped capabilities depend on the image, so they are the user's to add).
SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "seccompProfile": {"type": "RuntimeDefault"}}


class _Manifest(yaml.SafeDumper):
    """Readable YAML for kubectl: the embedded config as a block of lines, no anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


_Manifest.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


@dataclass(frozen=True)
class Layout:
    """What the user asked Kubernetes for."""

    nodes: int
    gpus_per_node: int
    image: str | None
    namespace: str
    volume: str | None
    max_restarts: int
    cpus_per_node: int | None = None  # None: slurm.default_cpus_per_node
    memory_per_node: str | None = None  # a Kubernetes quantity; None: no memory request

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Volume:
    claim: str | None  # a PersistentVolumeClaim, or None for a pod-local emptyDir
    mount: str


def check_layout(layout: Layout) -> Volume:
    """The run volume, once the layout is one Kubernetes can give; else a ConfigError naming the option."""
    if layout.nodes < 1:
        raise ConfigError("--nodes", f"{layout.nodes} nodes cannot run anything", "pass --nodes 1 or more")
    if layout.nodes > MAX_NODES:
        raise ConfigError("--nodes", f"{layout.nodes} pods would have names longer than Kubernetes allows",
                          f"pass --nodes {MAX_NODES} or fewer")
    if layout.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"{layout.gpus_per_node} GPUs per node start no worker",
                          "pass --gpus-per-node 1 or more")
    if layout.cpus_per_node is not None:
        slurm.check_cpus(layout.gpus_per_node, layout.cpus_per_node)
    if layout.memory_per_node is not None and not MEMORY.fullmatch(layout.memory_per_node):
        raise ConfigError("--memory-per-node", f"{layout.memory_per_node!r} is not a memory size Kubernetes reads",
                          "pass a size such as 64Gi or 500M")
    if not layout.image:
        raise ConfigError("--image", "the pods need a container image with ganscale installed",
                          "pass --image REGISTRY/IMAGE:TAG")
    refuse_control_characters("--image", layout.image)
    reference = IMAGE_REFERENCE.fullmatch(layout.image)
    if reference is None or len(reference["name"]) > IMAGE_NAME_LIMIT:
        raise ConfigError("--image", f"{layout.image!r} is not a container image reference",
                          "pass [REGISTRY[:PORT]/]PATH[:TAG][@DIGEST] without spaces, the path in lower case, e.g. "
                          "ghcr.io/team/ganscale:1.0")
    if not (DNS_LABEL.fullmatch(layout.namespace) and len(layout.namespace) <= DNS_LABEL_LIMIT):
        raise ConfigError("--namespace", f"{layout.namespace!r} is not a Kubernetes namespace name",
                          "pass at most 63 lower-case letters, digits and '-', starting and ending with a letter or "
                          "digit")
    if not 0 <= layout.max_restarts <= INT32_MAX:  # JobSet's failurePolicy.maxRestarts is an int32
        raise ConfigError("--max-restarts", f"{layout.max_restarts} is not a restart count Kubernetes takes",
                          f"pass --max-restarts from 0 to {INT32_MAX}")
    if layout.volume is None:
        if layout.nodes > 1:
            raise ConfigError("--volume", "the nodes of a multi-node run must share its run directory",
                              "pass --volume CLAIM:/path (a ReadWriteMany PersistentVolumeClaim)")
        return Volume(None, SCRATCH_MOUNT)
    refuse_control_characters("--volume", layout.volume)
    claim, colon, mount = layout.volume.partition(":")
    if not colon or not mount.startswith("/"):
        raise ConfigError("--volume", f"'{layout.volume}' is not CLAIM:/path",
                          "pass a PersistentVolumeClaim's name and an absolute mount path, e.g. --volume runs:/runs")
    if not (re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", claim) and len(claim) <= DNS_SUBDOMAIN_LIMIT):
        raise ConfigError("--volume", f"'{claim}' is not a PersistentVolumeClaim's name",
                          f"pass the claim's name as Kubernetes has it: at most {DNS_SUBDOMAIN_LIMIT} lower-case "
                          "letters, digits, '-' and '.', starting and ending with a letter or digit")
    if any(sequence in mount for sequence in EXPANDED):
        raise ConfigError("--volume", f"the mount path '{mount}' holds $( or $$, which Kubernetes rewrites in the "
                          "pods' command", "choose a mount path without them")
    mount = os.path.normpath(mount)
    ours = next((f"the {what} mount {path}" for what, path in (("config's", CONFIG_MOUNT),
                                                                 ("shared memory's", SHARED_MEMORY_MOUNT))
                 if _nested(mount, path)), None)
    if mount in SYSTEM_FOLDERS or ours is not None:
        what = f"the container's {mount}" if mount in SYSTEM_FOLDERS else ours
        raise ConfigError("--volume", f"the mount path '{mount}' would hide or clash with {what}",
                          "mount the claim at a folder of its own, e.g. --volume runs:/runs")
    return Volume(claim, mount)


def _nested(a: str, b: str) -> bool:
    """Whether one of two absolute paths is the other or lies inside it."""
    return a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/")


def run_folder(run_dir: Path) -> str:
    """The run directory's own name, once resolved (`.` is the current folder, `runs/x/..` is `runs`): the folder
    on the pods' volume and the source of the resources' names. A ConfigError at --run-dir where it cannot be."""
    folder = run_dir.resolve().name
    if not folder:
        raise ConfigError("--run-dir", f"{str(run_dir)!r} is the file system's root, which names no run folder",
                          "pass --run-dir with a folder name, e.g. runs/exp1")
    refuse_control_characters("--run-dir", folder)
    if any(sequence in folder for sequence in EXPANDED):
        raise ConfigError("--run-dir", f"the folder name '{folder}' holds $( or $$, which Kubernetes rewrites in the "
                          "pods' command (each pod could train in another folder)", "choose a name without them")
    return folder


def job_name(folder: str) -> str:
    """The JobSet's name (and its ConfigMap's, with -config) for a run folder: a DNS-1035 label of at most
    NAME_LIMIT characters. A folder name that already is one is the name; any other is made one (lower-cased,
    other characters '-', a leading 'gan-' where it does not start with a letter, cut) and ends in a hash of the
    folder name, so two folders never share a name (exp_1 and exp.1, or two long names with the same start)."""
    if re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", folder) and len(folder) <= NAME_LIMIT:
        return folder
    stem = re.sub(r"[^a-z0-9-]+", "-", folder.lower()).strip("-")
    if not stem[:1].isalpha():
        stem = f"gan-{stem}"
    digest = hashlib.sha256(folder.encode()).hexdigest()[:NAME_HASH_CHARS]
    return f"{stem[:NAME_LIMIT - NAME_HASH_CHARS - 1].rstrip('-')}-{digest}"


def worker_command(layout: Layout, name: str, pod_run_dir: str) -> list[str]:
    """torchrun on one pod: rendezvous at pod 0, node rank from the pod's index, the run resumed if there is one."""
    return ["python", "-m", "ganscale.torchrun",  # torchrun, its failures one line and the workers' exit code
            "--nnodes", str(layout.nodes), "--nproc-per-node", str(layout.gpus_per_node),
            "--node-rank", "$(GANSCALE_NODE_RANK)",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"$(GANSCALE_RDZV_HOST):{RDZV_PORT}", "--rdzv-id", name,
            "-m", "ganscale", "train", f"{CONFIG_MOUNT}/config.yaml", "--run-dir", pod_run_dir, "--resume", "auto"]


def _resources(layout: Layout, cpus: int) -> dict:
    """GPUs as request and limit; CPUs requested (no limit: a limit throttles the loaders and the CPU side of each
    step); memory, when given, as request and limit (a pod over its limit is killed, not the node's other pods)."""
    memory = {"memory": layout.memory_per_node} if layout.memory_per_node else {}
    gpus = {"nvidia.com/gpu": layout.gpus_per_node}
    return {"requests": {"cpu": cpus, **memory, **gpus}, "limits": {**memory, **gpus}}


def _pod_spec(layout: Layout, volume: Volume, name: str, pod_run_dir: str, cpus: int) -> dict:
    run_volume = ({"persistentVolumeClaim": {"claimName": volume.claim}} if volume.claim else {"emptyDir": {}})
    return {
        "restartPolicy": "Never",  # a failed pod fails its Job, and JobSet restarts the whole group
        "containers": [{
            "name": CONTAINER,
            "image": layout.image,
            "command": worker_command(layout, name, pod_run_dir),
            "env": [
                {"name": "GANSCALE_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
                # Pod 0's name under the JobSet's headless service (its subdomain is the JobSet's name).
                {"name": "GANSCALE_RDZV_HOST", "value": f"{name}-{REPLICATED_JOB}-0-0.{name}"},
            ],
            "resources": _resources(layout, cpus),
            "securityContext": SECURITY_CONTEXT,
            "volumeMounts": [{"name": "run", "mountPath": volume.mount},
                             {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                             {"name": "shared-memory", "mountPath": SHARED_MEMORY_MOUNT}],
        }],
        "volumes": [{"name": "run", **run_volume},
                    {"name": "config", "configMap": {"name": f"{name}-config"}},
                    {"name": "shared-memory", "emptyDir": {"medium": "Memory"}}],
    }


def manifest(cfg: Config, layout: Layout, run_dir: Path) -> list[dict]:
    """The ConfigMap holding the resolved config, and the JobSet that trains it."""
    volume = check_layout(layout)
    folder = run_folder(run_dir)
    name = job_name(folder)
    pod_run_dir = f"{volume.mount.rstrip('/')}/{folder}"
    cpus = layout.cpus_per_node or slurm.default_cpus_per_node(layout.gpus_per_node, cfg)
    meta = {"name": name, "namespace": layout.namespace, "labels": {"app.kubernetes.io/name": "ganscale"}}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{name}-config"},
                  "data": {"config.yaml": config_mod.to_yaml(cfg)}}
    job = {
        "parallelism": layout.nodes, "completions": layout.nodes, "completionMode": "Indexed",
        "backoffLimit": 0,  # restarts are the group's (failurePolicy), never one pod's alone
        "template": {"metadata": {"labels": meta["labels"]}, "spec": _pod_spec(layout, volume, name, pod_run_dir, cpus)},
    }
    jobset = {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta,
              "spec": {"failurePolicy": {"maxRestarts": layout.max_restarts},
                       "network": {"enableDNSHostnames": True},
                       "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}]}}
    return [config_map, jobset]


def write(recipe: str | None, overrides: tuple[str, ...], layout: Layout, run_dir: str | None, out: str | None,
          force: bool) -> Path:
    """Resolve the config as `ganscale train` does, check the layout, and write the manifest (--out, or
    RUN_DIR/k8s/job.yaml). Raises ConfigError before anything is written."""
    cfg = config_mod.load(recipe, overrides, files_here=False)  # the pods' paths, as given
    check_layout(layout)
    from ganscale import outputs, preflight, rundir  # torch's import (~2 s) only once the options and config are read

    try:
        preflight.check(cfg, layout.world_size, cuda_available=True)  # the pods have the GPUs asked for
    except ConfigError as e:
        if e.key != "train.batch_size":
            raise
        # The world that cannot split the batch is the layout's: name it.
        raise ConfigError(e.key, f"{e.problem} (--nodes {layout.nodes} x --gpus-per-node {layout.gpus_per_node})",
                          f"{e.fix}, or change --nodes or --gpus-per-node") from None
    run = Path(run_dir) if run_dir else rundir.resolve_run(cfg, None, None)[0]
    run_folder(run)  # refused before check_output makes the manifest's folder
    path = outputs.check_output(out or str(run / "k8s" / "job.yaml"), force, "--out" if out else "--run-dir",
                                (".yaml", ".yml"))
    text = yaml.dump_all(manifest(cfg, layout, run), Dumper=_Manifest, sort_keys=False)
    return outputs.write_output(path, lambda tmp: tmp.write_text(text))
