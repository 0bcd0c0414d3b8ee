from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import warnings

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

runner = CliRunner()
CKPT = shutil.which("ckpt") or os.path.join(os.path.dirname(sys.executable), "ckpt")


def _ddp_file(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd = torch.nn.DataParallel(net).state_dict()
    torch.save({"state_dict": sd, "epoch": 5, "optimizer": {"state": {}, "param_groups": []}}, tmp_path / "ddp.pt")
    return tmp_path / "ddp.pt"


def _run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_info_table_and_json(tmp_path, cuda_tagged_file):
    path = _ddp_file(tmp_path)
    result = _run("info", path)
    assert result.exit_code == 0, result.output
    assert "module.0.weight" in result.output and "ckpt strip-module" in result.output
    result = _run("info", path, "--json")
    report = json.loads(result.output)
    assert report["format"] == "torch zip" and report["totals"]["module_prefixed"] == 7
    assert report["entries"]["epoch"] == "5"
    assert {"name": "state_dict.module.0.weight", "shape": [4, 3], "dtype": "float32", "bytes": 48,
            "device": "cpu", "shared": False} in report["tensors"]  # fmt: skip
    gpu = json.loads(_run("info", cuda_tagged_file, "--json").output)
    assert {t["device"] for t in gpu["tensors"]} == {"cuda:1"}


def test_strip_add_keep_other_entries(tmp_path):
    path = _ddp_file(tmp_path)
    before = path.read_bytes()
    result = _run("strip-module", path, "-o", tmp_path / "clean.pt")
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == before
    clean = torch.load(tmp_path / "clean.pt", weights_only=True)
    assert clean["epoch"] == 5 and "optimizer" in clean
    assert not any(k.startswith("module.") for k in clean["state_dict"])
    assert _run("add-module", tmp_path / "clean.pt", "--in-place").exit_code == 0
    again = torch.load(tmp_path / "clean.pt", weights_only=True)
    assert list(again["state_dict"]) == list(torch.load(path, weights_only=True)["state_dict"])
    # safetensors: header-only rename
    ck.convert_to_safetensors(path, tmp_path / "m.safetensors", strip=None)
    assert _run("strip-module", tmp_path / "m.safetensors", "--in-place").exit_code == 0
    assert not any(k.startswith("module.") for k in safetensors.torch.load_file(str(tmp_path / "m.safetensors")))


def test_convert_both_ways_bit_exact(tmp_path):
    path = _ddp_file(tmp_path)
    assert _run("convert", path, tmp_path / "m.safetensors").exit_code == 0
    assert _run("convert", tmp_path / "m.safetensors", tmp_path / "back.pt").exit_code == 0
    original = ck.load_state_dict(path)
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)
    result = _run("convert", path, tmp_path / "x.txt")
    assert result.exit_code == 2 and "cannot convert" in result.output


def test_diff(tmp_path):
    path = _ddp_file(tmp_path)
    ck.convert_to_safetensors(path, tmp_path / "same.safetensors")
    assert _run("diff", path, tmp_path / "same.safetensors").exit_code == 0
    sd = ck.load_state_dict(path)
    sd["0.weight"] = sd["0.weight"] + 1e-3
    del sd["1.bias"]
    sd["extra"] = torch.ones(1)
    torch.save(sd, tmp_path / "other.pt")
    result = _run("diff", path, tmp_path / "other.pt", "--json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["missing_in_b"] == ["1.bias"] and report["only_in_b"] == ["extra"]
    assert report["changed"] == ["0.weight"] and report["max_abs_diff"]["0.weight"] == pytest.approx(1e-3, rel=1e-3)
    sd2 = ck.load_state_dict(path)
    sd2["0.weight"] = sd2["0.weight"] + 1e-6
    torch.save(sd2, tmp_path / "close.pt")
    assert _run("diff", path, tmp_path / "close.pt", "--atol", "1e-5").exit_code == 0
    assert _run("diff", path, tmp_path / "close.pt").exit_code == 1


def test_verify(tmp_path):
    path = tmp_path / "c.pt"
    ck.save(path, {"w": torch.randn(1000)})
    assert _run("verify", path).exit_code == 0
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the tensor record
    (tmp_path / "bad.pt").write_bytes(bytes(data))
    result = _run("verify", tmp_path / "bad.pt")
    assert result.exit_code == 1 and "DAMAGED" in result.output
    assert _run("verify", tmp_path / "missing.pt").exit_code == 2


def _canary_file(tmp_path):
    canary = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    torch.save({"model": {"w": torch.ones(1)}, "x": Evil()}, tmp_path / "evil.pt")
    return tmp_path / "evil.pt", canary


@pytest.mark.parametrize("command", ["info", "verify", "strip-module", "add-module", "convert", "diff"])
def test_bad_inputs_exit_2_one_line_no_traceback_nothing_written(tmp_path, command):
    _, canary = _canary_file(tmp_path)
    good = _ddp_file(tmp_path)
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "random.pt").write_bytes(os.urandom(2000))
    (tmp_path / "proto.pt").write_bytes(b"\x80\x99" + os.urandom(2000))  # makes torch warn about the protocol
    (tmp_path / "trunc.pt").write_bytes(good.read_bytes()[:300])
    (tmp_path / "huge.safetensors").write_bytes((2**63).to_bytes(8, "little") + b"{}")
    inputs = ["missing.pt", "empty.pt", "random.pt", "proto.pt", "evil.pt", "huge.safetensors", "trunc.pt"]
    for name in inputs:
        src = tmp_path / name
        before = src.read_bytes() if src.exists() else None
        extra = {"strip-module": ["-o", tmp_path / "out.pt"], "add-module": ["-o", tmp_path / "out.pt"],
                 "convert": [tmp_path / "out.safetensors"], "diff": [good]}.get(command, [])  # fmt: skip
        args = [command, str(src), *map(str, extra)]
        if name == "proto.pt":  # torch warns about it: a real process, whose stderr holds whatever is printed
            proc = subprocess.run([CKPT, *args], capture_output=True, text=True, timeout=120)
            code, stderr, stdout = proc.returncode, proc.stderr, proc.stdout
        else:  # in this process (each `ckpt` process imports torch: ~2 s of CPU); a warning that
            # escaped the command would be a second line on a real stderr: none may be raised
            with warnings.catch_warnings(record=True) as raised:
                warnings.simplefilter("always")
                result = runner.invoke(app, args)
            assert not raised, (name, [str(w.message) for w in raised])
            assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
            code, stderr, stdout = result.exit_code, result.stderr, result.stdout
        # verify answers "exists but damaged" with 1, one line on stdout (its answer, as OK is);
        # missing and unsafe are bad input (2), one line on stderr.
        damaged = command == "verify" and name not in ("missing.pt", "evil.pt")
        assert code == (1 if damaged else 2), (name, stderr)
        if damaged:
            assert stderr == "" and stdout.startswith("DAMAGED "), (name, stdout, stderr)
            stderr = "ckpt: " + stdout.removeprefix("DAMAGED ")
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckpt: ") and "Traceback" not in stderr, stderr
        assert name.split(".")[0] in lines[0] or name == "evil.pt"
        assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out.safetensors").exists()
        assert (src.read_bytes() if src.exists() else None) == before
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "no temp files left"
    assert not canary.exists()


def test_unsafe_message_names_globals(tmp_path):
    evil, _ = _canary_file(tmp_path)
    proc = subprocess.run([CKPT, "info", str(evil)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "system" in proc.stderr and "weights_only=False" in proc.stderr


def test_usage_errors(tmp_path):
    path = _ddp_file(tmp_path)
    assert _run("strip-module", path).exit_code == 2
    assert _run("strip-module", path, "-o", tmp_path / "x.pt", "--in-place").exit_code == 2
    proc = subprocess.run([sys.executable, "-m", "ckptools", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "strip-module" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["info", "{path}", "--jsn"], "No such option: --jsn (Possible options: --json). Try 'ckpt info --help'"),
        (["info"], "Missing argument 'path'. Try 'ckpt info --help' for help."),
        (["diff", "{path}", "{path}", "--atol", "x"], "Invalid value for '--atol'"),
        (["bogus"], "No such command 'bogus'. Try 'ckpt --help' for help."),
    ],
)
def test_usage_errors_are_one_line_exit_2(tmp_path, args, message):
    path = _ddp_file(tmp_path)
    proc = subprocess.run([CKPT, *(a.format(path=path) for a in args)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("ckpt: ") and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("byte", [b"\x1c", b"\x85"[:1], b"\n"])
def test_an_error_naming_a_damaged_record_stays_one_line_whatever_byte_the_name_holds(tmp_path, byte):
    # Found by the differential fuzz (torch 2.6's files): a record name with \x1c, which
    # str.splitlines (and so every reader of the line) breaks at, printed raw made two lines.
    path = _ddp_file(tmp_path)
    data = path.read_bytes()  # torch.save names its records after the file: ddp/data/0, ...
    path.write_bytes(data.replace(b"ddp/data/0", byte + b"dp/data/0"))
    result = _run("info", path)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and result.output.startswith("ckpt: "), repr(result.output)
    result = _run("verify", path)  # the verdict's line on stdout, too
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, repr(result.output)


def test_version():
    from ckptools import __version__

    result = _run("--version")
    assert result.exit_code == 0 and result.output.strip() == f"ckpt (ckptools) {__version__}"


@pytest.mark.parametrize("command", ["convert", "strip-module", "add-module"])
def test_existing_output_needs_force_and_a_directory_is_named(tmp_path, command):
    path = _ddp_file(tmp_path)
    out = tmp_path / ("out.safetensors" if command == "convert" else "out.pt")
    out.write_bytes(b"precious")
    args = [command, path, out] if command == "convert" else [command, path, "-o", out]
    result = _run(*args)
    assert result.exit_code == 2 and "already exists; pass --force" in result.output
    assert out.read_bytes() == b"precious"
    assert _run(*args, "--force").exit_code == 0 and out.read_bytes() != b"precious"
    (tmp_path / "some_dir").mkdir()
    if command == "convert":  # a folder is a Hugging Face export: model.safetensors inside it
        assert _run(command, path, tmp_path / "some_dir").exit_code == 0
        assert os.listdir(tmp_path / "some_dir") == ["model.safetensors"]
        return
    result = _run(command, path, "-o", tmp_path / "some_dir", "--force")
    assert result.exit_code == 2 and "some_dir is a directory; name the output file inside it, e.g. " in result.output
    assert "ddp.pt" in result.output and os.listdir(tmp_path / "some_dir") == []


def test_info_and_verify_count_tensors_alike(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    ck.save(tmp_path / "c.pt", {"model": model, "optimizer": opt})  # RNG states ride along in __ckptools__
    tied = torch.nn.Linear(4, 4, bias=False)
    torch.save({"a": tied.weight.detach(), "b": tied.weight.detach()}, tmp_path / "tied.pt")
    ck.convert_to_safetensors(tmp_path / "tied.pt", tmp_path / "tied.safetensors")  # b stored as an alias of a
    for name in ("c.pt", "tied.safetensors"):
        report = json.loads(_run("info", tmp_path / name, "--json").output)
        verdict = _run("verify", tmp_path / name).output
        assert f" {report['totals']['tensors']} tensors" in verdict, (name, report["totals"], verdict)
    # 7 of the model, 3 per parameter of AdamW's state; the 3 RNG tensors of __ckptools__ are not weights.
    assert json.loads(_run("info", tmp_path / "c.pt", "--json").output)["totals"]["tensors"] == 7 + 3 * 4


def test_help_does_not_import_torch():
    code = "import sys; from ckptools.cli import app; print('torch' in sys.modules, 'fsspec' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["False", "False"], proc.stderr


def test_legacy_format_files(tmp_path):
    sd = torch.nn.DataParallel(torch.nn.Linear(2, 2)).state_dict()
    torch.save(sd, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    report = json.loads(_run("info", tmp_path / "old.pt", "--json").output)
    assert report["format"] == "torch legacy" and report["totals"]["module_prefixed"] == 2
    assert _run("strip-module", tmp_path / "old.pt", "-o", tmp_path / "new.pt").exit_code == 0
    assert set(torch.load(tmp_path / "new.pt", weights_only=True)) == {"weight", "bias"}
    result = _run("verify", tmp_path / "old.pt")
    assert result.exit_code == 0 and "no checksums" in result.output


def test_compile_prefix_is_no_difference_and_convert_drops_it(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    torch.save({"state_dict": net.state_dict()}, tmp_path / "plain.pt")
    torch.save({"state_dict": torch.compile(net).state_dict()}, tmp_path / "compiled.pt")  # "_orig_mod." keys
    assert _run("diff", tmp_path / "plain.pt", tmp_path / "compiled.pt").exit_code == 0
    ck.convert_to_safetensors(tmp_path / "compiled.pt", tmp_path / "c.safetensors")
    from safetensors.torch import load_file

    assert sorted(load_file(str(tmp_path / "c.safetensors"))) == sorted(net.state_dict())
    stripped = _run("strip-module", tmp_path / "compiled.pt", "--prefix", "_orig_mod.", "-o", tmp_path / "s.pt")
    assert stripped.exit_code == 0
    assert sorted(torch.load(tmp_path / "s.pt")["state_dict"]) == sorted(net.state_dict())


def _two_training_checkpoints(tmp_path):
    """The same weights, different optimizer state and step (issue 44's case: `ckpt diff` said
    "2 common tensors equal bit for bit / checkpoints match", exit 0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    ck.save(tmp_path / "a.pt", {"model": model, "optimizer": opt, "step": 1})
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.step()
    model.load_state_dict(weights)  # the weights as in a.pt; the optimizer moved on
    ck.save(tmp_path / "b.pt", {"model": model, "optimizer": opt, "step": 2})
    return tmp_path / "a.pt", tmp_path / "b.pt"


def test_diff_compares_every_entry_and_never_says_match_about_what_it_did_not_compare(tmp_path):
    a, b = _two_training_checkpoints(tmp_path)
    result = _run("diff", a, b)
    assert result.exit_code == 1 and "checkpoints differ" in result.output and "match" not in result.output
    assert "changed step: 1 vs 2" in result.output and "optimizer.state.0.exp_avg" in result.output
    report = json.loads(_run("diff", a, b, "--json").output)
    assert {"step", "optimizer.state.0.exp_avg", "optimizer.state.1.step"} <= set(report["changed"])
    assert report["compared"][0] == "weights" and "optimizer" in report["compared"] and report["all_compared"]
    assert "weight" not in report["changed"] and report["max_abs_diff"]["weight"] == 0.0
    # The same file: every entry equal; only when and with what each was saved is not compared, and said so.
    same = _run("diff", a, a)
    assert same.exit_code == 0 and same.output.rstrip().endswith("checkpoints match"), same.output
    assert "not compared: when and with which versions each was saved" in same.output
    # --weights: the weights alone, and the word "match" only about them.
    weights = _run("diff", a, b, "--weights")
    assert weights.exit_code == 0 and "checkpoints match" not in weights.output, weights.output
    assert "not compared: __ckptools__, optimizer, step (--weights compares the weights alone)" in weights.output
    assert weights.output.rstrip().endswith("weights match; the rest not compared")
    # Against its export (bare weights): what the export cannot hold is named as not compared.
    ck.save_weights(tmp_path / "w.safetensors", torch.nn.Linear(4, 2))
    ck.convert(a, tmp_path / "export.safetensors")
    export = _run("diff", a, tmp_path / "export.safetensors")
    assert export.exit_code == 0 and "checkpoints match" not in export.output, export.output
    assert "only A holds them" in export.output and "optimizer, step" in export.output


def test_verify_a_run_folder_and_several_paths_each_on_stdout(tmp_path):
    manager = ck.CheckpointManager(tmp_path / "run", snapshot_dir=tmp_path / "memory")
    for step in (1, 2):
        manager.save({"w": torch.randn(1000)}, step)
    bad = manager.path_for(1)
    data = bytearray(pathlib.Path(bad).read_bytes())
    data[len(data) // 3] ^= 0xFF
    pathlib.Path(bad).write_bytes(bytes(data))
    result = subprocess.run([CKPT, "verify", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr == "", result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'run'}: a CheckpointManager's folder, 2 checkpoints; 0 snapshots")
    assert lines[1].startswith(f"DAMAGED {bad}: record ") and lines[2].startswith(f"OK {manager.path_for(2)}: ")
    # Several paths: a line each in order, the worst exit status; what cannot be judged on stderr.
    both = subprocess.run([CKPT, "verify", manager.path_for(2), str(tmp_path / "missing.pt"), bad],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert both.returncode == 2 and both.stdout.splitlines()[0].startswith(f"OK {manager.path_for(2)}")
    assert both.stdout.splitlines()[1].startswith(f"DAMAGED {bad}") and "missing.pt does not exist" in both.stderr
    report = json.loads(_run("verify", "--json", tmp_path / "run").output)
    assert [r["status"] for r in report["reports"]] == ["damaged", "ok"] and report["exit_code"] == 1
    # A folder that is neither a checkpoint nor a manager's says what to pass, in one line, exit 2.
    (tmp_path / "empty").mkdir()
    empty = _run("verify", tmp_path / "empty")
    assert empty.exit_code == 2 and len(empty.stderr.strip().splitlines()) == 1, empty.stderr


@pytest.mark.parametrize(
    ("command", "suffix"),
    [(["info"], ".safetensors"), (["info"], ".pt"), (["strip-module", "-o", "{out}"], ".safetensors"),
     (["strip-module", "-o", "{out}"], ".pt"),
     (["strip-module", "-o", "{out}", "--prefix", "nothing."], ".safetensors"),
     (["add-module", "-o", "{out}"], ".safetensors"), (["convert", "{out}"], ".pt")],
)  # fmt: skip
def test_paths_that_need_no_tensor_never_import_torch(tmp_path, command, suffix):
    """Reading headers and records, renaming keys, converting a torch zip to safetensors: torch-free
    (libtorch costs ~200 MiB and a second per call; `verify` loads a torch file with torch on
    purpose). strip-module's hint about the prefix every key shares (when none had the one asked
    for) took the weights, and so torch, on a safetensors file."""
    weights = {"net.w": torch.ones(2, 3), "net.b": torch.zeros(3)}
    src = tmp_path / f"in{suffix}"
    if suffix == ".pt":
        torch.save({"state_dict": weights, "epoch": 1}, src)
    else:
        safetensors.torch.save_file(weights, str(src))
    out = tmp_path / ("out.safetensors" if command[0] == "convert" else f"out{suffix}")
    args = [a.format(out=out) for a in command[:1]] + [str(src)] + [a.format(out=out) for a in command[1:]]
    proc = _without_torch(args)
    assert proc.stdout.strip().splitlines()[-1] == "EXIT 0 False", proc.stdout + proc.stderr


def _without_torch(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``ckpt ARGS`` in a fresh interpreter, which prints its exit code and whether torch was imported."""
    code = (
        "import sys; from ckptools.cli import app\n"
        f"try:\n    app({args!r})\nexcept SystemExit as e:\n    code = e.code\n"
        "print('EXIT', code, 'torch' in sys.modules)"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_listing_a_run_folder_never_imports_torch(tmp_path):
    """Issue 55: `ckpt info RUN_DIR` built a CheckpointManager per prefix to list files (and imported
    torch); a run folder is now asked about first, and listed from names and sizes alone."""
    manager = ck.CheckpointManager(tmp_path / "run", snapshot_dir=tmp_path / "memory")
    manager.save({"w": torch.ones(2)}, 3)
    proc = _without_torch(["info", "--json", str(tmp_path / "run")])
    assert proc.stdout.strip().splitlines()[-1] == "EXIT 0 False", proc.stdout + proc.stderr
    assert '"step": 3' in proc.stdout, proc.stdout


def test_in_process_calls_escape_a_name_the_stream_cannot_encode_and_each_starts_clean(tmp_path):
    """Issue 56 (6): a tensor name holding a lone surrogate (torch.save pickles any str) is shown escaped by
    an in-process call as by the executable, and the call after it, on another file, is not touched by it."""
    odd = tmp_path / "odd.pt"
    torch.save({"w\udcff": torch.ones(2)}, odd)
    plain = tmp_path / "plain.pt"
    ck.save(plain, {"model": torch.nn.Linear(2, 2), "step": 1})
    first = runner.invoke(app, ["info", str(odd)])
    assert first.exit_code == 0, first.output
    assert "w\\udcff" in first.output
    second = runner.invoke(app, ["info", str(plain)])
    assert second.exit_code == 0 and "model.weight" in second.output, second.output
    executable = subprocess.run([sys.executable, "-m", "ckptools", "info", str(odd)], capture_output=True)
    assert executable.returncode == 0 and b"w\\udcff" in executable.stdout, executable.stderr[-2000:]
