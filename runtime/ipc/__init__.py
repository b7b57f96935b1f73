"""The wire between the runtime's processes: typed messages (msgspec, never pickle), ZMQ channels,
and the limits a request is checked against on both sides."""
