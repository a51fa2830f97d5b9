"""`python -m hisparse_cupy`: info, check, demo and bench, with and without a GPU."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hisparse_cupy

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hisparse_cupy", *args], capture_output=True,
                          text=True, timeout=timeout)


def _have_gpu() -> bool:
    from conftest import _device_count

    return _device_count()[0] > 0


def test_info_reports_versions_and_the_device_or_why_not():
    p = cli("info")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("hisparse_cupy 0.1.0")
    from hisparse_cupy.host import _shm as host_shm

    assert f"\nshared pools in {host_shm.directory()} (tmpfs at " in p.stdout
    if _have_gpu():
        assert "PDL" in p.stdout and "zero-copy gather of random rows" in p.stdout
    else:
        assert "no NVIDIA driver found" in p.stdout or "CUDA device" in p.stdout


def test_info_json_is_one_object_with_the_versions_and_the_device_or_why_not():
    p = cli("info", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)  # the whole of stdout: one object
    from hisparse_cupy import __version__
    from hisparse_cupy.host import _shm as host_shm

    assert doc["hisparse_cupy"] == __version__ and doc["python"] == platform.python_version()
    assert doc["numpy"] == np.__version__
    assert set(doc["distributions"]) == {"cupy-cuda12x", "cupy-cuda13x", "cuda-bindings"}
    for dist, v in doc["distributions"].items():
        assert v == (md.version(dist) if list(md.distributions(name=dist)) else None), dist
    assert doc["shm"].startswith(f"shared pools in {host_shm.directory()} (tmpfs at ")
    if doc["distributions"]["cuda-bindings"]:  # a CUDA extra: its NVRTC wheel too
        assert doc["nvrtc"].split(".")[0] in ("12", "13"), doc["nvrtc"]
    if not _have_gpu():
        assert doc["gpu"] is None and doc["why"] == _why() and doc["host_pool_setup"] is None
        return
    assert doc["why"] is None and doc["gpu"]["driver"] and doc["gpu"]["cupy"]
    devices = doc["gpu"]["devices"]
    assert [d["index"] for d in devices] == list(range(len(devices)))
    for d in devices:
        assert {"name", "compute_capability", "sms", "memory_bytes", "pdl"} <= set(d)
        assert isinstance(d["pdl"], bool) and d["memory_bytes"] > 0
    c = devices[0]["ceilings"]  # --device 0, --row-bytes 656: measured
    assert c["row_bytes"] == 656 and c["memcpy_gb_per_s"] > 0 and c["gather_gb_per_s"] > 0
    assert all("ceilings" not in d for d in devices[1:]) and doc["host_pool_setup"]["gb"] == 2.0


@pytest.mark.slow
def test_check_without_a_gpu_compiles_and_self_checks_and_bench_says_it_needs_one(tmp_path):
    if _have_gpu():
        pytest.skip("a GPU is present: test_check_on_gpu runs the check")
    # without a device: the compile check and the oracle's self-check; --json: one object on
    # stdout, the text that check prints without it on stderr
    p = cli("check", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is True and doc["gpu"] is False and doc["why"] == _why()
    assert "error" not in doc and 0 < doc["seconds"] < 600
    cu = sorted([*(x.name for x in (Path(hisparse_cupy.__file__).parent / "cu").glob("*.cu")),
                 "demo/model.cu"])  # the package's kernel sources, and the demo model's
    assert doc["kernel_sources"] == cu and doc["archs"] == ["sm_80", "sm_90"]
    compiled, oracle = doc["checked"]
    assert compiled.startswith(f"compile: every kernel instance of {len(cu)} sources x sm_80, ")
    assert oracle.startswith("oracle: the NumPy decode loop's swaps and attention outputs")
    assert doc["not_checked"] and doc["not_checked"][0].startswith("the kernels' results")
    lines = p.stderr.splitlines()
    assert lines[0].startswith("no CUDA device (") and "checking what runs without one" in lines[0]
    assert f"compile check: {len(cu)} kernel sources" in p.stderr and "sm_80, sm_90" in p.stderr
    assert "self-check passed" in p.stderr and "passed their self-check" in p.stderr
    assert lines[-1].startswith("not checked without a device: the kernels' results")
    out = tmp_path / "bench_out"
    p = cli("bench", "--out", str(out))
    assert p.returncode == 3 and p.stdout == "", p.stdout  # 3: this machine lacks a GPU
    assert p.stderr.splitlines() == [f"bench needs a CUDA device: {_why()}"]
    assert not out.exists()  # nothing written


def _why() -> str:
    from hisparse_cupy._device import why_no_gpu

    return why_no_gpu()


def test_the_library_names_the_missing_device():
    """Without a usable device the first CUDA object says why (no driver, no device, a driver
    too old), not the CUDA runtime's error."""
    if _have_gpu():
        pytest.skip("a GPU is present")
    from hisparse_cupy import GPUUnavailableError, HostKVPool, HotBufferCache

    with pytest.raises(GPUUnavailableError, match="needs a CUDA device: " + _why()[:20]):
        HotBufferCache(n_layers=2, max_requests=1, max_len=64, row_bytes=16, hot_size=16,
                       top_k=8)
    with pytest.raises(GPUUnavailableError):
        HostKVPool(1, 8, 16)
    with pytest.raises(ValueError, match="top_k must be <= 16"):  # arguments checked first
        HotBufferCache(n_layers=2, max_requests=1, max_len=64, row_bytes=16, hot_size=16,
                       top_k=32)


class _FakeCuda:
    """libcuda's three entry points the device check calls."""

    def __init__(self, init_rc=0, count=1, version=12040):
        self.init_rc, self.count, self.version = init_rc, count, version

    def cuInit(self, flags):
        return self.init_rc

    def cuDeviceGetCount(self, ref):
        ref._obj.value = self.count
        return 0

    def cuDriverGetVersion(self, ref):
        ref._obj.value = self.version
        return 0


@pytest.mark.parametrize("fake, runtime, why", [
    (None, 12090, "no NVIDIA driver found"),
    (_FakeCuda(init_rc=100), 12090, "no CUDA device: the NVIDIA driver is loaded but sees no"),
    (_FakeCuda(count=0), 12090, "no CUDA device"),
    (_FakeCuda(init_rc=3), 12090, "failed to initialise \\(cuInit error 3\\)"),
    (_FakeCuda(version=12020), 13000, "supports CUDA 12.2, older than CuPy's CUDA runtime 13.0: "
                                      "install the extra of the driver's CUDA "
                                      "\\(hisparse_cupy\\[cuda12\\]\\)"),
    (_FakeCuda(init_rc=34), 12090, "only the CUDA toolkit's stub"),
    (_FakeCuda(version=11080), 12090, "supports CUDA 11.8.*upgrade the driver \\(CUDA 12 or"),
    (_FakeCuda(version=12020), 12090, None),  # minor versions: compatible
])
def test_device_check_names_each_case(monkeypatch, fake, runtime, why):
    import re

    pytest.importorskip("cupy")
    import cupy

    from hisparse_cupy import _device

    monkeypatch.setattr(_device, "_libcuda", lambda: fake)
    monkeypatch.setattr(cupy.cuda.runtime, "runtimeGetVersion", lambda: runtime)
    _device.why_no_gpu.cache_clear()
    try:
        got = _device.why_no_gpu()
    finally:
        _device.why_no_gpu.cache_clear()
    if why is None:
        assert got is None
    else:
        assert got is not None and re.search(why, got), got


@pytest.mark.gpu
def test_check_on_gpu():
    p = cli("check", "--json")  # the text on stderr
    assert p.returncode == 0, p.stdout + p.stderr
    assert "every kernel agrees with the oracle" in p.stderr
    assert p.stderr.count("  ok    ") == 2
    doc = json.loads(p.stdout)
    assert doc["ok"] is True and doc["gpu"] is True and doc["not_checked"] == []
    assert doc["checked"] == ["single- and multi-step swaps vs the oracle",
                              "newest-row backup and plan replay"]
    assert doc["device"].startswith("self-check on device ") and "error" not in doc


SMALL_DEMO = ("--layers", "4", "--batch", "2", "--context", "2048", "--hot", "1024",
              "--top-k", "256", "--steps", "4", "--warmup", "2")


def test_demo_and_bench_arguments():
    p = cli("demo", *SMALL_DEMO)
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("running the NumPy reference backend" in p.stdout) != _have_gpu()
    assert "self-check passed" in p.stdout
    p = cli("demo", "--context", "100")
    assert p.returncode != 0 and "--context (100) must exceed --hot + --top-k" in p.stderr
    p = cli("bench", "nope")
    assert p.returncode == 2 and p.stderr.startswith("bench: no benchmark named nope; have: ")
    p = cli("info", "--bogus")
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr


def test_version_and_bad_info_arguments_are_refused_by_name():
    from hisparse_cupy import __version__

    p = cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"hisparse_cupy {__version__}"
    for args, says in [(("--row-bytes", "-5"), "--row-bytes must be >= 16, got -5"),
                       (("--row-bytes", "20"), "--row-bytes must be a multiple of 16"),
                       (("--row-bytes", "x"), "--row-bytes must be an int, got 'x'"),
                       (("--device", "-1"), "--device must be >= 0, got -1")]:
        p = cli("info", *args, timeout=60)
        assert p.returncode == 2 and says in p.stderr, (args, p.stderr)


def test_demo_help_states_each_default_once():
    p = cli("demo", "--help", timeout=120)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "(default: 32)" in text  # --batch
    for doubled in ("(default: False)", "(default: None)", "(default) (default"):
        assert doubled not in text, doubled


def test_skip_lines_are_folded_by_reason(tmp_path):
    """``-rs`` with the suite's plugin: three skips of one reason at three places and one of
    another print two lines, with their counts."""
    (tmp_path / "test_gen.py").write_text(
        "import pytest\n\n"
        "def test_a():\n    pytest.skip('no CUDA device (here)')\n\n"
        "@pytest.mark.skip(reason='no CUDA device (here)')\ndef test_b():\n    pass\n\n"
        "def test_c():\n    pytest.skip('no CUDA device (here)')\n\n"
        "def test_d():\n    pytest.skip('needs two GPUs')\n\n"
        "def test_e():\n    assert True\n")
    import os

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "_skipfold",
                        "-p", "no:cacheprovider", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, env=env, cwd=tmp_path)
    lines = [x for x in p.stdout.splitlines() if x.startswith("SKIPPED")]
    assert p.returncode == 0 and len(lines) == 2, p.stdout
    assert any("[3]" in x and x.endswith("no CUDA device (here)") for x in lines), lines
    assert any("[1]" in x and x.endswith("needs two GPUs") for x in lines), lines


# ------------------------------------------------------------- the first hour (issue 62)
def test_check_prints_a_line_as_each_kernel_source_compiles(monkeypatch, capfd):
    """``check`` without a GPU names what it compiles as it goes (on stderr with --json), so
    its half minute of NVRTC never looks hung; NVRTC and the oracle's run are stubbed here."""
    if _have_gpu():
        pytest.skip("a GPU is present: check runs the device self-check")
    from hisparse_cupy import _cli
    from hisparse_cupy._kernels import build
    from hisparse_cupy.demo import _cpu

    monkeypatch.setattr(build, "_compiled", lambda key, file, names, arch: 1000)
    monkeypatch.setattr(_cpu, "run", lambda cfg, admit=None: {"self_check": "passed"})
    assert _cli.main(["check", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["ok"] is True  # stdout: the one object
    n = 2 * len(build.INSTANCES)
    lines = err.splitlines()
    assert lines[1].startswith("compiling every kernel instance through NVRTC for sm_80 and ")
    steps = [x for x in lines if x.startswith("  [")]
    assert [x.split("]")[0] for x in steps] == [f"  [{i}/{n}" for i in range(1, n + 1)]
    assert {x.split()[1] for x in steps} == set(build.INSTANCES)
    assert lines.index(steps[-1]) < next(i for i, x in enumerate(lines)
                                         if x.startswith("compile check: "))


def test_output_paths_are_refused_by_name_before_any_work(tmp_path):
    (tmp_path / "file").write_text("")
    for args, says in [
            (("demo", "--json", str(tmp_path / "no/r.json")),
             f"demo: --json {tmp_path}/no/r.json: the folder {tmp_path}/no does not exist"),
            (("demo", "--png", str(tmp_path)), f"demo: --png {tmp_path}: is a folder; give a "),
            (("demo", "--json", str(tmp_path / "file/r.json")),
             f"the folder {tmp_path}/file is not a folder"),
            (("bench", "--out", str(tmp_path / "file/sub")),
             f"bench: --out {tmp_path}/file/sub: {tmp_path}/file is a file, not a folder")]:
        p = cli(*args, timeout=60)
        assert p.returncode == 2 and p.stdout == "", (args, p.stdout)  # nothing ran
        assert p.stderr.splitlines() == [p.stderr.strip()] and says in p.stderr, p.stderr
    from hisparse_cupy._cli.usage import UsageError, output_dir, output_file

    output_file("demo", "--json", str(tmp_path / "r.json"))  # writable: no error
    output_dir("bench", "--out", str(tmp_path / "a/b/c"))  # made on demand
    with pytest.raises(UsageError, match="--out .*/file: is a file, not a folder"):
        output_dir("bench", "--out", str(tmp_path / "file"))


@pytest.mark.parametrize("args, status", [
    (("info",), 141), (("demo", "--steps", "1", "--layers", "4"), 141),
    (("bench", "--help"), 0), (("demo", "--help-all"), 0)])  # (argparse drops its help itself)
def test_a_closed_stdout_ends_quietly_with_status_141(args, status):
    """``... | head``: the reader has gone before the first line; no traceback, status 141."""
    p = subprocess.Popen([sys.executable, "-m", "hisparse_cupy", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the child writes anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == status and err == "", err


def test_an_unknown_option_or_no_command_says_so_and_lists_the_commands():
    for args, says in [(("--bogus",), "error: unknown option --bogus; commands: info, check, "
                                      "demo, bench"),
                       ((), "error: no command given; commands: info, check, demo, bench"),
                       (("bogus",), "invalid choice: 'bogus'"),
                       (("info", "--bogus"), "unrecognized arguments: --bogus")]:
        p = cli(*args, timeout=60)
        assert p.returncode == 2 and says in p.stderr, (args, p.stderr)
        assert "required" not in p.stderr


def test_every_help_lists_the_exit_statuses_and_demo_errors_exit_2():
    from hisparse_cupy._cli.usage import EXIT_STATUSES

    for args in (("--help",), ("info", "--help"), ("check", "--help"), ("bench", "--help"),
                 ("demo", "--help")):
        p = cli(*args, timeout=60)
        assert p.returncode == 0 and EXIT_STATUSES in p.stdout, args
    import hisparse_cupy._cli as cli_module

    assert "141: stdout was closed early" in cli_module.__doc__
    for args in (("demo", "--eager", "--graph"), ("demo", "--context", "100"),
                 ("demo", "--no-partition", "--side-sms", "8")):
        p = cli(*args, timeout=60)
        assert p.returncode == 2 and p.stderr.startswith("demo: --"), (args, p.stderr)
    code = ("import sys, runpy; sys.argv = ['decode_loop.py', '--context', '100']; "
            f"runpy.run_path({str(ROOT / 'examples/decode_loop.py')!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert p.returncode == 2 and "--context (100) must exceed" in p.stderr


def test_demo_help_is_short_and_help_all_describes_every_option():
    from hisparse_cupy.demo._args import from_args, parser

    p = cli("demo", "--help", timeout=60)
    assert p.returncode == 0 and len(p.stdout.splitlines()) <= 70, len(p.stdout.splitlines())
    short = " ".join(p.stdout.split())
    assert "(default: True)" not in short and "--indexer/--no-indexer" in short
    full = cli("demo", "--help-all", timeout=60)
    assert full.returncode == 0
    text = " ".join(full.stdout.split())
    assert "(default: --indexer)" in text and "(default: --lean)" in text
    assert "(default: True)" not in text and "more options" not in text
    # each flag the short help only names is described by --help-all (a line of its own)
    more = p.stdout[p.stdout.index("more options"):p.stdout.index("Without a GPU")]
    named = {f for x in more.split() for f in x.split("/") if f.startswith("--")}
    described = {f.rstrip(",") for x in full.stdout.splitlines() if x.startswith("  --")
                 for f in x.split()[:2] if f.startswith("--")}  # ("--indexer, --no-indexer")
    assert len(named) > 30 and named <= described, sorted(named - described)
    assert parser(full=True).format_help() == full.stdout
    # every option named in the short help still parses (a few, with their effects)
    assert from_args(["--no-indexer"], check=False).indexer is False
    assert from_args(["--indexer"], check=False).indexer is True
    assert from_args(["--no-lean"], check=False).lean is False
    assert from_args(["--topk-model", "drift"], check=False).topk_model == "drift"


def test_bench_help_lists_the_benchmarks_or_says_it_needs_a_checkout(monkeypatch, capsys,
                                                                      tmp_path):
    import ast

    from hisparse_cupy import _cli

    p = cli("bench", "--help", timeout=60)
    assert p.returncode == 0
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    assert scripts
    for s in scripts:
        doc = ast.get_docstring(ast.parse(s.read_text()))
        line = next(x for x in p.stdout.splitlines() if x.startswith(f"  {s.stem[6:]} "))
        assert " ".join(line.split()[1:4]) == " ".join(doc.split()[:3]), (line, doc)
    monkeypatch.setattr(_cli, "BENCHMARKS", tmp_path / "benchmarks")  # an installed wheel
    with pytest.raises(SystemExit) as e:
        _cli.main(["bench", "--help"])
    assert e.value.code == 0 and "bench needs a checkout" in capsys.readouterr().out
    assert _cli.main(["bench"]) == 3
    assert "ship with the source repository" in capsys.readouterr().err


def test_info_reports_cupy_nvrtc_and_the_driver_each_on_its_own():
    code = ("import sys; sys.modules['cupy'] = None; from hisparse_cupy._cli import main; "
            "sys.exit(main(['info']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    cupy_line = next(x for x in lines if x.startswith("CuPy"))
    assert cupy_line.startswith("CuPy: not installed: install the extra that matches your "
                                "driver") and "pip install -e '.[cuda12]'" in cupy_line
    assert any(x.startswith(("NVRTC ", "NVRTC: not found (")) for x in lines), lines
    assert any(x.startswith(("CUDA driver: supports CUDA ", "CUDA driver: none found"))
               for x in lines), lines
    if importlib.util.find_spec("cuda.bindings") is not None:  # NVRTC without CuPy
        assert any(x.startswith("NVRTC 1") for x in lines), lines
    doc = json.loads(cli("info", "--json", timeout=60).stdout)
    if importlib.util.find_spec("cupy") is not None:
        import cupy

        assert doc["cupy"] == cupy.__version__
        assert doc["nvrtc"] == "{}.{}".format(*cupy.cuda.nvrtc.getVersion())
    from hisparse_cupy._device import driver_version

    assert doc["driver"] == driver_version()
