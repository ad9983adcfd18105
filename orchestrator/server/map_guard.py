"""Map fields counted before a request is parsed.

protobuf's upb runtime fills a map field's hash table at a cost that, at some sizes and keys, grows far faster than
the entries: on this machine an ExecRequest of 600,000 `env` entries (7 MiB) took 7 s to parse, one of 2.6 million
(33 MiB) 160 s, all of it on the event loop, before any handler could refuse it. On the wire a map field is a
repeated message of key and value, so a "shape" of the request that declares each map as such a repeated field
parses in linear time, C speed: its entries are counted there, and a request over the limits is refused before the
real parse builds any table.
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

MAX_MAP_ENTRIES = 65_536  # in one map field: its parse stays linear (0.03 s at 100,000 entries here)
MAX_ENTRIES = 1_000_000  # in every map field of one request together (100,000 tasks' files, say)
MIN_ENTRY_BYTES = 2  # a map entry on the wire at least: its tag and a length of 0
MAX_REPEATED = 100_000  # messages of one repeated field on the way to a map (as a spec's tasks)

_FILE = "envfleet_map_shapes.proto"


class _Shapes:
    """Shape message classes, one per request type that holds a map (at any depth), in a pool of their own."""

    def __init__(self) -> None:
        self._file = descriptor_pb2.FileDescriptorProto(name=_FILE, package="envfleet.shapes", syntax="proto3")
        entry = self._file.message_type.add(name="Entry")  # what a map's entry is on the wire: key 1, value 2
        entry.field.add(name="key", number=1, type=FieldDescriptor.TYPE_BYTES, label=FieldDescriptor.LABEL_OPTIONAL)
        entry.field.add(name="value", number=2, type=FieldDescriptor.TYPE_BYTES, label=FieldDescriptor.LABEL_OPTIONAL)
        self._names: dict[str, str | None] = {}  # full name of a real type -> its shape's name (None: no map in it)

    def add(self, real: Descriptor) -> str | None:
        """The name of `real`'s shape: its map fields as repeated entries, its message fields that lead to a map as
        those fields' shapes, nothing else (unknown to the shape, parsed past); None when no map is in it."""
        if real.full_name in self._names:
            return self._names[real.full_name]
        self._names[real.full_name] = None  # while it is being made: a type that holds itself leads to no new map
        fields: list[tuple[str, int, int, str]] = []
        for f in real.fields:
            if f.message_type is None:
                continue
            if f.message_type.GetOptions().map_entry:
                fields.append((f.name, f.number, FieldDescriptor.LABEL_REPEATED, "Entry"))
            elif (inner := self.add(f.message_type)) is not None:
                label = FieldDescriptor.LABEL_REPEATED if f.is_repeated else FieldDescriptor.LABEL_OPTIONAL
                fields.append((f.name, f.number, label, inner))
        if not fields:
            return None
        name = real.full_name.replace(".", "_")
        shape = self._file.message_type.add(name=name)
        for field_name, number, label, type_name in fields:
            shape.field.add(
                name=field_name,
                number=number,
                label=label,
                type=FieldDescriptor.TYPE_MESSAGE,
                type_name=f".envfleet.shapes.{type_name}",
            )
        self._names[real.full_name] = name
        return name

    def classes(self) -> dict[str, type[Message]]:
        pool = descriptor_pool.DescriptorPool()
        pool.Add(self._file)
        built = {}
        for real, name in self._names.items():
            if name is not None:
                built[real] = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"envfleet.shapes.{name}"))
        return built


def map_counter(request_types: list[Descriptor]) -> Callable[[Descriptor, bytes], str | None]:
    """A check for requests of these types: what is over a limit, in words, or None; a type with no map is not
    looked at. A request that does not parse as its shape is left to the real parse, which says why."""
    shapes = _Shapes()
    for t in request_types:
        shapes.add(t)
    classes = shapes.classes()

    def check(real: Descriptor, data: bytes) -> str | None:
        cls = classes.get(real.full_name)
        if cls is None or len(data) <= MAX_MAP_ENTRIES * MIN_ENTRY_BYTES:
            return None  # too small to hold a map over the limit (an Exec's usual few hundred bytes: no second parse)
        try:
            shape = cls.FromString(data)
        except DecodeError:
            return None
        return _over(shape, [0])

    return check


def _over(shape: Message, total: list[int], where: str = "") -> str | None:
    for field, value in shape.ListFields():
        path = f"{where}{field.name}"
        if field.message_type is not None and field.message_type.name == "Entry":
            total[0] += len(value)
            if len(value) > MAX_MAP_ENTRIES:
                return f"{path} has {len(value)} entries; the limit is {MAX_MAP_ENTRIES}"
            if total[0] > MAX_ENTRIES:
                return f"the request's maps hold over {MAX_ENTRIES} entries together (at {path})"
        elif field.is_repeated:
            if len(value) > MAX_REPEATED:
                return f"{path} has {len(value)} items; the limit is {MAX_REPEATED}"
            for i, item in enumerate(value):
                if (over := _over(item, total, f"{path}[{i}].")) is not None:
                    return over
        elif (over := _over(value, total, f"{path}.")) is not None:
            return over
    return None
