from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerInfo(_message.Message):
    __slots__ = ("engine_id", "rank", "protocol_version", "layout_fingerprint", "transport")
    class TransportEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rank: int
    protocol_version: int
    layout_fingerprint: str
    transport: _containers.ScalarMap[str, bytes]
    def __init__(self, engine_id: _Optional[str] = ..., rank: _Optional[int] = ..., protocol_version: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., transport: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: PeerInfo
    def __init__(self, peer: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: PeerInfo
    def __init__(self, peer: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "aborted", "grant", "keep")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    aborted: bool
    grant: bytes
    keep: bool
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., aborted: bool = ..., grant: _Optional[bytes] = ..., keep: bool = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("duplicate", "held")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    held: bool
    def __init__(self, duplicate: bool = ..., held: bool = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("holder", "address", "hashes", "ttl_s")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    holder: str
    address: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, holder: _Optional[str] = ..., address: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("holder", "ttl_s")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    holder: str
    ttl_s: float
    def __init__(self, holder: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: bool = ...) -> None: ...

class UnpublishRequest(_message.Message):
    __slots__ = ("holder", "hashes")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    holder: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, holder: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UnpublishResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DirectoryEntry(_message.Message):
    __slots__ = ("holder", "num_blocks", "address")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    holder: str
    num_blocks: int
    address: str
    def __init__(self, holder: _Optional[str] = ..., num_blocks: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[DirectoryEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[DirectoryEntry, _Mapping]]] = ...) -> None: ...
