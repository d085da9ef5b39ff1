"""What crossed process boundaries for an executor: messages and their bytes, by route.

An executor counts the messages between the engine and its ranks; each rank counts what
it exchanges with the other ranks (plugserve.worker.parallel). The figures are totals
since start: what one engine step costs is the difference over a run divided by the
batches run, which is how docs/distributed.md's table is measured.
"""

from __future__ import annotations

import msgspec


class MessageCounts(msgspec.Struct):
    """Totals since start. Each route counts one message per process that receives it."""

    # Forward passes the executor ran (an engine step, or one batch of pipeline stages).
    batches: int = 0
    # Engine → ranks: one per rank a command reaches (a pipe write, a Ray call).
    commands: int = 0
    command_bytes: int = 0
    # Ranks → engine: the answers to those commands.
    replies: int = 0
    reply_bytes: int = 0
    # Among a stage's tensor-parallel ranks: one per rank per collective call
    # (all-reduce, gather, broadcast), its bytes that rank's tensor.
    collectives: int = 0
    collective_bytes: int = 0
    # From a stage to the next: one per point-to-point send.
    stage_sends: int = 0
    stage_send_bytes: int = 0

    def __add__(self, other: MessageCounts) -> MessageCounts:
        return MessageCounts(
            **{f: getattr(self, f) + getattr(other, f) for f in self.__struct_fields__}
        )

    def __sub__(self, other: MessageCounts) -> MessageCounts:
        return MessageCounts(
            **{f: getattr(self, f) - getattr(other, f) for f in self.__struct_fields__}
        )
