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
from workers.runtime import TaskContext, Turn, WorkerRuntime, _Cancelled
from workers.sdk import Handler

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


def _slow(started: asyncio.Event) -> Any:
    """A handler that works until it is stopped."""

    async def slow(payload: Payload) -> str:
        started.set()
        await asyncio.sleep(30)
        return "done"

    return slow


Raised = type[BaseException] | None


async def _delivered(
    runtime: WorkerRuntime, handler: Any, raises: type[BaseException] | None
) -> tuple[Any, int]:
    """What a delivery's task gets from ``handler`` run as ``_handle`` runs it (its output, or the
    exception ``raises``, taken here), and how many cancellations the task has left after it (a
    timeout later in the task must not take one as its own)."""
    output: Any = None
    if raises is None:
        output = await _run(runtime, handler)
    else:
        with pytest.raises(raises):
            await _run(runtime, handler)
    async with asyncio.timeout(5):
        await asyncio.sleep(0.01)
    this = asyncio.current_task()
    assert this is not None
    return output, this.cancelling()


def _requested(handler: Any, raises: Raised, requests: int = 1) -> tuple[Any, int]:
    """``_delivered`` for a handler that ``requests`` cancellation requests reach once it has started."""
    started = asyncio.Event()

    async def main() -> tuple[Any, int]:
        runtime = _runtime()
        task = asyncio.create_task(_delivered(runtime, handler(started), raises))
        await started.wait()
        for _ in range(requests):
            await _request(runtime)
        outcome = await task
        assert runtime._running == {}
        return outcome

    return asyncio.run(main())


def test_a_request_stops_the_handler_and_leaves_its_task_uncancelled() -> None:
    assert _requested(_slow, _Cancelled) == (None, 0)


def test_a_request_delivered_twice_still_becomes_the_cancelled_outcome() -> None:
    assert _requested(_slow, _Cancelled, requests=2) == (None, 0)  # its outbox entry re-sent


def test_a_handler_that_swallows_the_request_keeps_its_result_and_its_task_is_not_left_cancelling() -> None:
    def stubborn(started: asyncio.Event) -> Any:
        async def handler(payload: Payload) -> str:
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return "finished anyway"
            return "done"

        return handler

    assert _requested(stubborn, None) == ("finished anyway", 0)


def test_a_handler_that_swallows_the_request_and_then_fails_leaves_its_task_uncancelled() -> None:
    def failing(started: asyncio.Event) -> Any:
        async def handler(payload: Payload) -> str:
            started.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)
            raise ValueError("cleanup failed")

        return handler

    assert _requested(failing, ValueError) == (None, 0)


def test_the_worker_stopping_cancels_the_task_whatever_the_handler() -> None:
    async def main() -> None:
        runtime = _runtime()
        started = asyncio.Event()
        task = asyncio.create_task(_run(runtime, _slow(started)))
        await started.wait()
        task.cancel()  # from outside: no request named the attempt
        with pytest.raises(asyncio.CancelledError):
            await task

        # a request and the worker stopping at once: the stop still goes on up
        started.clear()
        task = asyncio.create_task(_run(runtime, _slow(started)))
        await started.wait()
        task.cancel()
        await _request(runtime)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
