"""`ganscale k8s`: a JobSet manifest that runs a training as torchrun across pods.

One replicated Job of N indexed pods (one per node), each running torchrun with G processes. JobSet's headless
service gives pod 0 a stable DNS name, which hosts the c10d rendezvous; the node rank is the pod's completion
index. The resolved config travels in a ConfigMap of the same manifest, the run directory lives on a shared
volume, and a failed pod restarts the whole group (failurePolicy.maxRestarts), which resumes with `--resume auto`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ganscale import config as config_mod
from ganscale import outputs, preflight, rundir
from ganscale.config import Config, ConfigError

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "node"
CONTAINER = "ganscale"
RDZV_PORT = 29500
CONFIG_MOUNT = "/etc/ganscale"
SCRATCH_MOUNT = "/runs"  # the run volume's mount point without --volume (one node only)
# Set by the Job controller on each pod of an Indexed Job; read through the downward API.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
NAME_LIMIT = 40  # pod host names are <name>-node-0-<index>, which Kubernetes caps at 63 characters


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
    if layout.gpus_per_node < 1:
        raise ConfigError("--gpus-per-node", f"{layout.gpus_per_node} GPUs per node start no worker",
                          "pass --gpus-per-node 1 or more")
    if not layout.image:
        raise ConfigError("--image", "the pods need a container image with ganscale installed",
                          "pass --image REGISTRY/IMAGE:TAG")
    if layout.max_restarts < 0:
        raise ConfigError("--max-restarts", f"{layout.max_restarts} is negative", "pass --max-restarts 0 or more")
    if layout.volume is None:
        if layout.nodes > 1:
            raise ConfigError("--volume", "the nodes of a multi-node run must share its run directory",
                              "pass --volume CLAIM:/path (a ReadWriteMany PersistentVolumeClaim)")
        return Volume(None, SCRATCH_MOUNT)
    claim, _, mount = layout.volume.partition(":")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", claim) or not mount.startswith("/"):
        raise ConfigError("--volume", f"'{layout.volume}' is not CLAIM:/path",
                          "pass a PersistentVolumeClaim's name and an absolute mount path, e.g. --volume runs:/runs")
    return Volume(claim, mount.rstrip("/") or "/")


def job_name(run_dir: Path) -> str:
    """A Kubernetes name (a DNS label) from the run directory's name."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_dir.name.lower())[:NAME_LIMIT].strip("-")
    return name if name and name[0].isalpha() else f"gan-{name}".rstrip("-")


def worker_command(layout: Layout, name: str, pod_run_dir: str) -> list[str]:
    """torchrun on one pod: rendezvous at pod 0, node rank from the pod's index, the run resumed if there is one."""
    return ["python", "-m", "torch.distributed.run",
            "--nnodes", str(layout.nodes), "--nproc-per-node", str(layout.gpus_per_node),
            "--node-rank", "$(GANSCALE_NODE_RANK)",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"$(GANSCALE_RDZV_HOST):{RDZV_PORT}", "--rdzv-id", name,
            "-m", "ganscale", "train", f"{CONFIG_MOUNT}/config.yaml", "--run-dir", pod_run_dir, "--resume", "auto"]


def _pod_spec(layout: Layout, volume: Volume, name: str, pod_run_dir: str) -> dict:
    gpus = {"nvidia.com/gpu": layout.gpus_per_node}
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
            "resources": {"requests": dict(gpus), "limits": dict(gpus)},
            "volumeMounts": [{"name": "run", "mountPath": volume.mount},
                             {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}],
        }],
        "volumes": [{"name": "run", **run_volume},
                    {"name": "config", "configMap": {"name": f"{name}-config"}}],
    }


def manifest(cfg: Config, layout: Layout, run_dir: Path) -> list[dict]:
    """The ConfigMap holding the resolved config, and the JobSet that trains it."""
    volume = check_layout(layout)
    name = job_name(run_dir)
    pod_run_dir = f"{volume.mount.rstrip('/')}/{run_dir.name}"
    meta = {"name": name, "namespace": layout.namespace, "labels": {"app.kubernetes.io/name": "ganscale"}}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{name}-config"},
                  "data": {"config.yaml": config_mod.to_yaml(cfg)}}
    job = {
        "parallelism": layout.nodes, "completions": layout.nodes, "completionMode": "Indexed",
        "backoffLimit": 0,  # restarts are the group's (failurePolicy), never one pod's alone
        "template": {"metadata": {"labels": meta["labels"]}, "spec": _pod_spec(layout, volume, name, pod_run_dir)},
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
    try:
        preflight.check(cfg, layout.world_size, cuda_available=True)  # the pods have the GPUs asked for
    except ConfigError as e:
        if e.key != "train.batch_size":
            raise
        # The world that cannot split the batch is the layout's: name it.
        raise ConfigError(e.key, f"{e.problem} (--nodes {layout.nodes} x --gpus-per-node {layout.gpus_per_node})",
                          f"{e.fix}, or change --nodes or --gpus-per-node") from None
    run = Path(run_dir) if run_dir else rundir.resolve_run(cfg, None, None)[0]
    path = outputs.check_output(out or str(run / "k8s" / "job.yaml"), force)
    text = yaml.dump_all(manifest(cfg, layout, run), Dumper=_Manifest, sort_keys=False)
    return outputs.write_output(path, lambda tmp: tmp.write_text(text))
