"""An async handler runs in its delivery's own task: a cancellation request for its attempt stops it and
becomes the cancelled outcome, and only that request's cancellation is taken back. The worker stopping
(a cancellation from outside) still goes on up, and a handler that swallows the request's cancellation
leaves its task as it was before."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import BaseModel

from orchestrator.bus.envelope import Envelope, Signer, signed_message
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY
from orchestrator.wire.kinds import Kind
from workers.runtime import Handler, TaskContext, Turn, WorkerRuntime, _Cancelled

SIGNER = Signer.from_settings((DEVELOPMENT_SIGNING_KEY,))
RUN, STAGE, FENCE = "run-1", "render", "1.1"


class Payload(BaseModel):
    pass


def _runtime() -> WorkerRuntime:
    return WorkerRuntime(cast(Any, None), {}, [], SIGNER)


def _request(runtime: WorkerRuntime) -> Any:
    """What the orchestrator sends to cancel the attempt, as the worker's cancel consumer gets it."""
    body = signed_message(
        SIGNER,
        kind=Kind.CANCEL.value,
        message_id="cancel-1",
        run_id=RUN,
        shard="fast.0",
        stage=STAGE,
        fence=FENCE,
    )
    return runtime._on_cancel(cast(Any, SimpleNamespace(body=body)))


async def _run(runtime: WorkerRuntime, function: Any) -> Any:
    handler = cast(Handler, SimpleNamespace(is_async=True, wants_context=False, function=function))
    envelope = Envelope(
        kind=Kind.TASK, message_id="task-1", run_id=RUN, shard="fast.0", stage=STAGE, fence=FENCE
    )
    context = TaskContext(RUN, STAGE, 1, None, FENCE, "c@1", "task-1")
    turn = Turn(runtime, None, False)
    with ThreadPoolExecutor(1) as pool:
        return await runtime._run_cancellable(envelope, handler, Payload(), context, pool, turn)


def test_a_request_stops_the_handler_and_leaves_its_task_uncancelled() -> None:
    async def main() -> None:
        runtime = _runtime()
        started = asyncio.Event()

        async def slow(payload: Payload) -> str:
            started.set()
            await asyncio.sleep(30)
            return "done"

        async def delivery() -> int:
            with pytest.raises(_Cancelled):
                await _run(runtime, slow)
            await asyncio.sleep(0)  # the task goes on: reporting the outcome awaits
            this = asyncio.current_task()
            assert this is not None
            return this.cancelling()

        task = asyncio.create_task(delivery())
        await started.wait()
        await _request(runtime)
        assert await task == 0
        assert runtime._running == {}

    asyncio.run(main())


def test_the_worker_stopping_cancels_the_task_whatever_the_handler() -> None:
    async def main() -> None:
        runtime = _runtime()
        started = asyncio.Event()

        async def slow(payload: Payload) -> str:
            started.set()
            await asyncio.sleep(30)
            return "done"

        task = asyncio.create_task(_run(runtime, slow))
        await started.wait()
        task.cancel()  # from outside: no request named the attempt
        with pytest.raises(asyncio.CancelledError):
            await task

        # a request and the worker stopping at once: the stop still goes on up
        task = asyncio.create_task(_run(runtime, slow))
        started.clear()
        await started.wait()
        task.cancel()
        await _request(runtime)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_handler_that_swallows_the_request_keeps_its_result_and_its_task_is_not_left_cancelling() -> None:
    async def main() -> None:
        runtime = _runtime()
        started = asyncio.Event()

        async def stubborn(payload: Payload) -> str:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return "finished anyway"
            return "done"

        async def delivery() -> tuple[str, int]:
            output = await _run(runtime, stubborn)
            async with asyncio.timeout(5):  # a timeout later in the task must not take it as its own
                await asyncio.sleep(0.01)
            this = asyncio.current_task()
            assert this is not None
            return output, this.cancelling()

        task = asyncio.create_task(delivery())
        await started.wait()
        await _request(runtime)
        assert await task == ("finished anyway", 0)

    asyncio.run(main())


def test_a_request_delivered_twice_still_becomes_the_cancelled_outcome() -> None:
    async def main() -> None:
        runtime = _runtime()
        started = asyncio.Event()

        async def slow(payload: Payload) -> str:
            started.set()
            await asyncio.sleep(30)
            return "done"

        async def delivery() -> int:
            with pytest.raises(_Cancelled):
                await _run(runtime, slow)
            this = asyncio.current_task()
            assert this is not None
            return this.cancelling()

        task = asyncio.create_task(delivery())
        await started.wait()
        await _request(runtime)
        await _request(runtime)  # the same request again (its outbox entry re-sent)
        assert await task == 0

    asyncio.run(main())


def test_a_handler_that_swallows_the_request_and_then_fails_leaves_its_task_uncancelled() -> None:
    async def main() -> None:
        runtime = _runtime()
        started = asyncio.Event()

        async def failing(payload: Payload) -> str:
            started.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)
            raise ValueError("cleanup failed")

        async def delivery() -> int:
            with pytest.raises(ValueError, match="cleanup failed"):
                await _run(runtime, failing)
            this = asyncio.current_task()
            assert this is not None
            return this.cancelling()

        task = asyncio.create_task(delivery())
        await started.wait()
        await _request(runtime)
        assert await task == 0

    asyncio.run(main())
