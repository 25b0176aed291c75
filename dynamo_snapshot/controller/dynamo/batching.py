"""Create many objects at once without hammering the apiserver when something is wrong.

The ReplicaSet controller's slow start: batches of 1, 2, 4, ... run concurrently, and the first batch
with a failure stops the rest. A healthy scale-up of N pods then costs about log2(N) round trips instead
of N, while a quota or admission error costs one request, not N.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

INITIAL_BATCH = 1


async def slow_start(create: Callable[[], Awaitable[None]], count: int) -> int:
    """Run `create` `count` times in doubling concurrent batches; return how many succeeded.

    Raises the first error of the first batch that had one, after that batch has finished (so every
    create that started is accounted for by its own callback).
    """
    done = 0
    batch = INITIAL_BATCH
    while done < count:
        size = min(batch, count - done)
        results = await asyncio.gather(*(create() for _ in range(size)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        done += size - len(errors)
        if errors:
            raise errors[0]
        batch *= 2
    return done
