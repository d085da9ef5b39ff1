"""StackConfig: stack.yaml plus overrides, validated with one-line errors."""

from __future__ import annotations

import pytest
import yaml

from plugserve.cli import main
from plugserve.config import StackConfig, load_config
from plugserve.plugins import PluginError


def test_defaults_resolve_to_the_bundled_stack():
    config = load_config()
    assert config.model == "smollm2-135m-instruct"
    assert config.stack.scheduler == "fcfs"
    assert config.engine.kv_cache_memory == 1 << 30


def test_yaml_file_and_overrides_merge(tmp_path):
    path = tmp_path / "stack.yaml"
    path.write_text(
        "stack: {scheduler: priority}\nengine: {max_num_seqs: 4, kv_cache_memory: 64MiB}\n"
    )
    config = load_config(path, {"max_num_batched_tokens": 64, "engine.block_size": 8})
    assert config.stack.scheduler == "priority"
    assert config.engine.max_num_seqs == 4
    assert config.engine.kv_cache_memory == 64 * 2**20
    assert config.engine.max_num_batched_tokens == 64
    assert config.engine.block_size == 8


def test_a_stackconfig_can_be_the_base():
    base = load_config(None, {"scheduler": "priority"})
    assert load_config(base, {"max_num_seqs": 2}).stack.scheduler == "priority"


def test_unknown_plugin_name_in_yaml_lists_the_available_ones(tmp_path):
    path = tmp_path / "stack.yaml"
    path.write_text("stack: {scheduler: lottery}\n")
    with pytest.raises(
        PluginError, match=r"unknown scheduler 'lottery'; available: fcfs, priority(, [a-z_]+)*$"
    ):
        load_config(path)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("engine: {max_num_seqz: 4}\n", "engine.max_num_seqz: unknown setting"),
        ("engine: {max_num_seqs: 0}\n", "engine.max_num_seqs"),
        ("engine: {dtype: float8}\n", "engine.dtype"),
        ("- a list\n", "must be a mapping"),
        ("engine: {max_num_seqs: 8, max_num_batched_tokens: 4}\n", "at least max_num_seqs"),
    ],
)
def test_invalid_settings_fail_with_one_line(tmp_path, yaml_text, message):
    path = tmp_path / "stack.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=message) as err:
        load_config(path)
    assert "\n" not in str(err.value)


def test_unknown_and_ambiguous_overrides():
    with pytest.raises(ValueError, match="unknown setting 'speed'"):
        load_config(None, {"speed": 11})


def test_options_for_a_plugin_not_in_the_stack_are_rejected():
    with pytest.raises(PluginError, match=r"plugins\.priority"):
        load_config(None, {"plugins.priority": {"x": 1}})


def test_model_passes_are_a_list_of_registered_names_once_each():
    """Unset: the bundled automatic passes (their options allowed); []: none; a named pass
    must be registered; none twice."""
    assert load_config().stack.model_passes is None
    assert load_config(None, {"plugins.fused_cpu_decoder": {}}).plugins  # automatic
    assert load_config(None, {"stack.model_passes": []}).stack.model_passes == []
    assert load_config(None, {"model_passes": ["fused_cpu_decoder"]}).stack.model_passes == [
        "fused_cpu_decoder"
    ]
    with pytest.raises(PluginError, match=r"unknown model_pass 'spans'; available: "):
        load_config(None, {"model_passes": ["spans"]})
    with pytest.raises(ValueError, match="lists fused_cpu_decoder more than once"):
        load_config(None, {"model_passes": ["fused_cpu_decoder", "fused_cpu_decoder"]})
    with pytest.raises(PluginError, match=r"plugins\.fused_cpu_decoder"):
        load_config(None, {"model_passes": [], "plugins.fused_cpu_decoder": {}})


def test_cli_prints_the_resolved_config(capsys, tmp_path):
    assert main(["config", "--stack.scheduler", "priority", "--max-num-seqs", "8"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert StackConfig.model_validate(printed).engine.max_num_seqs == 8
    assert printed["stack"]["scheduler"] == "priority"


def test_cli_error_is_one_line(capsys):
    assert main(["config", "--scheduler", "lottery"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "available: fcfs, priority" in err
