"""Training from a script with the Python API: the config as a dict, the networks, data set and loss as Python
objects (examples/conditional_gan's package), on one process, N local workers, or under torchrun:

    python examples/api/train.py --steps 200
    python examples/api/train.py --steps 200 --nproc 2
    torchrun --standalone --nproc-per-node 2 examples/api/train.py --steps 200 --run-dir runs/api-torchrun
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import ganscale

# The package of examples/conditional_gan, made importable here; your own would be on your path already. ganscale
# records each object as "module:qualname" and this folder in the run's code_path, for workers and resumes.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "conditional_gan"))
from cond_gan.data import LabelledDigits  # noqa: E402
from cond_gan.losses import smoothed  # noqa: E402
from cond_gan.nets import ConditionalGenerator, ProjectionDiscriminator  # noqa: E402

CONFIG = {
    "name": "api-conditional-digits",
    "model": {"kind": "custom", "task": "class-conditional", "n_classes": 10, "z_dim": 32,
              "generator_args": {"z_dim": 32, "n_classes": 10, "width": 64},
              "discriminator_args": {"n_classes": 10, "width": 64}},
    "data": {"kind": "custom", "dataset_args": {"n_classes": 10}, "resolution": 8, "channels": 1},
    "train": {"steps": 3000, "batch_size": 64},
    "log": {"every": 100, "sample_every": 500, "samples": 100},
    "checkpoint": {"every": 500},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--nproc", type=int, default=None, help="local worker processes (default: this one)")
    parser.add_argument("--run-dir", default=None, help="default: runs/api-conditional-digits-<time>")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    summary = ganscale.train(CONFIG, overrides=[f"train.steps={args.steps}", *args.overrides],
                             generator=ConditionalGenerator, discriminator=ProjectionDiscriminator,
                             dataset=LabelledDigits, loss=smoothed, nproc=args.nproc, run_dir=args.run_dir)
    if summary is not None and os.environ.get("RANK", "0") == "0":  # every rank returns it; one says it
        print(f"trained {summary['steps']} steps on {summary['world_size']} process(es): {summary['run_dir']}")


if __name__ == "__main__":
    main()
