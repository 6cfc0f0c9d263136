"""The repository's top-level folders are the subpackages ``pdfabric.<folder>``, but Python started in
the repository root (its current directory first on ``sys.path``) must never take one of them for a
distribution of the same name: e.g. transformers probes ``find_spec("kernels")`` and the metadata of
the ``kernels`` distribution. Checked from the root with fake distributions, and for the source tree
(editable install) and a built wheel (regular install)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = (
    "engine", "kernels", "kvtransfer", "worker", "prefill", "decode", "kinds", "router", "bench", "cli"
)
IMPORT_ALL = (
    "import json, pdfabric, pdfabric.kernels, pdfabric.kernels.dispatch, pdfabric.engine.block_pool, "
    "pdfabric.kvtransfer.state, pdfabric.worker.core, pdfabric.prefill, pdfabric.decode, "
    "pdfabric.router.routing.holders, pdfabric.cli.main, "
    "pdfabric.bench.goodput; k = pdfabric.kernels; "
    "print(json.dumps({'init': k.__file__, 'path': list(k.__path__), 'dispatch': k.dispatch.__file__, "
    "'api': callable(k.paged_attention), 'csrc': (Path(k.dispatch.__file__).parent / 'csrc').is_dir()}))"
)


def run(code: str, cwd: Path, pythonpath: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_no_top_level_folder_is_a_regular_package() -> None:
    folders = [p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert {p.name for p in folders} >= set(SUBPACKAGES)
    assert [p.name for p in folders if p.name != "pdfabric" and (p / "__init__.py").exists()] == []


def test_distributions_named_like_the_folders_win_from_the_root(tmp_path: Path) -> None:
    names = [*SUBPACKAGES, "tests", "configs"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"FAKE = {name!r}\n")
        info = tmp_path / f"{name}-9.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 9.1\n")
    code = (
        "import importlib, importlib.metadata as md, importlib.util as u, json, sys\n"
        "assert sys.path[0] == ''  # the current directory, the repository root, comes first\n"
        f"names = {names!r}\n"
        "print(json.dumps({n: [u.find_spec(n).origin, md.version(n), importlib.import_module(n).FAKE]"
        " for n in names}))\n"
    )
    found = json.loads(run(code, ROOT, tmp_path))
    for name in names:
        assert found[name] == [str(tmp_path / name / "__init__.py"), "9.1", name]


def test_without_such_a_distribution_the_folder_is_no_package_of_pdfabric_code() -> None:
    """Where no ``kernels`` distribution is installed (one may be: transformers 5.25 requires one,
    and then it wins, as above), the folder is at most an empty namespace. The directories that hold
    one leave the path first; pdfabric's editable install stays (its finder is on the meta path)."""
    code = (
        "import importlib.util as u, sys; from pathlib import Path\n"
        "sys.path[:] = [p for p in sys.path if not p or not (Path(p) / 'kernels' / '__init__.py').exists()]\n"
        "s = u.find_spec('kernels'); print(s.origin, s.loader is None)"
    )
    assert run(code, ROOT).split() == ["None", "True"]  # at most an empty namespace, never pdfabric's API


def test_the_subpackages_import_from_the_source_tree() -> None:
    """From the root the source tree comes first, whichever way pdfabric is installed (an editable
    install gives the same tree from anywhere)."""
    got = json.loads(run("from pathlib import Path; " + IMPORT_ALL, ROOT))
    assert got["init"] == str(ROOT / "pdfabric" / "kernels" / "__init__.py")
    assert got["path"] == [str(ROOT / "pdfabric" / "kernels"), str(ROOT / "kernels")]
    assert got["dispatch"] == str(ROOT / "kernels" / "dispatch.py") and got["api"] and got["csrc"]


def test_a_wheel_carries_each_subpackage_whole(tmp_path: Path) -> None:
    src, wheels, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    junk = shutil.ignore_patterns(".git", ".venv", "out", "build", "dist", "*.egg-info", "__pycache__",
                                  ".pytest_cache", ".ruff_cache")  # fmt: skip
    shutil.copytree(ROOT, src, ignore=junk)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    [wheel] = wheels.glob("pdfabric-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for sub in SUBPACKAGES:
        assert f"pdfabric/{sub}/__init__.py" in names
        assert not any(n.startswith(f"{sub}/") for n in names)  # nothing at the top level but pdfabric
    assert "pdfabric/kernels/dispatch.py" in names and "pdfabric/kernels/csrc/paged_decode_cpu.c" in names
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    got = json.loads(run("from pathlib import Path; " + IMPORT_ALL, tmp_path, target))
    kernels = target / "pdfabric" / "kernels"
    assert got["init"] == str(kernels / "__init__.py") and got["path"] == [str(kernels)]
    assert got["dispatch"] == str(kernels / "dispatch.py") and got["api"] and got["csrc"]
