"""Import every module of the given torch-free distributions and prove torch stayed out.

Usage: python tools/check_torch_free.py gm-config gm-passes
"""

from __future__ import annotations

import importlib
import pkgutil
import sys


def main(dists: list[str]) -> int:
    imported = []
    for dist in dists:
        package = importlib.import_module(dist.replace("-", "_"))
        imported.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            importlib.import_module(info.name)
            imported.append(info.name)
    leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    if leaked:
        print(f"torch was imported by the torch-free layers: {leaked[:5]}", file=sys.stderr)
        return 1
    print(f"imported {len(imported)} modules without torch: {', '.join(imported)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
