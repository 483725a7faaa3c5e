"""A front service linked to an engine over the front hub's socket, both in this process: what
``--front-procs`` runs in two processes, for tests of the link's protocol without spawning a front."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ominix_runtime.config import RuntimeConfig
from ominix_runtime.engine.core import EngineCore
from ominix_runtime.server.engine_service import EngineService
from ominix_runtime.server.front_hub import FrontHub, FrontSpec
from ominix_runtime.server.front_process import EngineLink, FrontService


@contextlib.asynccontextmanager
async def linked_front(
    core: EngineCore, service: EngineService, config: RuntimeConfig | None = None
) -> AsyncIterator[tuple[EngineLink, FrontService]]:
    """A hub for ``core`` and ``service`` listening on its socket, and front 0's link and service connected to
    it. On exit the front closes and the hub stops (its socket and directory removed); ``core`` is the
    caller's to stop."""
    config = config or RuntimeConfig()
    hub = FrontHub(config, core, service)
    await hub.listen()
    link, first_messages = await EngineLink.connect(hub.link_path)
    reading = asyncio.create_task(link.run(first_messages))
    front = FrontService(link, FrontSpec(config, 0, hub.link_path))
    try:
        yield link, front
    finally:
        front.close()
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        await hub.stop()
