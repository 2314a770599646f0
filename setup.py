"""Package discovery for the one `pagoda` distribution mapped onto the fixed top level.

pyproject.toml holds the metadata; this only lists every subpackage under the three
roots (`pagoda` -> libs/pagoda, `pagoda.services` -> services, `pagoda.kernels` ->
kernels), which setuptools' automatic discovery cannot do across remapped folders.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"pagoda": "libs/pagoda", "pagoda.services": "services", "pagoda.kernels": "kernels"}


def find_packages() -> list[str]:
    packages = []
    for name, folder in ROOTS.items():
        root = Path(folder)
        for init in sorted(root.rglob("__init__.py")):
            rel = init.parent.relative_to(root)
            packages.append(".".join([name, *rel.parts]) if rel.parts else name)
    return sorted(set(packages))


# The CPU kernels' C++ source is compiled where it runs (pagoda.kernels.cpu.build).
setup(packages=find_packages(), package_dir=ROOTS,
      package_data={"pagoda.kernels.cpu": ["csrc/*.cpp"]})
