"""The build cache end to end: real `llmc build` processes on the tiny fixture checkpoint.

Most tests share one cached build (``cached``); the ones that must compile (a changed weight,
concurrent builders, killed builds, two clean builds) each use their own cache directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock

from llmc.build_cache import KeyInputs, Store, parse_size
from llmc.compiler.build import BuildOptions, cache_key_inputs
from llmc.compiler.build import make_plan as _plan
from llmc.compiler.checkpoint import load_checkpoint
from llmc.compiler.targets import TARGETS
from llmc.runtime import artifact

LLMC = shutil.which("llmc") or str(Path(sys.executable).parent / "llmc")
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default-model"


def llmc(*args: str | Path, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run the installed `llmc` command in a real subprocess."""
    # SIGINT at its default, as in a terminal: a job a non-interactive shell puts in the background (`cmd &`, as
    # a CI script or nohup does) starts with SIGINT ignored, and a child would inherit that and never see Ctrl-C.
    proc = subprocess.run([LLMC, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if check and proc.returncode != 0:
        raise AssertionError(f"llmc {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def build_json(*args, **kw) -> dict:
    proc = llmc("build", *args, "--json", **kw)
    return json.loads(proc.stdout)


def files_of(engine: Path) -> dict[str, bytes]:
    return {f.relative_to(engine).as_posix(): f.read_bytes() for f in sorted(engine.rglob("*")) if f.is_file()}


def sealed(engine: Path) -> dict[str, bytes]:
    """Every file but build_info.json, the declared place for per-build data."""
    return {k: v for k, v in files_of(engine).items() if k != artifact.BUILD_INFO}


def cache_ls(cache: Path) -> dict:
    return json.loads(llmc("cache", "ls", "--json", "--cache-dir", cache).stdout)


@pytest.fixture(scope="session")
def cached(tmp_path_factory, tiny_llama):
    """A cache holding one build of the tiny checkpoint (default options), and that build's output.

    Built once per session, shared across xdist workers through a lock like conftest's fixtures.
    """
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "llmc-shared"
    shared.mkdir(exist_ok=True)
    root = shared / "build-cache-a"
    with FileLock(str(shared / "build-cache-a.lock")):
        if not (root / ".done").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            result = build_json(tiny_llama, "-o", root / "out", "--cache-dir", root / "cache")
            (root / "result.json").write_text(json.dumps(result))
            (root / ".done").touch()
    return {"cache": root / "cache", "out": root / "out", "result": json.loads((root / "result.json").read_text())}


def test_first_build_is_a_miss_and_published(cached):
    result = cached["result"]
    assert result["status"] == "ok" and result["cache_hit"] is False and len(result["key"]) == 64
    listing = cache_ls(cached["cache"])
    keys = [e["key"] for e in listing["entries"]]
    assert result["key"] in keys
    entry = next(e for e in listing["entries"] if e["key"] == result["key"])
    assert entry["target"] == "cpu" and entry["model"]["model_type"] == "llama" and entry["size_bytes"] > 0
    assert entry["artifact_digest"] == result["artifact_digest"] == artifact.artifact_digest(cached["out"])
    assert set(result["build_timings_s"]) >= {"trace", "passes", "emit", "total"}
    peaks = result["build_memory"]["peak_rss_gb"]
    assert set(peaks) >= {"trace", "emit"} and all(0 < v < 64 for v in peaks.values())


def test_second_identical_build_is_a_hit(cached, tiny_llama, tmp_path):
    for i in range(2):
        result = build_json(tiny_llama, "-o", tmp_path / f"hit{i}", "--cache-dir", cached["cache"])
        assert result["cache_hit"] is True and result["key"] == cached["result"]["key"]
    # The original build's timings come along; this call's own timings are the hit's.
    assert result["build_timings_s"] == cached["result"]["build_timings_s"]
    assert "trace" not in result["timings_s"] and "copy" in result["timings_s"]
    assert files_of(tmp_path / "hit0") == files_of(cached["out"])
    assert llmc("verify", tmp_path / "hit0").returncode == 0


def test_reordered_flags_and_other_paths_hit(cached, tiny_llama, tmp_path):
    # Another path to the same bytes, flags in another order, defaults spelled out, a repeated flag.
    ckpt = shutil.copytree(tiny_llama, tmp_path / "elsewhere" / "ckpt",
                           ignore=shutil.ignore_patterns(".done", "*.lock"))
    result = build_json("--block-size", "16", "--target", "cpu", "-o", tmp_path / "out", ckpt,
                        "--cache-dir", cached["cache"], "-q")
    assert result["cache_hit"] is True and result["key"] == cached["result"]["key"]


def test_text_output_reports_hit(cached, tiny_llama, tmp_path):
    proc = llmc("build", tiny_llama, "-o", tmp_path / "o", "--cache-dir", cached["cache"])
    assert "cache hit" in proc.stderr and "cache hit" in proc.stdout


def test_env_var_selects_cache_dir(cached, tiny_llama, tmp_path):
    result = build_json(tiny_llama, "-o", tmp_path / "o", env={"LLMC_CACHE_DIR": str(cached["cache"])})
    assert result["cache_hit"] is True


def _key(ckpt: Path, out: Path, **options) -> str:
    digest = load_checkpoint(ckpt).digest()
    return cache_key_inputs(digest, _plan(out, BuildOptions(**options))).key()


def test_key_covers_every_input_and_nothing_else(tiny_llama, tmp_path):
    base = _key(tiny_llama, tmp_path / "a")
    # Not inputs: the output path, --force, the checkpoint's path, flag order and repeats.
    assert _key(tiny_llama, tmp_path / "elsewhere" / "b", force=True) == base
    moved = shutil.copytree(tiny_llama, tmp_path / "moved", ignore=shutil.ignore_patterns(".done", "*.lock"))
    assert _key(moved, tmp_path / "a") == base
    assert (_key(tiny_llama, tmp_path / "a", disabled_passes=("cse", "swiglu"))
            == _key(tiny_llama, tmp_path / "a", disabled_passes=("swiglu", "cse", "swiglu")))
    # Inputs: the recipe, weights bytes, target, toolchain, llmc version, engine-shaping sources.
    assert _key(tiny_llama, tmp_path / "a", block_size=32) != base
    assert _key(tiny_llama, tmp_path / "a", disabled_passes=("cse",)) != base
    assert _key(tiny_llama, tmp_path / "a", verify_passes=True) != base
    inputs = cache_key_inputs(load_checkpoint(tiny_llama).digest(), _plan(tmp_path / "a", BuildOptions()))
    h100 = TARGETS["h100"]
    for change in ({"target": {"name": h100.name, "backend": h100.backend, "sm": h100.sm}},
                   {"toolchain": {**inputs.toolchain, "torch": "9.9.9"}},
                   {"llmc_version": "9.9.9"},
                   {"sources_digest": "sha256:" + "0" * 64}):
        assert dataclasses.replace(inputs, **change).key() != base, change
    weights = moved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    assert _key(moved, tmp_path / "a") != base


def test_sources_digest_sees_one_changed_byte(tmp_path):
    from llmc.build_cache import sources_digest

    pkg = tmp_path / "pkg"
    (pkg / "passes").mkdir(parents=True)
    (pkg / "passes" / "p.py").write_text("x = 1\n")
    (pkg / "cli").mkdir()
    (pkg / "cli" / "main.py").write_text("y = 1\n")
    before = sources_digest(pkg, ("passes",))
    (pkg / "cli" / "main.py").write_text("y = 2\n")  # not engine-shaping
    assert sources_digest(pkg, ("passes",)) == before
    (pkg / "passes" / "p.py").write_text("x = 2\n")
    assert sources_digest(pkg, ("passes",)) != before


def test_flipped_weight_byte_rebuilds_and_concurrent_builders_share_one_build(cached, tiny_llama, tmp_path):
    """Two processes build a checkpoint whose weights differ from ``cached``'s by one bit, at once,
    into (a copy of) its cache: it is a miss, exactly one of them compiles, both exit 0 with
    identical artifacts."""
    cache = shutil.copytree(cached["cache"], tmp_path / "cache")
    ckpt = shutil.copytree(tiny_llama, tmp_path / "ckpt", ignore=shutil.ignore_patterns(".done", "*.lock"))
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x10
    weights.write_bytes(bytes(data))
    procs = [subprocess.Popen([LLMC, "build", str(ckpt), "-o", str(tmp_path / f"out{i}"), "--json",
                               "--cache-dir", str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    results = [json.loads(o[0]) for o in outs]
    assert sorted(r["cache_hit"] for r in results) == [False, True], results
    assert results[0]["key"] == results[1]["key"] != cached["result"]["key"]
    assert sum("trace" in r["timings_s"] for r in results) == 1, "exactly one process traces"
    assert files_of(tmp_path / "out0") == files_of(tmp_path / "out1")
    assert results[0]["artifact_digest"] != cached["result"]["artifact_digest"]
    assert len(cache_ls(cache)["entries"]) == 2


def test_two_clean_builds_are_byte_identical(cached, tiny_llama, tmp_path):
    """`--no-cache` rebuilds (and refreshes the entry); every sealed file equals the first build's."""
    result = build_json(tiny_llama, "-o", tmp_path / "clean", "--cache-dir", cached["cache"], "--no-cache")
    assert result["cache_hit"] is False and result["key"] == cached["result"]["key"]
    a, b = sealed(cached["out"]), sealed(tmp_path / "clean")
    assert a.keys() == b.keys() and {"model.onnx", "model.onnx.data", "manifest.json", "report.json"} <= a.keys()
    different = [name for name in a if a[name] != b[name]]
    assert not different, (different, _json_diff(a, b, different))
    assert result["artifact_digest"] == cached["result"]["artifact_digest"]
    # The declared per-build file does differ (another build, another time).
    info_a = json.loads((cached["out"] / artifact.BUILD_INFO).read_text())
    info_b = json.loads((tmp_path / "clean" / artifact.BUILD_INFO).read_text())
    assert info_a["timings_s"] != info_b["timings_s"]


def _json_diff(a: dict[str, bytes], b: dict[str, bytes], names: list[str]) -> str:
    """The differing lines of the differing JSON files (what a failure needs to be diagnosed)."""
    import difflib

    out = []
    for name in (n for n in names if n.endswith(".json")):
        out += difflib.unified_diff(a[name].decode().splitlines(), b[name].decode().splitlines(), name, name, n=1,
                                    lineterm="")
    return "\n".join(out[:80])


def _assert_consistent(cache: Path, out: Path, expect_entries: int) -> dict:
    listing = cache_ls(cache)
    assert len(listing["entries"]) == expect_entries, listing
    for e in listing["entries"]:  # whatever is listed is complete and intact
        assert artifact.verify(Path(e["path"])) == []
    assert not out.exists()
    return listing


def test_killed_builds_leave_the_cache_consistent(tiny_llama, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    args = ["build", tiny_llama, "-o", out, "--cache-dir", cache, "-q"]
    # Killed with half an artifact written, then with a complete sealed artifact not yet published:
    # neither is an entry, both leave only a staging directory.
    for point in ("after-emit", "before-publish"):
        proc = llmc(*args, env={"LLMC_TEST_KILL_AT": point}, check=False)
        assert proc.returncode == -9, (point, proc.returncode, proc.stderr)
        listing = _assert_consistent(cache, out, 0)
        assert len(listing["stale_tmp"]) == 1, listing  # the next build of this key clears it first
    # Interrupted (Ctrl-C): cleans up after itself.
    proc = llmc(*args, env={"LLMC_TEST_KILL_AT": "after-trace:INT"}, check=False)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted" in proc.stderr
    listing = _assert_consistent(cache, out, 0)
    assert listing["stale_tmp"] == []
    # Killed after publishing, before copying to -o: the entry is complete and is reused.
    proc = llmc(*args, env={"LLMC_TEST_KILL_AT": "after-publish"}, check=False)
    assert proc.returncode == -9
    _assert_consistent(cache, out, 1)
    result = build_json(tiny_llama, "-o", out, "--cache-dir", cache)
    assert result["cache_hit"] is True
    assert llmc("verify", out).returncode == 0
    assert llmc("cache", "ls", "--cache-dir", cache).returncode == 0


def test_stale_staging_is_swept_and_never_listed(cached, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(cached["cache"], cache)
    store = Store(cache)
    key = cached["result"]["key"]
    # A dead build's leftovers: a staging dir of some key, and one of a key nobody holds.
    for name in (f"{key}.deadbeef0000", f"{'f' * 64}.0123456789ab"):
        (store.tmp_dir / name / "artifact").mkdir(parents=True)
        (store.tmp_dir / name / "artifact" / "model.onnx").write_bytes(b"partial")
    before = cache_ls(cache)
    assert len(before["stale_tmp"]) == 2 and [e["key"] for e in before["entries"]] == [key]
    with store.lock(key):  # a build of `key` is running: its staging dir is not stale
        assert len(store.stale()) == 1
    llmc("cache", "prune", "--max-size", "10G", "--cache-dir", cache)
    after = cache_ls(cache)
    assert after["stale_tmp"] == [] and [e["key"] for e in after["entries"]] == [key]


def test_damaged_entry_is_evicted_and_rebuilt(cached, tmp_path, tiny_llama):
    # Only the metadata is consulted for a hit; the copy is checked against the manifest. Use a
    # copy of the cache and damage its entry: the build must not hand out the damaged file.
    cache = tmp_path / "cache"
    shutil.copytree(cached["cache"], cache)
    key = cached["result"]["key"]
    data_file = Store(cache).get(key).artifact / "model.onnx.data"
    data_file.chmod(0o644)
    raw = bytearray(data_file.read_bytes())
    raw[123] ^= 0x01
    data_file.write_bytes(bytes(raw))
    proc = llmc("build", tiny_llama, "-o", tmp_path / "out", "--cache-dir", cache, "--json")
    result = json.loads(proc.stdout)
    assert result["cache_hit"] is False and "damaged" in proc.stderr
    assert sealed(tmp_path / "out") == sealed(cached["out"])


def test_cache_ls_prune_rm(cached, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(cached["cache"], cache)
    store = Store(cache)
    key = cached["result"]["key"]
    # A second, older entry: a copy of the first under another key, last used an hour ago.
    other = "e" * 64
    shutil.copytree(store.get(key).path, store.entries_dir / other)
    meta = json.loads((store.entries_dir / other / "entry.json").read_text())
    (store.entries_dir / other / "entry.json").write_text(json.dumps({**meta, "key": other}))
    old = time.time() - 3600
    os.utime(store.entries_dir / other / "last_used", (old, old))

    text = llmc("cache", "ls", "--cache-dir", cache)
    assert key[:16] in text.stdout and other[:16] in text.stdout and "quant=none block=16" in text.stdout
    listing = cache_ls(cache)
    assert [e["key"] for e in listing["entries"]] == [key, other]  # most recently used first
    size = listing["entries"][0]["size_bytes"]

    pruned = json.loads(llmc("cache", "prune", "--max-size", str(size + size // 2), "--json",
                             "--cache-dir", cache).stdout)
    assert [e["key"] for e in pruned["removed"]] == [other]  # least recently used goes first
    assert [e["key"] for e in cache_ls(cache)["entries"]] == [key]

    bad = llmc("cache", "rm", "abcz", "--cache-dir", cache, check=False)
    assert bad.returncode == 2 and "hex" in bad.stderr
    assert llmc("cache", "rm", "0000", "--cache-dir", cache, check=False).returncode == 2
    llmc("cache", "rm", key[:8], "--cache-dir", cache)
    assert cache_ls(cache)["entries"] == []
    bad_size = llmc("cache", "prune", "--max-size", "lots", "--cache-dir", cache, check=False)
    assert bad_size.returncode == 2 and "--max-size" in bad_size.stderr


def test_parse_size():
    assert parse_size("500M") == 500 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("1.5GiB") == int(1.5 * (1 << 30))
    assert parse_size("64kb") == 64 << 10
    assert parse_size("123") == 123


def test_json_error_object(tmp_path):
    proc = llmc("build", tmp_path / "missing", "-o", tmp_path / "o", "--json", "--cache-dir", tmp_path / "c",
                check=False)
    assert proc.returncode == 2
    obj = json.loads(proc.stdout)
    assert obj["status"] == "error" and obj["exit_code"] == 2 and "missing" in obj["error"]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


def test_key_inputs_roundtrip_through_entry_metadata(cached):
    entry = Store(cached["cache"]).get(cached["result"]["key"])
    assert KeyInputs(**entry.meta["key_inputs"]).key() == entry.key


HIT_PROBE = """
import json, sys
from llmc.cli.main import cli
try:
    cli(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = [m for m in ("torch", "transformers", "onnx", "onnx_ir", "onnxscript", "onnxruntime") if m in sys.modules]
print(json.dumps({"exit": code, "heavy": heavy}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(), reason="assets/default-model not trained yet")
def test_default_model_hit_loads_no_compiler_stack(tmp_path):
    # A hit is fast by construction: it hashes the checkpoint and copies the stored artifact, and never
    # imports torch, transformers or ONNX (importing them alone takes seconds). Its wall time is a
    # benchmark figure, not a unit-test bound: on a loaded machine any fixed bound is flaky.
    cache = tmp_path / "cache"
    first = build_json(DEFAULT_MODEL, "-o", tmp_path / "first", "--cache-dir", cache, "-q")
    assert first["cache_hit"] is False
    proc = subprocess.run([sys.executable, "-c", HIT_PROBE, "build", str(DEFAULT_MODEL), "-o", str(tmp_path / "hit"),
                           "--cache-dir", str(cache), "-q", "--json"], capture_output=True, text=True, check=True)
    lines = proc.stdout.strip().splitlines()
    hit, probe = json.loads(lines[0]), json.loads(lines[-1])
    assert hit["cache_hit"] is True and probe == {"exit": 0, "heavy": []}, (hit, probe, proc.stderr)
    assert sealed(tmp_path / "hit") == sealed(tmp_path / "first")
