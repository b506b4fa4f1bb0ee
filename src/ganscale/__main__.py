import os
import sys

# `python -m` put the current directory first on the module path: a file there (an sklearn.py) must not shadow an
# installed package. usercode.search puts the user's folders back for a config that names their code.
if sys.path and not getattr(sys.flags, "safe_path", False) and os.path.abspath(sys.path[0] or ".") == os.getcwd():
    del sys.path[0]

from ganscale.cli import main  # noqa: E402

main()
