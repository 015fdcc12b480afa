"""Running a body's choices through the router service, as one stream of (choice position, output).

One choice (the common case, `n` = 1 and one prompt) is iterated directly: no task, no queue on the
token path. Several run as concurrent tasks feeding one queue; the first failure of any ends the whole
request (the others are cancelled, which aborts them on their workers). Callers must close the
iterator (`contextlib.aclosing`) so that leaving early (client gone, error) cancels every choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from router.openai.parse import ApiRequest
from router.service import RouterService
from router.service_types import RouterOutput

_DONE = object()


async def run_choices(
    service: RouterService, api: ApiRequest, deadline_s: float | None, waited_s: float
) -> AsyncGenerator[tuple[int, RouterOutput], None]:
    if len(api.choices) == 1:
        async with aclosing(service.generate(api.choices[0].request, deadline_s, waited_s)) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(position: int) -> None:
        try:
            async with aclosing(service.generate(api.choices[position].request, deadline_s, waited_s)) as outputs:
                async for output in outputs:
                    queue.put_nowait((position, output))
        except Exception as err:  # noqa: BLE001 - handed to the reader, which raises it in the handler's task
            queue.put_nowait((position, err))
            return
        queue.put_nowait((position, _DONE))

    tasks = [asyncio.create_task(pump(position)) for position in range(len(api.choices))]
    try:
        running = len(tasks)
        while running:
            position, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
