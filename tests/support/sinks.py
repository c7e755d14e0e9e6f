"""An in-memory event sink for tests: what a producer emitted, round-tripped through the wire encoding."""

from __future__ import annotations

from runledger.schemas import Envelope, Event, decode_event, encode_event


class ListSink:
    """An in-memory sink that round-trips every event through the wire encoding."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.syncs = 0

    def emit(self, envelope: Envelope) -> None:
        self.raw.append(encode_event(envelope))

    def sync(self) -> None:
        self.syncs += 1

    def close(self) -> None:
        pass

    @property
    def events(self) -> list[Envelope]:
        return [_decoded(raw).envelope for raw in self.raw]

    def of(self, type_suffix: str) -> list[Envelope]:
        return [e for e in self.events if e.type.endswith(type_suffix)]


def _decoded(raw: bytes) -> Event:
    event = decode_event(raw)
    assert isinstance(event, Event), event
    return event
