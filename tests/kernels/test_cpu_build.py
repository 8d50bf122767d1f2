"""The CPU kernels' builds (`cpu_build`): one variant per instruction set, every variant this
CPU runs builds and is picked by what the CPU has or `HALFMOON_CPU_ISA`; the cache key holds
the compiler's version; a cache another user could write is refused; `report()` says which
path each kernel took."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from isa_testkit import RUNNABLE, require_built, variant

from halfmoon.kernels import cpu_attention, cpu_build, cpu_elementwise, cpu_gemm, cpu_prefill

KERNELS = (cpu_attention.LIBRARY, cpu_elementwise.LIBRARY, cpu_gemm.LIBRARY, cpu_prefill.LIBRARY)
TINY = 'extern "C" int answer() { return 42; }\n'


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_kernel_builds_for_every_variant_this_cpu_runs(name):
    with cpu_build.use(name):
        for library in KERNELS:
            require_built(library)  # fails, not skips, where g++ is present
            assert library.get() is not None


def test_the_cpu_runs_its_best_variant_unless_told_a_lower_one(monkeypatch):
    monkeypatch.delenv(cpu_build.ISA_ENV, raising=False)
    assert cpu_build._from_environment() == cpu_build.runnable()[0]
    monkeypatch.setenv(cpu_build.ISA_ENV, "generic")
    assert cpu_build._from_environment().name == "generic"


def test_a_variant_unknown_or_beyond_this_cpu_is_refused_with_what_it_runs(monkeypatch):
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="expected one of amx, avx512bf16"):
        cpu_build._from_environment()
    beyond = [isa.name for isa in cpu_build.ISAS if isa.name not in RUNNABLE]
    if not beyond:
        pytest.skip("this CPU runs every variant")
    monkeypatch.setenv(cpu_build.ISA_ENV, beyond[0])
    with pytest.raises(ValueError, match=f"cannot run it \\(it runs {', '.join(RUNNABLE)}\\)"):
        cpu_build._from_environment()


def test_variants_nest_as_the_instruction_sets_do():
    names = [isa.name for isa in cpu_build.ISAS]
    for better, worse in zip(cpu_build.ISAS, cpu_build.ISAS[1:], strict=False):
        assert worse.needs <= better.needs, (better.name, worse.name)
    assert names[-1] == "generic" and not cpu_build.ISAS[-1].needs


def test_a_cpu_other_than_x86_runs_the_generic_variant_only(monkeypatch):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "aarch64")
    assert [isa.name for isa in cpu_build.runnable()] == ["generic"]
    assert not any("-m" in flag and "march" in flag for flag in cpu_build.BY_NAME["generic"].flags)


@pytest.fixture
def tiny_source(tmp_path, monkeypatch):
    if not cpu_build.compiler_version():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "src" / "cpu_tiny.cpp"
    source.parent.mkdir()
    source.write_text(TINY)
    return source


def test_the_cache_key_holds_the_compiler_version(tiny_source, monkeypatch):
    generic = cpu_build.BY_NAME["generic"]
    first, error = cpu_build._build(tiny_source, generic)
    assert error is None and first.name.startswith("cpu_tiny-generic-")
    assert cpu_build._build(tiny_source, generic)[0] == first  # cached
    monkeypatch.setattr(cpu_build, "compiler_version", lambda: "g++ (other) 99.1")
    second, _ = cpu_build._build(tiny_source, generic)
    assert second != first and second.is_file()


def test_a_cache_others_may_write_is_refused(tiny_source):
    generic = cpu_build.BY_NAME["generic"]
    directory = cpu_build.cache_dir()
    directory.mkdir(parents=True)
    os.chmod(directory, 0o777)
    path, error = cpu_build._build(tiny_source, generic)
    assert path is None and "writable by others" in error


def test_a_cached_library_others_may_write_is_built_again(tiny_source):
    generic = cpu_build.BY_NAME["generic"]
    path, _ = cpu_build._build(tiny_source, generic)
    os.chmod(path, 0o666)  # as if someone else could have replaced it
    again, error = cpu_build._build(tiny_source, generic)
    assert error is None and again == path
    assert not again.stat().st_mode & 0o022


def test_a_build_without_a_compiler_says_so(tiny_source, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    path, error = cpu_build._build(tiny_source, cpu_build.BY_NAME["generic"])
    assert path is None and error == "no C++ compiler (g++ or $CXX)"


def test_a_failing_build_warns_and_says_why(tiny_source):
    tiny_source.write_text("this is not C++\n")
    with pytest.warns(UserWarning, match="building cpu_tiny.cpp for generic failed"):
        path, error = cpu_build._build(tiny_source, cpu_build.BY_NAME["generic"])
    assert path is None and "the generic build failed" in error


def test_the_report_names_the_variant_the_compiler_and_each_kernel():
    with variant(RUNNABLE[-1], *KERNELS):
        report = cpu_build.report()
    assert report["isa"] == "generic"
    assert report["compiler"] == cpu_build.compiler_version()
    expected = {"cpu_attention", "cpu_elementwise", "cpu_gemm", "cpu_prefill"}
    assert expected <= set(report["kernels"])
    assert all(report["kernels"][name] == "built" for name in expected)


CROSS = shutil.which("aarch64-linux-gnu-g++")


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("library", KERNELS, ids=lambda library: library.source.stem)
def test_every_kernel_compiles_for_aarch64_as_the_generic_variant(library, tmp_path):
    """What an aarch64 host builds: the generic variant's flags, no x86 header in the way."""
    flags = [f for f in cpu_build.COMMON_FLAGS if f not in ("-shared",)]
    command = [CROSS, *flags, *cpu_build.BY_NAME["generic"].flags, "-c", str(library.source)]
    result = subprocess.run([*command, "-o", str(tmp_path / "kernel.o")], capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
