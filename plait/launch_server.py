"""`python -m plait.launch_server [flags]`: serve the runtime over HTTP (SGLang's native API and
the OpenAI API). Flags are generated from ServerArgs; `--config FILE.yaml` supplies defaults."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from plait.runtime.server_args import ServerArgs

    try:
        args = ServerArgs.parse(argv, prog="plait serve")
        resolved = args.resolved()
    except ValueError as e:
        print(f"plait: {e}", file=sys.stderr)
        return 2
    starting = None
    if resolved.node_rank == 0:  # the runtime starts loading while this process imports its HTTP stack
        from plait.runtime.launch.launcher import start_runtime

        starting = start_runtime(resolved)
    try:
        from plait.runtime.entrypoints.http_server import launch_server
    except BaseException:
        if starting is not None:
            starting.abort()
        raise
    return launch_server(args, starting)


if __name__ == "__main__":
    sys.exit(main())
