"""A payments-like app whose contracts carry sensitive fields, for the redaction tests: ``probe.charge``
takes a card number and returns a token, both sensitive, and fails its first attempt with an error that
quotes the card, as careless handlers do; ``probe.receipt`` takes the token back."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel

from workers.runtime import TaskContext
from workers.sdk import Sensitive, action, worker


class ChargeInput(BaseModel):
    card: Annotated[str, Sensitive]
    amount: int


class ChargeOutput(BaseModel):
    token: Annotated[str, Sensitive]
    last4: str


class ReceiptInput(BaseModel):
    token: Annotated[str, Sensitive]
    amount: int


class ReceiptOutput(BaseModel):
    sent: bool


@worker("probe.charge", version=1, input=ChargeInput, output=ChargeOutput)
def charge(payload: ChargeInput, context: TaskContext) -> ChargeOutput:
    if context.attempt == 1:
        raise RuntimeError(f"card {payload.card} was declined, try again")
    return ChargeOutput(token=f"tok-{payload.card[::-1]}", last4=payload.card[-4:])


@action("probe.receipt", version=1, input=ReceiptInput, output=ReceiptOutput)
def receipt(payload: ReceiptInput) -> ReceiptOutput:
    return ReceiptOutput(sent=bool(payload.token))
