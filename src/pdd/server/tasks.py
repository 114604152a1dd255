"""Background tasks that must outlive the handler that starts them."""

from __future__ import annotations

import asyncio


def spawn(coro, keep: set) -> None:
    """Run `coro` as a task kept referenced in `keep` until it ends: a release
    that must outlive a cancelled handler, a clean-up call the user's answer
    must not wait for."""
    task = asyncio.get_running_loop().create_task(coro)
    keep.add(task)
    task.add_done_callback(keep.discard)
