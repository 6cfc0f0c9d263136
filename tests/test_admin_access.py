"""Who may use the admin API: with an admin key, whoever presents it (401 otherwise); without one,
only callers on the router's own loopback (403 for any other address, audited), whatever the bind."""

from __future__ import annotations

import hashlib
import io
import json
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from pdfabric.router.platform import admin
from pdfabric.router.platform.tenants import UsageBook
from pdfabric.routing_config import AdmissionConfig

KEY = "s3cret-admin"


def _app(key_sha256: str) -> tuple[web.Application, io.StringIO]:
    app = web.Application()
    audit = admin.Audit()
    audit._out = out = io.StringIO()  # the audit lines, to read back
    admin.add_admin(app, mock.Mock(), key_sha256, UsageBook(AdmissionConfig()), audit)
    return app, out


def _request(app: web.Application, peer: str, token: str = "") -> web.Request:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (peer, 40000) if name == "peername" else default
    )
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return make_mocked_request("GET", "/admin/usage", headers=headers, app=app, transport=transport)


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"])
def test_without_a_key_loopback_callers_are_served(peer: str) -> None:
    app, _ = _app("")
    assert admin.unauthorized(_request(app, peer), "usage", "") is None


@pytest.mark.parametrize("peer", ["10.0.0.7", "192.168.1.2", "2001:db8::1", "::ffff:10.0.0.7"])
def test_without_a_key_other_callers_get_a_403_that_is_audited(peer: str) -> None:
    app, out = _app("")
    refused = admin.unauthorized(_request(app, peer, token="anything"), "usage", "")
    assert refused is not None and refused.status == 403
    assert "loopback" in json.loads(refused.body)["error"]["message"]
    entry = json.loads(out.getvalue())
    assert entry["status"] == 403 and entry["remote"] == peer and entry["audit"] == "usage"


def test_with_a_key_the_key_decides_wherever_the_caller_is() -> None:
    app, _ = _app(hashlib.sha256(KEY.encode()).hexdigest())
    for peer in ("127.0.0.1", "10.0.0.7"):
        assert admin.unauthorized(_request(app, peer, token=KEY), "usage", "") is None
        for token in ("", "wrong"):
            refused = admin.unauthorized(_request(app, peer, token=token), "usage", "")
            assert refused is not None and refused.status == 401
