"""Small asyncio helpers shared by every service."""
from __future__ import annotations

import asyncio


async def cancel_task(task: asyncio.Task | None) -> None:
    """Cancel task (None: nothing) and wait until it ended, whatever it raised."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
