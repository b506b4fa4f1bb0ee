import os
import sys

# `python -m` put the current directory first on the module path: a file there (an sklearn.py) must not shadow an
# installed package. usercode.search puts the user's folders back for a config that names their code.
if sys.path and not getattr(sys.flags, "safe_path", False) and os.path.abspath(sys.path[0] or ".") == os.getcwd():
    del sys.path[0]

from ganscale.console import drop_when_gone  # noqa: E402 - the standard library only
from ganscale.fault import StartupStops, StoppedBeforeTraining, has_peers  # noqa: E402 - the standard library only

if sys.argv[1:2] == ["train"]:  # stop signals from here on, not once the CLI is imported (~0.4 s): a launcher's workers
    StartupStops(has_peers()).__enter__()  # left by `train` (cli.train)
    drop_when_gone()  # a console that closes (`| head`, a hung-up terminal) does not end the training
try:
    from ganscale.cli import main  # noqa: E402

    main()
except StoppedBeforeTraining as e:  # before `train` began (cli.train says it from there on)
    print(f"ganscale: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
