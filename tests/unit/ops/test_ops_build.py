"""The build helper's cache key: a library is rebuilt when a header it includes changes,
and only then. Checked on copies of the real sources, so no compiler is needed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from plugserve import ops
from plugserve.ops import build

PLUGINS = Path(__file__).parents[3] / "plugins"
ATTENTION_SOURCE = PLUGINS / "kernels" / "cpu_paged_attention.cpp"
# The bf16 CPU fast path's sources (a plugin's, with headers of its own beside them).
CPU_BF16 = PLUGINS / "cpu_bf16"


def names(headers: list[Path]) -> set[str]:
    return {header.name for header in headers}


def test_the_attention_plugin_includes_only_public_headers() -> None:
    headers = build.included_headers(ATTENTION_SOURCE, ops.include_dir())
    assert names(headers) == {"cpu_bf16.h", "cpu_vec_math.h", "layer_attention.h", "row_pool.h"}
    assert all(header.parent == ops.include_dir().resolve() for header in headers)


def test_core_holds_only_its_own_library_and_the_public_headers() -> None:
    ops_dir = Path(ops.__file__).parent
    assert sorted(p.name for p in ops_dir.glob("*.cpp")) == ["cpu_ops.cpp"]
    assert list(ops_dir.glob("*.h")) == []
    headers = build.included_headers(ops.OPS_SOURCE, ops.include_dir())
    assert names(headers) == {"cpu_ops.h", "row_pool.h", "cpu_bf16.h", "cpu_vec_math.h"}


def test_headers_count_through_the_headers_that_include_them() -> None:
    """The plugin's cpu_decoder.cpp names cpu_gemm.h beside it and the public cpu_ops.h;
    they bring cpu_gemm_amx.h beside them, and row_pool.h, cpu_bf16.h, cpu_vec_math.h and
    the C++ call conventions (layer_attention.h, layer_linear.h) from the public folder."""
    headers = build.included_headers(CPU_BF16 / "cpu_decoder.cpp", ops.include_dir())
    assert names(headers) == {
        "cpu_gemm.h",
        "cpu_gemm_amx.h",
        "cpu_ops.h",
        "layer_attention.h",
        "layer_linear.h",
        "row_pool.h",
        "cpu_bf16.h",
        "cpu_vec_math.h",
    }


@pytest.fixture
def copied_sources(tmp_path: Path) -> Path:
    """plugserve.ops' sources and headers, the attention plugin and the bf16 CPU plugin's
    sources and headers beside them."""
    ops_dir = Path(ops.__file__).parent
    no_python = shutil.ignore_patterns("*.py", "__pycache__")
    shutil.copytree(ops_dir, tmp_path / "ops", ignore=no_python)
    shutil.copytree(CPU_BF16, tmp_path / "cpu_bf16", ignore=no_python)
    (tmp_path / "plugin").mkdir()
    shutil.copy(ATTENTION_SOURCE, tmp_path / "plugin")
    return tmp_path


def append_comment(header: Path) -> None:
    header.write_text(header.read_text() + "// edited\n")


def test_editing_a_header_rebuilds_only_the_libraries_that_include_it(
    copied_sources: Path,
) -> None:
    include = copied_sources / "ops" / "include"
    plugin = copied_sources / "plugin" / ATTENTION_SOURCE.name
    gemm, decoder = (
        copied_sources / "cpu_bf16" / name for name in ("cpu_gemm.cpp", "cpu_decoder.cpp")
    )

    def keys() -> dict[str, str]:
        return {source.name: build.cache_key(source, include) for source in (plugin, gemm, decoder)}

    before = keys()
    append_comment(copied_sources / "cpu_bf16" / "cpu_gemm.h")
    after_gemm_header = keys()
    assert after_gemm_header[plugin.name] == before[plugin.name]  # not included
    assert after_gemm_header[gemm.name] != before[gemm.name]
    assert after_gemm_header[decoder.name] != before[decoder.name]

    append_comment(include / "row_pool.h")  # the plugin's, and cpu_gemm.h's
    after_pool_header = keys()
    assert all(after_pool_header[name] != after_gemm_header[name] for name in before)
