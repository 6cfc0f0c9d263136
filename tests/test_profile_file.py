"""The profile file: round trip, strict loading, and picking a profile per worker kind."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdfabric.profile import WorkerProfile
from pdfabric.profile_file import FORMAT, ProfileFile, for_kind


def make(role: str = "any", **kw: object) -> ProfileFile:
    base = dict(
        model="tiny",
        profile=WorkerProfile((1e-3, 2e-5, 1e-9), (2e-4, 5e-5, 1e-7), 30, 30, 0.05),
        kv_bytes_per_token=512,
        block_size=16,
        max_batch_tokens=512,
        max_running=64,
        role=role,
        kv_bytes_per_s={"zmq-tcp": 3e8, "shm": 2e9},
        steps=60,
    )
    base.update(kw)
    return ProfileFile(**base)  # type: ignore[arg-type]


def test_round_trip(tmp_path: Path) -> None:
    pf = make(device_name="test cpu", threads=2, dtype="float32", seconds=1.5)
    path = tmp_path / "p.json"
    pf.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT
    assert ProfileFile.load(path) == pf


def test_the_weight_format_is_kept_and_shown(tmp_path: Path) -> None:
    pf = make(dtype="bfloat16", weights="int4")
    pf.save(tmp_path / "p.json")
    assert ProfileFile.load(tmp_path / "p.json").weights == "int4"
    assert "(bfloat16, int4 weights)" in pf.describe()
    assert "weights" not in make(dtype="bfloat16").describe().splitlines()[0]  # none: not shown
    older = make().to_json()
    del older["weights"]  # a file written before the field: the model's dtype
    assert ProfileFile.from_json(older).weights == "none"


def test_unknown_key_and_wrong_format_are_errors(tmp_path: Path) -> None:
    data = make().to_json()
    with pytest.raises(ValueError, match="unknown key.*colour"):
        ProfileFile.from_json({**data, "colour": "red"})
    with pytest.raises(ValueError, match="not a pdfabric profile"):
        ProfileFile.from_json({**data, "format": "other/1"})
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        ProfileFile.load(path)
    with pytest.raises(ValueError, match="cannot read profile"):
        ProfileFile.load(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"role": "router"}, "role must be"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"max_running": True}, "max_running must be a positive integer"),
        ({"kv_bytes_per_s": {"zmq-tcp": 0.0}}, "kv_bytes_per_s"),
    ],
)
def test_invalid_fields(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**change)


def test_negative_coefficients_are_rejected_on_load() -> None:
    data = make().to_json()
    data["profile"]["decode"] = [-1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="decode must be three finite non-negative floats"):
        ProfileFile.from_json(data, "p.json")


def test_kv_rate() -> None:
    pf = make()
    assert pf.kv_rate() == 2e9
    assert pf.kv_rate("zmq-tcp") == 3e8
    with pytest.raises(ValueError, match="no KV rate measured for transport 'dist'"):
        pf.kv_rate("dist")
    assert replace(pf, kv_bytes_per_s={}).kv_rate() == 0.0


def test_for_kind_prefers_the_exact_role() -> None:
    general, prefill, decode = make(), make("prefill", device_name="a"), make("decode", device_name="b")
    assert for_kind([general, prefill, decode], "prefill") is prefill
    assert for_kind([general, prefill, decode], "decode") is decode
    assert for_kind([general, prefill, decode], "colocated") is general
    assert prefill.serves("prefill") and not prefill.serves("decode") and general.serves("decode")
    with pytest.raises(ValueError, match="no profile for colocated workers"):
        for_kind([prefill, decode], "colocated")
