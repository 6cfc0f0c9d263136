"""Where a subpackage's modules live: the repository keeps them in top-level folders (``kernels/``,
``engine/``, ...) so that the tree shows the architecture, and those folders have no ``__init__.py``,
so that Python started in the repository root (the current directory first on ``sys.path``) never
takes one of them for a distribution of the same name (``import kernels``, ``find_spec("kernels")``).

Each subpackage's ``__init__.py`` sits in ``pdfabric/<name>/`` instead. An installed wheel has the
modules beside it (``pyproject.toml`` ships both into ``pdfabric/<name>/``); in the source tree (an
editable install) ``root_folder`` adds the top-level folder to the subpackage's ``__path__``.
"""

from __future__ import annotations

from pathlib import Path


def root_folder(init_file: str) -> list[str]:
    """The top-level folder that holds the modules of the subpackage whose ``__init__.py`` is
    ``init_file``, when pdfabric runs from its source tree; ``[]`` in an installed copy."""
    here = Path(init_file).resolve().parent
    root = here.parent.parent
    folder = root / here.name
    if (root / "pyproject.toml").is_file() and folder.is_dir() and not (folder / "__init__.py").exists():
        return [str(folder)]
    return []
