"""Models and versions without a server: the [[models]] config, the launch plan, a request's version
(weights, sticky, pinned) and routing only to that version's workers."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from pdfabric.config import load_serve_config
from pdfabric.control import Register
from pdfabric.router.errors import ApiError
from pdfabric.router.platform.catalog import Catalog, Version
from pdfabric.router.routing.registry import Registry, has_route

CONFIG = """
[worker]
kv_memory_mb = 16

[[models]]
name = "chat"
[[models.versions]]
name = "v1"
model = "tiny"
weight = 3
colocated = 1
[[models.versions]]
name = "v2"
model = "tiny-b"
weight = 1
prefill = 1
decode = 1
max_running = 8

[[models]]
name = "small"
sticky = false
[[models.versions]]
name = "a"
model = "tiny"
colocated = 2
"""


def test_models_config_gives_each_version_its_workers(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(CONFIG)
    cfg = load_serve_config(path, {})
    assert (cfg.prefill, cfg.decode, cfg.colocated) == (0, 0, 0)  # [[models]] replaces the default pool
    plan = dict(cfg.launch_plan())
    assert sorted(plan) == [
        "colocated-chat-v1-0", "colocated-small-a-0", "colocated-small-a-1", "decode-chat-v2-0",
        "prefill-chat-v2-0",
    ]  # fmt: skip
    assert plan["decode-chat-v2-0"].served == "chat@v2"
    assert plan["decode-chat-v2-0"].model == "tiny-b"
    assert plan["decode-chat-v2-0"].max_running == 8
    assert plan["colocated-chat-v1-0"].max_running == 64  # the override is v2's only
    assert plan["colocated-chat-v1-0"].kv_memory_mb == 16
    assert cfg.count("colocated") == 3


@pytest.mark.parametrize(
    ("versions", "error"),
    [
        ('[[models.versions]]\nname = "v1"\nmodel = "tiny"\nprefill = 1\n', "needs prefill and decode"),
        ('[[models.versions]]\nname = "v 1"\nmodel = "tiny"\ncolocated = 1\n', "a version name"),
        ('[[models.versions]]\nname = "v1"\nmodel = "tiny"\nweight = -1\ncolocated = 1\n', "weight"),
        ('[[models.versions]]\nname = "v1"\nmodel = "tiny"\nbogus = 1\n', "unknown key"),
        ('[[models.versions]]\nname = "v1"\ncolocated = 1\n', "needs a model"),
        ("", "at least one"),
    ],
)
def test_bad_models_config_names_the_problem(tmp_path: Path, versions: str, error: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text('[[models]]\nname = "chat"\n' + versions)
    with pytest.raises(ValueError, match=error):
        load_serve_config(path, {})


def _catalog(sticky: bool = True) -> Catalog:
    catalog = Catalog(random.Random(7))
    for name, weight in (("v1", 90.0), ("v2", 10.0)):
        catalog.add(Version("chat", name, "tiny", None, weight), sticky)  # type: ignore[arg-type]
    return catalog


def test_traffic_splits_by_weight_and_sticks_to_a_user() -> None:
    catalog = _catalog()
    picks = Counter(catalog.resolve("chat").name for _ in range(2000))
    assert 0.87 < picks["v1"] / 2000 < 0.93
    by_user = Counter(catalog.resolve("chat", f"user-{i}").name for i in range(2000))
    assert 0.87 < by_user["v1"] / 2000 < 0.93
    for i in range(50):  # the same user, the same version, every time
        assert len({catalog.resolve("chat", f"user-{i}").name for _ in range(5)}) == 1


def test_a_pin_picks_its_version_even_without_traffic_and_unknown_names_are_400() -> None:
    catalog = _catalog()
    catalog.set_weights("chat", {"v2": 0})
    assert {catalog.resolve("chat").name for _ in range(200)} == {"v1"}
    assert catalog.resolve("chat@v2").label == "chat@v2"
    for bad in ("chat@v3", "other", "chat@"):
        with pytest.raises(ApiError) as err:
            catalog.resolve(bad)
        assert (err.value.status, err.value.param) == (400, "model")
    with pytest.raises(ValueError, match="no version with traffic"):
        catalog.set_weights("chat", {"v1": 0})
    with pytest.raises(ValueError, match="no live version"):
        catalog.set_weights("chat", {"v9": 1})
    assert catalog.names() == ("chat", "chat@v1", "chat@v2")


def test_an_unversioned_model_keeps_its_name_and_the_empty_key() -> None:
    v = Version("tiny", "", "tiny", None)  # type: ignore[arg-type]
    assert (v.key, v.label) == ("", "tiny")
    assert Version("chat", "v1", "tiny", None).key == "chat@v1"  # type: ignore[arg-type]


def _reg(wid: str, kind: str, served: str) -> Register:
    from tests.test_routing import PROFILE

    return Register(wid, kind, "default", "tiny", 4096, 16, 100, "", 1, 64, 512, 1000, PROFILE, served=served)


def test_routes_exist_per_version_and_a_request_sees_only_its_versions_workers() -> None:
    from pdfabric.router.routing.admission import Ticket
    from pdfabric.router.routing.choice import Routing
    from pdfabric.router.routing.routes import Budgets

    registry = Registry()
    registry.register(_reg("c0", "colocated", ""))
    registry.register(_reg("p0", "prefill", "chat@v2"))
    assert has_route(registry, "") and has_route(registry)
    assert not has_route(registry, "chat@v2")  # a prefill worker without a decode worker
    registry.register(_reg("d0", "decode", "chat@v2"))
    assert has_route(registry, "chat@v2")
    assert registry.max_model_len("chat@v2") == 4096 and registry.max_model_len("nope") == 0
    routing = Routing(registry)
    budgets = Budgets(1e6, 1e6)
    for served, workers in (("", {"c0"}), ("chat@v2", {"p0", "d0"})):
        ticket = Ticket("r", "t", "interactive", budgets, 8, 0.0, served=served)
        assert {c.worker_id for c in routing.candidates(ticket)} == workers
        choice = routing.fit(ticket, budgets).choices[0]
        assert {choice.prefill, choice.decode} == workers
        routing.forget("r")
