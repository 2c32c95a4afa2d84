"""``await handle``: suspends the coroutine until te's notifier thread says the batch
resolved; nothing polls."""

import asyncio


def _resolve(fut):
    if not fut.done():
        fut.set_result(None)


async def wait(handle):
    """Waits for ``handle`` without blocking the event loop; raises its error.

    Cancelling the awaiting task cancels the batch."""
    if not handle.done():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def wake():
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                pass  # the loop closed meanwhile: nobody is waiting any more

        handle._on_done(wake)
        try:
            await fut
        except asyncio.CancelledError:
            handle.cancel()
            raise
    handle.wait(0)
