"""How a publisher reports one send's failure (``publisher._failure_of``), as ``asyncio.gather`` with
``return_exceptions=True`` reports several: the send's own exception, a cancellation from inside the send
(aiormq cancels the confirms of a channel that closed) included, while a cancellation of the caller still
cancels it."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.bus.publisher import _failure_of


def test_a_confirm_cancelled_inside_the_send_is_its_failure_not_the_callers() -> None:
    async def main() -> BaseException | None:
        confirm: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        confirm.cancel()  # the channel closed under it
        return await _failure_of(confirm)

    assert isinstance(asyncio.run(main()), asyncio.CancelledError)


def test_an_error_is_returned_and_success_is_none() -> None:
    async def fails() -> None:
        raise ConnectionError("gone")

    async def succeeds() -> None:
        return None

    async def main() -> tuple[BaseException | None, BaseException | None]:
        return await _failure_of(fails()), await _failure_of(succeeds())

    failed, ok = asyncio.run(main())
    assert isinstance(failed, ConnectionError) and ok is None


def test_a_cancellation_of_the_caller_propagates() -> None:
    async def main() -> None:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(_failure_of(never))
        await asyncio.sleep(0)
        waiting.cancel()
        await waiting

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
