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


def test_a_speculative_table_sets_the_workers_speculation(tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(
        '[speculative]\nmethod = "draft"\nk = 6\nbelow = 2\ndraft_quantization = "int8"\n'
        'draft_cache = "own"\n'
    )
    w = load_serve_config(path, {}).worker
    got = (w.speculative, w.speculative_k, w.speculative_below, w.draft_quantization, w.draft_cache)
    assert got == ("draft", 6, 2, "int8", "own")
    assert load_serve_config(path, {"speculative": "ngram"}).worker.speculative == "ngram"  # flags win
    for text, error in (
        ('[speculative]\nmethod = "draft"\n[worker]\nspeculative = "ngram"\n', "set in both"),
        ("[speculative]\nn = 3\n", "unknown key"),
        ('[speculative]\nmethod = "medusa"\n', "speculative"),
        ('[speculative]\nk = "four"\n', "speculative_k must be int"),
        ('[speculative]\ndraft_cache = "shared"\n', "draft_cache must be one of auto, own"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=error):
            load_serve_config(path, {})


def test_a_kv_store_table_sets_the_workers_host_store(tmp_path: Path) -> None:
    path = tmp_path / "store.toml"
    path.write_text('[kv_store]\nram_mb = 512\ndisk_dir = "/d"\ndisk_mb = 1024\ndisk_admission = "all"\n')
    w = load_serve_config(path, {}).worker
    got = (w.kv_store_ram_mb, w.kv_store_disk_dir, w.kv_store_disk_mb, w.kv_store_disk_admission)
    assert got == (512, "/d", 1024, "all")
    assert w.kv_store and not load_serve_config(None, {}).worker.kv_store
    assert load_serve_config(path, {"kv_store_ram_mb": 64}).worker.kv_store_ram_mb == 64  # flags win
    for text, error in (
        ("[kv_store]\nram_mb = 1\n[worker]\nkv_store_ram_mb = 2\n", "set in both"),
        ("[kv_store]\nram_gb = 3\n", "unknown key"),
        ('[kv_store]\ndisk_dir = "/d"\n', "disk_dir and disk_mb go together"),
        ("[kv_store]\nram_mb = -1\n", "must be >= 0"),
        ('[kv_store]\nram_mb = 1\ndisk_admission = "lru"\n', "disk_admission must be one of"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=error):
            load_serve_config(path, {})
