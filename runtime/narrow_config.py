"""Each part of the runtime is configured by the fields it reads of the server's configuration, gathered in a
frozen dataclass of its own that names them as ServerArgs does; `of` takes them from a ServerArgs, so a part
never imports the whole configuration."""

from __future__ import annotations

import dataclasses


class NarrowConfig:
    @classmethod
    def of(cls, args):
        """This config's fields taken from `args` (a ServerArgs, or any object naming them the same)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
