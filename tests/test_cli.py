"""The `plait` command line a newcomer meets first: help, version, a clear word for a wrong command."""

from __future__ import annotations

from plait.cli import main


def test_help_lists_the_commands_and_exits_0(capsys):
    for flag in ("--help", "-h"):
        assert main([flag]) == 0
        out = capsys.readouterr().out
        assert all(name in out for name in ("serve", "generate", "chat", "bench", "models", "train-eagle", "--version"))


def test_version_and_a_wrong_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("plait ")
    assert main(["srve"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'srve'" in err and "serve" in err
    assert main([]) == 2 and "commands:" in capsys.readouterr().err


def test_every_flag_shows_its_default():
    import argparse

    from plait.runtime.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="plait serve")
    ServerArgs.add_cli_args(parser)
    text = parser.format_help()
    assert "(default: 30000)" in text and "(default: 32768)" in text  # --port, --speculative-draft-vocab-size
