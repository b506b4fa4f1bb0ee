"""The torch versions ganscale supports, and the first torch version of each feature it uses.

One table, read by `ganscale doctor`, by the code paths that need a feature (`require`), and by
scripts/bootstrap.sh (loaded by path, before ganscale is installed: this module imports nothing of ganscale).

SUPPORTED is the range whose source was read for every torch API ganscale touches (2.11.0, 2.12.1, 2.13.0,
2.14.1, 2.15.0) and whose suite runs in CI (2.13.0, 2.14.1); the oldest, 2.11.0, ran its suite once by hand
(benchmarks/results/torch-2.11-20261125.md). A torch older than a feature's first version does not have it: that
feature is refused by name (exit 2), the rest of ganscale still runs (2.11 lacks two, both refused narrowly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OLDEST = (2, 11)   # pyproject.toml's floor (torch>=2.11)
NEWEST = (2, 15)   # the newest release when the range was declared; a later one is allowed, but unchecked
DEFAULT_INSTALL = "2.13.0"  # what scripts/bootstrap.sh installs when no torch in range is there


@dataclass(frozen=True)
class Feature:
    first: tuple[int, int]  # the first release that has it; for a private API, the oldest release read (2.11)
    api: str                # what ganscale calls
    used_by: str            # what a user loses without it
    first_known: bool = True  # False: `first` is only the oldest release read, an older one may have it too


FEATURES = {
    "pipeline": Feature((2, 4), "torch.distributed.pipelining (PipelineStage, GPipe/1F1B schedules)",
                        "parallel strategy pipeline"),
    "fsdp": Feature((2, 6), "torch.distributed.fsdp.fully_shard (FSDP2), CPUOffloadPolicy",
                    "parallel strategies zero2, fsdp, hsdp and parallel.cpu_offload"),
    "sharded-checkpoint": Feature((2, 6), "torch.distributed.checkpoint save/load, state_dict API, "
                                  "distribute_tensor(src_data_rank=)", "checkpoint.format=sharded"),
    "compile-callbacks": Feature((2, 11), "torch._dynamo.callback.callback_handler with CallbackArgs",
                                 "the hang watchdog's extra patience while torch compiles", first_known=False),
    "flight-recorder": Feature((2, 11), "torch._C._distributed_c10d._dump_fr_trace_json (gloo and NCCL)",
                               "rankN-flight-recorder.json in a hang's diagnostics", first_known=False),
    "grid-sample-double-backward": Feature((2, 12), "the double backward of torch.nn.functional.grid_sample "
                                           "(aten::grid_sampler_2d_backward's derivative)",
                                           "R1 or the gradient penalty with ADA's geometric operations "
                                           "(augment.ada_ops)"),
    "launcher-grace": Feature((2, 12), "torch.distributed.launcher.api.LaunchConfig(shutdown_timeout=)",
                              "train --nproc with a fault.exit_timeout_s that needs more than the agent's fixed "
                              "30 s between SIGTERM and SIGKILL"),
}
# Not a feature but a spelling: DDP's `forward_sync_buffers` replaced `broadcast_buffers` in 2.13 (`ddp_no_buffer_sync`).


def parse(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a torch version string: '2.14.1+cu130' -> (2, 14, 1); '2.16.0a0' -> (2, 16, 0)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def in_range(version: str) -> bool:
    """Whether `version` is inside the supported range (a release after NEWEST counts: it is allowed)."""
    return parse(version)[:2] >= OLDEST


def checked(version: str) -> bool:
    """Whether `version` is one whose source was read against ganscale's uses (OLDEST..NEWEST)."""
    return OLDEST <= parse(version)[:2] <= NEWEST


def lacking(version: str) -> list[str]:
    """The features (FEATURES' names) a torch of `version` does not have."""
    release = parse(version)[:2]
    return [name for name, feature in FEATURES.items() if feature.first_known and release < feature.first]


def unread(version: str) -> list[str]:
    """The features whose API was not read in a torch of `version` (older than the oldest release read): it may
    or may not have them."""
    release = parse(version)[:2]
    return [name for name, feature in FEATURES.items() if not feature.first_known and release < feature.first]


def running() -> str:
    import torch

    return torch.__version__


def require(name: str, option: str, instead: str | None = None) -> None:
    """Refuse `option` (a ConfigError: one line, exit 2) when the running torch lacks feature `name`; `instead`:
    what else the user can do (default: choose another value for `option`)."""
    if name in lacking(running()):
        from ganscale.config import ConfigError

        feature = FEATURES[name]
        first = ".".join(map(str, feature.first))
        raise ConfigError(option, f"needs torch >= {first} ({feature.api}); this torch is {running()}",
                          f"install torch>={first} (ganscale supports {describe_range()}), or "
                          f"{instead or f'choose another value for {option}'}")


def describe_range() -> str:
    return f"torch {'.'.join(map(str, OLDEST))} through {'.'.join(map(str, NEWEST))}"


_WANTED = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(\+[0-9A-Za-z.]+)?")


def bootstrap_torch(installed: str | None, wanted: str, venv: str) -> tuple[str | None, str]:
    """scripts/bootstrap.sh's choice for the venv `venv` holding torch `installed` (None: none) and GANSCALE_TORCH
    `wanted` ('' when unset): (the pip requirement to install, or None to keep `installed`; the line to print, ''
    for none). A `wanted` that is not a version, or is outside the range, raises ValueError with the line to print.

    `wanted` "2.14" is any 2.14.x (installed as pip's newest 2.14.x), "2.14.1" that release, "2.14.1+cu130" that
    build."""
    supported = f"the supported range ({describe_range()}; a later release is allowed)"
    match = _WANTED.fullmatch(wanted) if wanted else None
    if wanted and match is None:
        raise ValueError(f"ganscale: GANSCALE_TORCH={wanted} is not a torch version; set it to one in {supported}, "
                         f"e.g. GANSCALE_TORCH={DEFAULT_INSTALL}, or unset it")
    if wanted and not in_range(wanted):
        raise ValueError(f"ganscale: GANSCALE_TORCH={wanted} is outside {supported}: pip would replace it with "
                         f"the newest torch on every call; set GANSCALE_TORCH to a version in the range, e.g. "
                         f"{DEFAULT_INSTALL}, or unset it")
    # "2.14" asks for the newest 2.14.x pip finds; a full version asks for exactly that one
    requirement = (f"torch=={wanted}" if match and match[3] else f"torch=={wanted}.*" if match
                   else f"torch=={DEFAULT_INSTALL}")
    shown = requirement.removeprefix("torch==")
    if installed is None:
        return requirement, ""  # a new venv: its first install is the normal, quiet case
    try:
        release = parse(installed)
    except ValueError:
        release = None
    if release is None or not in_range(installed):
        how = f" (GANSCALE_TORCH={wanted})" if wanted else " (set GANSCALE_TORCH=... to choose)"
        span = f"{'.'.join(map(str, OLDEST))}-{'.'.join(map(str, NEWEST))}"
        return requirement, (f"ganscale: torch {installed} in {venv} is outside the supported range {span}; "
                             f"installing torch {shown}{how}")
    if match:
        local = installed.partition("+")[2]
        same = release[:2] == (int(match[1]), int(match[2])) and (not match[3] or release[2] == int(match[3])) and \
            (not match[4] or local == match[4][1:])
        if not same:
            return requirement, (f"ganscale: torch {installed} in {venv} is not GANSCALE_TORCH={wanted}; "
                                 f"replacing it with torch {shown}")
    return None, ""


def ddp_no_buffer_sync() -> dict[str, bool]:
    """DDP's keyword that turns the pre-forward buffer broadcast off, as the running torch spells it: torch 2.13
    renamed `broadcast_buffers` (2.11, 2.12; deprecated since) to `forward_sync_buffers`."""
    import inspect

    from torch.nn import parallel

    new = "forward_sync_buffers" in inspect.signature(parallel.DistributedDataParallel).parameters
    return {"forward_sync_buffers": False} if new else {"broadcast_buffers": False}
