"""What the transition functions of the ``saga`` Redis library answer, as one enum.

Every transition function (``lua/*.lua``) replies ``{code, detail[, revision]}``; ``helpers.lua`` names
the same codes in its first lines, and a unit test holds the two to each other. The in-memory model
answers the same codes.
"""

from __future__ import annotations

from enum import IntEnum


class Reply(IntEnum):
    APPLIED = 0  # every check held and every write was made
    DUPLICATE = 1  # the message (or the member, for an arrival) was seen before: recorded, nothing else
    CONFLICT = 2  # an expected field no longer holds (detail: which): decide again from a fresh read
    EXISTS = 3  # a create found its run already there
    NO_RUN = 4  # the run is not there (never created, or expired)
    TIMER_GONE = 5  # a fired timer another transition removed or moved first


APPLIED, DUPLICATE, CONFLICT, EXISTS, NO_RUN, TIMER_GONE = Reply
