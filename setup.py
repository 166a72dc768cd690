"""Package discovery for the wheel (the metadata is in pyproject.toml).

optfuse's packages, plus every plugin folder under plugins/ as ``optfuse_plugins.<folder>``
without its tests (``test_*.py``, ``conftest.py``): the plugins ship as package data of a real
package, so an installed wheel finds them where a checkout does (:mod:`optfuse.plugin_dirs`).
"""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class _BuildPy(build_py):
    def run(self):
        # a stale build/lib (an earlier build, a removed module) must not leak into this wheel
        if os.path.isdir(self.build_lib) and not self.editable_mode:
            shutil.rmtree(self.build_lib)
        super().run()

    def find_package_modules(self, package, package_dir):
        mods = super().find_package_modules(package, package_dir)
        if package.split(".")[0] != "optfuse_plugins":
            return mods
        return [(pkg, mod, path) for pkg, mod, path in mods if not (mod.startswith("test_") or mod == "conftest")]


def _dirs_with_files(root: str) -> list[str]:
    out = []
    for d, subdirs, files in os.walk(root):
        subdirs[:] = sorted(s for s in subdirs if s not in ("__pycache__", "results", "tests"))
        if any(f.endswith((".py", ".yaml", ".cu", ".cuh")) for f in files):
            out.append(os.path.relpath(d, root).replace(os.sep, "."))
    return out


plugin_packages = ["optfuse_plugins" + ("" if p == "." else "." + p) for p in _dirs_with_files("plugins")]
setup(packages=find_packages(include=["optfuse", "optfuse.*"]) + plugin_packages, cmdclass={"build_py": _BuildPy})
