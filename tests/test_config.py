from __future__ import annotations

from pathlib import Path

import pytest

from pdfabric.config import load_serve_config
from pdfabric.worker_config import WorkerConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = load_serve_config(path, {})
    assert len(cfg.launch_plan()) > 0


def test_overrides_and_errors(tmp_path: Path) -> None:
    cfg = load_serve_config(None, {"model": "tiny", "max_running": 3, "port": None})
    assert cfg.worker.max_running == 3 and cfg.port == 8000 and cfg.worker.model == "tiny"
    bad = tmp_path / "bad.toml"
    bad.write_text("[serve]\ncolocatd = 1\n")
    with pytest.raises(ValueError, match="colocatd"):
        load_serve_config(bad, {})
    with pytest.raises(ValueError, match="both prefill and decode"):
        load_serve_config(None, {"prefill": 1, "colocated": 0})
    with pytest.raises(ValueError, match="fixed control_port"):
        load_serve_config(None, {"colocated": 0})
    assert load_serve_config(None, {"colocated": 0, "control_port": 5557}).launch_plan() == []
    with pytest.raises(ValueError, match="admin_key_sha256 must be 64 hex digits"):
        load_serve_config(None, {"admin_key_sha256": "secret"})
    with pytest.raises(ValueError, match="max_batch_tokens"):
        WorkerConfig(kind="decode", max_batch_tokens=0)
    with pytest.raises(ValueError, match="kind"):
        WorkerConfig(kind="both")
