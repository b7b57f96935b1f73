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
