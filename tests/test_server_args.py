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


def test_a_model_path_that_cannot_load_is_refused_before_start(tmp_path, monkeypatch):
    """A missing path, a file that is not GGUF, an empty folder, a packaged model not fetched: a ValueError naming the
    field and what to do, from the flags alone (`plait serve` prints it and exits 2, no process started)."""
    monkeypatch.setenv("PLAIT_MODEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="model_path .*no such file or folder"):
        ServerArgs(model_path=str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="looks like a Hugging Face hub id: plait loads local files only"):
        ServerArgs(model_path="Qwen/Qwen2.5-0.5B-Instruct")
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="model_path .*is not a GGUF file"):
        ServerArgs(model_path=str(text))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        ServerArgs(model_path=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="plait models fetch gemma-3-270m"):
        ServerArgs.parse(["--model-path", "gemma-3-270m"])
    renamed = tmp_path / "model.bin"  # a GGUF under another name loads, as in llama.cpp
    renamed.write_bytes(open(default_model_path(), "rb").read())
    assert ServerArgs(model_path=str(renamed)).resolved().model_path == str(renamed)


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


@pytest.mark.parametrize("kw,match", [
    (dict(tp_size=0), "tp_size"), (dict(dp_size=0), "dp_size"), (dict(tp_size=2, ep_size=4), "ep_size"),
    (dict(nnodes=2, tp_size=2), "dist_init_addr"), (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank"),
    (dict(nnodes=2, tp_size=3, dist_init_addr="h:1"), "multiple of nnodes"), (dict(dist_init_addr="nohost"), "dist_init_addr"),
(dict(dist_timeout=0), "dist_timeout"),
])
def test_bad_parallel_settings_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kw)


def test_parallel_settings_resolve_ranks_and_threads():
    ep = ServerArgs(ep_size=2).resolved()
    assert ep.tp_size == 2 and ep.ep_size == 2  # expert parallelism alone splits attention over the same ranks
    assert ep.num_threads >= 1  # the machine's cores shared between the local ranks
    assert ServerArgs(tp_size=2, num_threads=3).resolved().num_threads == 3  # an explicit count wins
    assert ServerArgs().resolved().num_threads == 0  # one rank: torch's default
