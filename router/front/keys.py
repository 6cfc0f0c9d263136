"""The router application's state, by typed key: what ``app.build_app`` puts in and the handlers
read."""

from __future__ import annotations

from aiohttp import web

from pdfabric.config import ServeConfig
from pdfabric.router.dispatch.dispatcher import Dispatcher
from pdfabric.router.front import idempotency as idem
from pdfabric.router.front.metrics import RouterMetrics
from pdfabric.router.platform.catalog import Catalog
from pdfabric.router.platform.scaler import Observations

CONFIG = web.AppKey("config", ServeConfig)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
CATALOG = web.AppKey("catalog", Catalog)
OBSERVED = web.AppKey("observed", Observations)  # recent requests: what the pool scaler reads
METRICS = web.AppKey("metrics", RouterMetrics)
IDEMPOTENCY = web.AppKey("idempotency", idem.IdempotencyStore)
# what the batch runner's own requests carry (in memory only; router/platform/batch_runner.py)
BATCH_TOKEN = web.AppKey("batch_token", str)
BATCH_CLASS = web.AppKey("batch_class", str)  # the class the batch runner's requests are admitted in
