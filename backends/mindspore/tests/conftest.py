"""The tests import their helpers (common, launch) from this folder. Where MindSpore is not
installed (a torch layer's environment running ``pytest`` from the repository root) the
folder is left out instead of failing to import; ``nox -s mindspore`` installs it."""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

collect_ignore_glob = [] if importlib.util.find_spec("mindspore") else ["*.py"]
