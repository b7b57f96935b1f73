"""`python -m plait.launch_server [flags]`: serve the runtime over HTTP (SGLang's native API and
the OpenAI API). Flags are generated from ServerArgs; `--config FILE.yaml` supplies defaults."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from plait.runtime.entrypoints.http_server import launch_server
    from plait.runtime.server_args import ServerArgs

    try:
        args = ServerArgs.parse(argv, prog="plait serve")
    except ValueError as e:
        print(f"plait: {e}", file=sys.stderr)
        return 2
    return launch_server(args)


if __name__ == "__main__":
    sys.exit(main())
