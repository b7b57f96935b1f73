import argparse

import pytest

from plait.runtime.server_args import ServerArgs, default_model_path


def test_cli_is_generated_from_the_dataclass():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--page-size", "4", "--disable-radix-cache", "--schedule-policy", "fcfs",
                            "--max-total-tokens", "1000", "--mem-fraction-static", "0.3"])
    args = ServerArgs.from_cli_args(ns)
    assert args.page_size == 4 and args.disable_radix_cache and args.schedule_policy == "fcfs"
    assert args.max_total_tokens == 1000 and args.mem_fraction_static == 0.3
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule-policy", "random"])


@pytest.mark.parametrize("field,value", [("page_size", 0), ("mem_fraction_static", 1.5), ("schedule_policy", "x"),
                                         ("chunked_prefill_size", 0), ("dtype", "int3"), ("num_threads", -1)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ServerArgs(**{field: value})


def test_resolved_fills_auto_values_once():
    args = ServerArgs().resolved()
    assert args.model_path == default_model_path()
    assert args.device == "cpu" and args.dtype in ("float32", "bfloat16")
    assert ServerArgs().dtype == "auto"  # the original is untouched (frozen)


def test_config_file_supplies_defaults_and_flags_win(tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("port: 8123\nmax-running-requests: 7\nenable_metrics: true\napi_key: k\n")
    args = ServerArgs.parse(["--config", str(cfg), "--port", "9000"])
    assert args.port == 9000 and args.max_running_requests == 7 and args.enable_metrics and args.api_key == "k"
    assert args.host == "127.0.0.1"  # SGLang's defaults elsewhere
    assert ServerArgs.parse([]).port == 30000
    bad = tmp_path / "bad.yaml"
    bad.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="prot"):
        ServerArgs.parse(["--config", str(bad)])
