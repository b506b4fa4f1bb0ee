"""`python -m ganscale.torchrun ARGS`: torchrun (torch.distributed.run) given ARGS, ended as ganscale ends a launch.

The job scripts' launcher (`ganscale slurm`'s and `ganscale k8s`'s): torchrun's own options and agent, whose end
is said as `ganscale train --nproc` says it (launch.agent_outcome): one line naming the failed ranks and the root
cause's exit code (7 for a refused file; 3 for a stop whose checkpoint was written), no traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path


def run_dir_of(training_args: list[str]) -> Path:
    """The run directory the workers are given (their diagnostics are looked for there after a stop)."""
    for flag, value in zip(training_args, training_args[1:]):
        if flag == "--run-dir":
            return Path(value)
    return Path(".")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import parse_args, run

    from ganscale.launch import agent_outcome

    args = parse_args(argv)
    code, _ = agent_outcome(lambda: run(args), run_dir_of(list(args.training_script_args)))
    return code


if __name__ == "__main__":
    sys.exit(main())
