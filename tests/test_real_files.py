"""Checkpoints as people actually have them (issue 21), each written by the library that owns it.

Hydra/OmegaConf hyper-parameters in Lightning checkpoints, Python 2 names of plain types in
protocol-2 pickles, whole pickled modules whose class is not importable, weights nested under
odd keys, ties stored once (safetensors' ``save_model``, transformers' ``save_pretrained``),
conjugate and negative views, two keys that become one, and the odd tensors torch's safe loader
reads (sparse, quantized, meta). Golden files from ``make interop`` (tests/interop/golden) cover
the Lightning + Hydra file, the whole pickled module and a nested training checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import _torch_can as torch_can
import pytest
import safetensors.torch
import torch
from _same import assert_same_tree, tiny_net
from omegaconf import OmegaConf
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

pytestmark = [pytest.mark.versions, pytest.mark.interop]  # files torch and the frameworks write

HERE = os.path.dirname(__file__)
# Absolute: some tests run the CLI from another working directory.
GOLDEN = os.path.abspath(os.environ.get("CKPTOOLS_GOLDEN") or os.path.join(HERE, "interop", "golden"))
INTEROP = os.path.join(HERE, "interop")
CKPT = os.path.join(os.path.dirname(sys.executable), "ckpt")


def _run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def _ckpt(*args: object, prelude: str = "", cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real executable (optionally after ``prelude``, e.g. hiding a module), in a fresh process."""
    code = f"import sys\n{prelude}\nfrom ckptools.cli import main\nsys.argv = ['ckpt', *sys.argv[1:]]\nmain()"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def _same(got, want) -> None:
    assert_same_tree(got, want, key_order=False)


def _hydra_ckpt(path) -> dict[str, torch.Tensor]:
    """A Lightning-layout checkpoint whose hyper-parameters are an OmegaConf DictConfig."""
    torch.manual_seed(0)
    net = tiny_net()
    cfg = OmegaConf.create({"model": {"width": 16, "layers": [8, 16, 4]}, "lr": 0.1, "root": "/d", "x": "${root}/x"})
    weights = {f"model.{k}": v for k, v in net.state_dict().items()}
    torch.save({"state_dict": weights, "hyper_parameters": cfg, "epoch": 1, "global_step": 2}, path)
    return net.state_dict()


# --- 1. OmegaConf configs and Python 2 names of plain types ----------------------------------------


def test_omegaconf_hyper_parameters_are_read_with_placeholders_by_every_command(tmp_path):
    path = tmp_path / "hydra.ckpt"
    want = _hydra_ckpt(path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)  # torch's safe loader refuses the whole file
    with pytest.warns(ck.CheckpointWarning, match=r"omegaconf\.dictconfig\.DictConfig.*nothing was executed"):
        _same(ck.load_state_dict(path), {f"model.{k}": v for k, v in want.items()})
    info = _run("info", "--json", path)
    assert info.exit_code == 0, info.output
    report = json.loads(info.output)
    assert {"omegaconf.dictconfig.DictConfig", "builtins.dict", "builtins.int"} <= set(report["skipped_globals"])
    assert not any(g.startswith("__builtin__") for g in report["skipped_globals"])  # named as Python 3 names them
    assert len(report["tensors"]) == len(want)
    verified = _run("verify", path)
    assert verified.exit_code == 0 and "4 weight tensors read" in verified.output, verified.output
    out = tmp_path / "w.safetensors"
    assert _run("convert", path, out).exit_code == 0
    _same(safetensors.torch.load_file(out), {f"model.{k}": v for k, v in want.items()})
    assert _run("diff", path, out).exit_code == 0
    renamed = tmp_path / "renamed.ckpt"
    assert _run("add-module", path, "-o", renamed).exit_code == 0
    # Every other entry is written back as it was read: OmegaConf loads it, trusted, unchanged.
    kept = torch.load(renamed, weights_only=False)
    assert OmegaConf.to_container(kept["hyper_parameters"]) == OmegaConf.to_container(
        torch.load(path, weights_only=False)["hyper_parameters"]
    )
    assert kept["hyper_parameters"].x == "/d/x"  # interpolation intact


def test_python2_names_of_plain_types_are_not_code(tmp_path):
    weights = {"w": torch.arange(3.0)}
    # __builtin__.set: torch's safe loader reads it as builtins.set (from torch 2.5 on), so does ckptools.
    torch.save({"state_dict": weights, "tags": {1, 2}}, tmp_path / "set.ckpt")
    if torch_can.load_safely({1, 2}):
        assert torch.load(tmp_path / "set.ckpt", weights_only=True)["tags"] == {1, 2}
        report = ck.inspect(tmp_path / "set.ckpt")
        assert "skipped_globals" not in report and report["entries"]["tags"]
        assert "1 tensor loaded" in ck.verify(tmp_path / "set.ckpt")
    # frozenset: torch's safe loader refuses it, so the torch-free reader does too (info read it while
    # verify refused the file); a placeholder, the weights read by both.
    torch.save({"state_dict": weights, "f": frozenset({1})}, tmp_path / "fz.ckpt")
    assert ck.inspect(tmp_path / "fz.ckpt")["skipped_globals"] == ["builtins.frozenset"]
    assert "1 weight tensor read" in ck.verify(tmp_path / "fz.ckpt")
    # A type as a value (OmegaConf's object_type=list): a placeholder, never refused as code.
    torch.save({"state_dict": weights, "hyper_parameters": {"t": list, "n": type(None), "k": int}}, tmp_path / "t.ckpt")
    report = ck.inspect(tmp_path / "t.ckpt")
    assert set(report["skipped_globals"]) == {"builtins.list", "builtins.type", "builtins.int"}  # type(None)
    _same(ck.load_state_dict(tmp_path / "t.ckpt"), weights)


def test_code_running_builtins_stay_refused_whatever_their_python2_name(tmp_path):
    canary = tmp_path / "ran"
    touch = f"open({str(canary)!r}, 'w').write('ran')"

    class Evil:
        def __init__(self, func, *args):
            self.func, self.args = func, args

        def __reduce__(self):
            return (self.func, self.args)

    for name, evil in (("eval", Evil(eval, touch)), ("__import__", Evil(__import__, "os")),
                       ("getattr", Evil(getattr, "x", "upper"))):  # fmt: skip
        path = tmp_path / f"{name}.ckpt"
        # beside weights and harmless plain types (list, type(None)): no reason for a lenient read
        hparams = {"cfg": [1, 2], "t": list, "n": type(None), "x": evil}
        torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": hparams}, path)
        for reader in (
            ck.inspect,
            ck.verify,
            ck.load_state_dict,
            lambda p: ck.load(p, {"model": torch.nn.Linear(1, 2)}),
        ):
            with pytest.raises(ck.UnsafeCheckpointError, match=rf"\b{name}\b"):
                reader(path)
        result = _run("info", path)
        assert result.exit_code == 2
    assert not canary.exists()


def test_golden_lightning_hydra_checkpoint():
    path = os.path.join(GOLDEN, "lightning_hydra.ckpt")
    reference = safetensors.torch.load_file(os.path.join(GOLDEN, "reference", "lightning_hydra.safetensors"))
    with pytest.warns(ck.CheckpointWarning, match="omegaconf"):
        _same(ck.load_state_dict(path, strip="model."), reference)
    net = tiny_net(1)  # other weights than the file's: the load must change them
    ckpt = ck.load(path, {"model": net})  # weights restored; hyper_parameters as placeholders
    _same(net.state_dict(), reference)
    report = ck.inspect(path)
    assert any(g.startswith("omegaconf.") for g in report["skipped_globals"])
    assert _run("verify", path).exit_code == 0
    assert (
        ckpt["global_step"] == 2 and repr(ckpt["hyper_parameters"]) == "<omegaconf.dictconfig.DictConfig, not loaded>"
    )


# --- 2. trusted pickles whose classes are not importable -----------------------------------------


@pytest.mark.slow  # ~10 s of processes: make interop (make test stays within its 5 minutes)
def test_verify_trusting_a_file_whose_class_is_missing_is_not_damage(tmp_path):
    hydra = tmp_path / "hydra.ckpt"
    _hydra_ckpt(hydra)
    hide = "sys.modules['omegaconf'] = None  # as if omegaconf were not installed"
    for path, prelude, module in (
        (hydra, hide, "omegaconf"),
        (os.path.join(GOLDEN, "whole_model.pt"), "", "golden_models"),  # the class lives in tests/interop
    ):
        result = _ckpt("verify", "--trust-pickled-code", path, prelude=prelude, cwd=str(tmp_path))
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "DAMAGED" not in result.stderr, result.stderr
        assert f"module '{module}" in result.stderr and "intact" in result.stderr, result.stderr
        with pytest.raises(ck.MissingClassError, match=module):
            subprocess_free_missing(path, module)
    # Without trust the weights of the Hydra file read fine, omegaconf or not.
    result = _ckpt("verify", hydra, prelude=hide)
    assert result.returncode == 0 and result.stdout.startswith("OK"), result.stderr


def subprocess_free_missing(path, module: str) -> None:
    """The library's own error, in this process, with ``module`` hidden."""
    saved = sys.modules.get(module)
    sys.modules[module] = None  # type: ignore[assignment]
    try:
        ck.verify(path, weights_only=False)
    finally:
        if saved is None:
            del sys.modules[module]
        else:
            sys.modules[module] = saved


# --- 3. --key everywhere the weights are looked for ---------------------------------------------


def test_every_weights_command_takes_key_dotted_for_nesting(tmp_path):
    weights = {"module.w": torch.arange(4.0), "module.b": torch.ones(2)}
    flat, nested = tmp_path / "flat.pt", tmp_path / "nested.pt"
    torch.save({"model_state": weights, "step": 3}, flat)
    torch.save({"model": {"state_dict": weights, "arch": "x"}, "step": 3}, nested)
    for path, key in ((flat, "model_state"), (nested, "model.state_dict")):
        without = _run("strip-module", path, "-o", tmp_path / "x.pt")
        assert without.exit_code == 2 and "--key" in without.output  # the advice ...
        stripped = tmp_path / f"s-{path.name}"
        assert _run("strip-module", path, "-o", stripped, "--key", key).exit_code == 0  # ... can be followed
        tree = torch.load(stripped, weights_only=True)
        node = tree
        for part in key.split("."):
            node = node[part]
        assert sorted(node) == ["b", "w"] and tree["step"] == 3
        back = tmp_path / f"a-{path.name}"
        assert _run("add-module", stripped, "-o", back, "--key", key).exit_code == 0
        export = tmp_path / f"{path.stem}.safetensors"
        assert _run("convert", path, export, "--key", key).exit_code == 0
        # diff: --key applies to each side holding that entry; the export is read as it is
        assert _run("diff", path, export, "--key", key).exit_code == 0
        assert _run("diff", path, back, "--key", key).exit_code == 0
        changed = tmp_path / f"c-{path.name}"
        tree = torch.load(back, weights_only=True)
        node = tree
        for part in key.split("."):
            node = node[part]
        node["module.w"][0] = 9.0
        torch.save(tree, changed)
        assert _run("diff", path, changed, "--key", key).exit_code == 1
    missing = _run("strip-module", flat, "-o", tmp_path / "y.pt", "--key", "nope")
    assert missing.exit_code == 2 and "no entry 'nope'" in missing.output
    net = torch.nn.Linear(2, 2)
    with pytest.raises(ck.CheckpointFormatError, match=r"name the entry that holds them in state"):
        ck.load(flat, {"model": net})  # ck.load's own advice, which it can follow
    assert ck.load_state_dict(nested, key="model.state_dict").keys() == {"w", "b"}


def test_golden_nested_training_checkpoint(tmp_path):
    path = os.path.join(GOLDEN, "nested_training.pt")
    reference = safetensors.torch.load_file(os.path.join(GOLDEN, "reference", "nested_training.safetensors"))
    _same(ck.load_state_dict(path, key="model.state_dict"), reference)
    out = tmp_path / "n.safetensors"
    assert _run("convert", path, out, "--key", "model.state_dict").exit_code == 0
    _same(safetensors.torch.load_file(out), reference)
    assert _run("diff", path, out, "--key", "model.state_dict").exit_code == 0


# --- 4. a trusted whole pickled module --------------------------------------------------------------


def test_a_trusted_whole_pickled_module_lists_its_parameters_and_buffers(tmp_path, monkeypatch):
    path = os.path.join(GOLDEN, "whole_model.pt")
    reference = safetensors.torch.load_file(os.path.join(GOLDEN, "reference", "whole_model.safetensors"))
    untrusted = _run("info", path)
    assert untrusted.exit_code == 2 and "whole pickled golden_models.TinyNet" in untrusted.output
    monkeypatch.syspath_prepend(INTEROP)  # the class is importable: the file is trusted
    report = json.loads(_run("info", "--json", "--trust-pickled-code", path).output)
    assert sorted(t["name"] for t in report["tensors"]) == sorted(reference)  # 9: parameters and buffers
    verified = _run("verify", "--trust-pickled-code", path)
    # (rich wraps the line at the terminal's width, wherever the path's length puts the break)
    assert verified.exit_code == 0 and f"{len(reference)} tensors loaded" in " ".join(verified.output.split())
    for out in (tmp_path / "w.safetensors", tmp_path / "w.pt"):
        assert _run("convert", "--trust-pickled-code", path, out).exit_code == 0
        _same(ck.load_state_dict(out), reference)
    assert _run("diff", "--trust-pickled-code", path, tmp_path / "w.safetensors").exit_code == 0
    from golden_models import TinyNet

    net = TinyNet()
    ck.load(path, {"model": net}, weights_only=False)
    _same(net.state_dict(), reference)
    with pytest.raises(ck.UnsafeCheckpointError, match="whole pickled"):
        ck.load(path, {"model": net})


# --- 5. ties stored once ----------------------------------------------------------------------------


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied, as a language model's output and input embeddings


def test_ties_a_file_stores_once_are_not_missing(tmp_path):
    torch.manual_seed(0)
    net = _Tied()
    saved = tmp_path / "model.safetensors"
    safetensors.torch.save_model(net, str(saved))  # the official library drops one name of a tie
    with safetensors.safe_open(str(saved), "pt") as f:
        stored = set(f.keys())
    assert len(stored) == len(net.state_dict()) - 1
    fresh = _Tied()
    ck.load(saved, {"model": fresh})
    _same(fresh.state_dict(), net.state_dict())
    assert fresh.head.weight.data_ptr() == fresh.embed.weight.data_ptr()  # still one tensor
    full = tmp_path / "state_dict.pt"
    torch.save(net.state_dict(), full)
    for a, b in ((saved, full), (full, saved)):
        result = _run("diff", "--json", a, b)
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        (dropped,) = set(net.state_dict()) - stored
        kept = "head.weight" if dropped == "embed.weight" else "embed.weight"
        assert report["tied"] == {dropped: kept} and not report["differ"]
    text = _run("diff", saved, full).output
    assert f"{dropped}: tied to {kept}" in text and "only in" not in text
    # A real difference stays one: the other name of the tie holds other values.
    other = dict(net.state_dict())
    other[dropped] = other[dropped].clone() + 1
    torch.save(other, tmp_path / "untied.pt")
    assert _run("diff", saved, tmp_path / "untied.pt").exit_code == 1
    # A model that does not tie them still misses the name.
    untied = _Tied()
    untied.head.weight = torch.nn.Parameter(torch.zeros(6, 4))
    with pytest.raises(ck.KeyMismatchError, match="missing keys"):
        ck.load(saved, {"model": untied})


def test_golden_transformers_tie_loads_into_the_real_model():
    transformers = pytest.importorskip("transformers")  # make interop installs it
    folder = os.path.join(GOLDEN, "hf_single")
    config = transformers.GPT2Config.from_pretrained(folder)
    model = transformers.GPT2LMHeadModel(config)
    ck.load(os.path.join(folder, "model.safetensors"), {"model": model})
    reference = safetensors.torch.load_file(os.path.join(GOLDEN, "reference", "hf.safetensors"))
    _same(model.state_dict(), reference)


# --- 6. ck.load of a Lightning checkpoint with a Path ----------------------------------------------


def test_ck_load_restores_what_state_names_beside_placeholders(tmp_path):
    import pathlib

    net = tiny_net()
    path = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in net.state_dict().items()}, "epoch": 4,
                "hyper_parameters": {"root": pathlib.Path("/data"), "lr": 0.1}}, path)  # fmt: skip
    fresh = tiny_net(1)
    with pytest.warns(ck.CheckpointWarning, match=r"pathlib\.PosixPath"):
        ckpt = ck.load(path, {"model": fresh})
    _same(fresh.state_dict(), net.state_dict())
    assert ckpt["epoch"] == 4 and ckpt["hyper_parameters"]["lr"] == 0.1
    assert repr(ckpt["hyper_parameters"]["root"]) == "<pathlib.PosixPath, not loaded>"


# --- 7. silent changes and crashes from the differential comparison -------------------------------


def test_conjugate_and_negative_views_keep_their_values_everywhere(tmp_path):
    views = {"c": torch.tensor([1 + 2j, 3 - 4j]).conj(), "n": torch.tensor([1.0, -2.0])._neg_view()}
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in views.items()}
    torch.save(views, tmp_path / "v.pt")
    assert _run("convert", tmp_path / "v.pt", tmp_path / "v.safetensors").exit_code == 0
    _same(safetensors.torch.load_file(tmp_path / "v.safetensors"), want)
    assert _run("convert", tmp_path / "v.pt", tmp_path / "v2.pt").exit_code == 0
    _same(torch.load(tmp_path / "v2.pt"), want)
    ck.save_weights(tmp_path / "w.safetensors", views)
    _same(safetensors.torch.load_file(tmp_path / "w.safetensors"), want)
    ck.save(tmp_path / "s.pt", dict(views))
    ck.async_save(tmp_path / "a.pt", dict(views)).wait()
    for name in ("s.pt", "a.pt"):
        got = torch.load(tmp_path / name, weights_only=True)
        _same({k: got[k].resolve_conj().resolve_neg() for k in views}, want)
    _same({k: v.resolve_conj().resolve_neg() for k, v in ck.to_cpu(views).items()}, want)
    assert _run("diff", tmp_path / "v.pt", tmp_path / "v.safetensors").exit_code == 0


def test_two_keys_that_would_become_one_are_refused_in_every_command(tmp_path):
    weights = {"module.a": torch.ones(2), "a": torch.zeros(2)}
    torch.save(weights, tmp_path / "c.pt")
    safetensors.torch.save_file(weights, tmp_path / "c.safetensors")
    for args in (
        ("strip-module", "c.pt", "-o", "o.pt"),
        ("strip-module", "c.safetensors", "-o", "o.safetensors"),
        ("convert", "c.pt", "o.safetensors"),
        ("convert", "c.safetensors", "o.pt"),
        ("diff", "c.pt", "c.safetensors"),
    ):
        result = _run(*[tmp_path / a if "." in a and not a.startswith("-") else a for a in args])
        assert result.exit_code == 2, (args, result.output)
        assert "'module.a'" in result.output and "'a'" in result.output and "c." in result.output, result.output
        assert not any(p.name.startswith("o.") for p in tmp_path.iterdir()), args  # nothing written
    torch.save({"a": torch.ones(1), "module.a": torch.zeros(1)}, tmp_path / "d.pt")
    assert _run("add-module", tmp_path / "d.pt", "-o", tmp_path / "o.pt").exit_code == 2
    with pytest.raises(ValueError, match="one tensor would be lost"):
        ck.load_state_dict(tmp_path / "c.pt")
    assert ck.load_state_dict(tmp_path / "c.pt", strip=None).keys() == weights.keys()  # both, as stored
    assert _run("convert", "--no-strip", tmp_path / "c.pt", tmp_path / "o.safetensors").exit_code == 0


def test_odd_tensors_never_crash(tmp_path):
    # one-element and empty views whose last stride is not 1
    views = {"one": torch.ones(1, 3)[:, :1], "empty": torch.ones(0, 3)[:, :0], "col": torch.ones(3, 1)[:1]}
    torch.save(views, tmp_path / "v.pt")
    assert _run("convert", tmp_path / "v.pt", tmp_path / "v.safetensors").exit_code == 0
    _same(safetensors.torch.load_file(tmp_path / "v.safetensors"), {k: v.contiguous() for k, v in views.items()})
    ck.save_weights(tmp_path / "w.safetensors", views)
    _same(safetensors.torch.load_file(tmp_path / "w.safetensors"), {k: v.contiguous() for k, v in views.items()})
    # a name holding a lone surrogate: torch.save pickles it; safetensors (UTF-8) cannot hold it
    torch.save({"a\ud800": torch.ones(1)}, tmp_path / "s.pt")
    result = _run("convert", tmp_path / "s.pt", tmp_path / "s.safetensors")
    assert result.exit_code == 2 and "lone surrogate" in result.output and not (tmp_path / "s.safetensors").exists()
    safetensors.torch.save_file({"a": torch.ones(1)}, tmp_path / "p.safetensors")
    with pytest.raises(ck.CheckpointFormatError, match="lone surrogate"):
        ck.rename_checkpoint(tmp_path / "p.safetensors", tmp_path / "q.safetensors", lambda sd: {"\ud801": sd["a"]})
    assert not (tmp_path / "q.safetensors").exists()
    shown = _ckpt("info", tmp_path / "s.pt")  # printed escaped, through the real stdout
    assert shown.returncode == 0 and "a\\ud800" in shown.stdout, shown.stderr
    # a meta tensor has no values to write
    torch.save({"m": torch.empty(2, 3, device="meta")}, tmp_path / "m.pt")
    result = _run("convert", tmp_path / "m.pt", tmp_path / "m.safetensors")
    assert result.exit_code == 2 and "meta device" in result.output and "please report" not in result.output
    meta = ck.inspect(tmp_path / "m.pt")["tensors"][0]
    assert (meta["shape"], meta["dtype"], meta["device"]) == ([2, 3], "float32", "meta")


def test_sparse_quantized_and_nested_tensors_are_described_as_torch_loads_them(tmp_path):
    with pytest.warns(UserWarning):
        tensors = {
            "coo": torch.eye(3).to_sparse(),
            "csr": torch.eye(4, dtype=torch.float64).to_sparse_csr(),
            "q": torch.quantize_per_tensor(torch.arange(3.0), 0.1, 0, torch.qint8),
        }
    torch.save(tensors, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)  # what torch's safe loader gives
    report = {t["name"]: t for t in ck.inspect(tmp_path / "t.pt")["tensors"]}
    for name, tensor in loaded.items():
        assert report[name]["shape"] == list(tensor.shape), name
        assert report[name]["dtype"] == str(tensor.dtype).removeprefix("torch."), name
    assert report["coo"]["bytes"] == 2 * 3 * 8 + 3 * 4  # indices and values
    assert "3 tensors loaded" in ck.verify(tmp_path / "t.pt")
    got = ck.load_state_dict(tmp_path / "t.pt")
    assert torch.equal(got["coo"].to_dense(), torch.eye(3)) and torch.equal(got["q"].int_repr(), loaded["q"].int_repr())
    result = _run("convert", tmp_path / "t.pt", tmp_path / "t.safetensors")
    assert result.exit_code == 2 and "please report" not in result.output
    # a nested tensor: torch loads it, it has no sizes of its own; described as how many it holds
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    torch.save({"nt": nested, "w": torch.ones(1)}, tmp_path / "n.pt")
    (described,) = [t for t in ck.inspect(tmp_path / "n.pt")["tensors"] if t["name"] == "nt"]
    assert (described["shape"], described["dtype"], described["bytes"]) == ([2], "float32", 20)
    assert "2 tensors loaded" in ck.verify(tmp_path / "n.pt")
    result = _run("convert", tmp_path / "n.pt", tmp_path / "n.safetensors")
    assert result.exit_code == 2 and "nested tensor" in result.output
    # diff compares them by value (it crashed in torch.equal on sparse and nested tensors)
    torch.save({"coo": tensors["coo"], "q": tensors["q"], "nt": nested}, tmp_path / "a.pt")
    torch.save({"coo": tensors["coo"].clone(), "q": tensors["q"].clone(), "nt": nested.clone()}, tmp_path / "b.pt")
    changed = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])
    torch.save({"coo": (2 * torch.eye(3)).to_sparse(), "q": tensors["q"], "nt": changed}, tmp_path / "c.pt")
    assert _run("diff", tmp_path / "a.pt", tmp_path / "b.pt").exit_code == 0
    report = ck.diff(tmp_path / "a.pt", tmp_path / "c.pt")
    assert report["differ"] and report["changed"] == ["coo", "nt"]
    torch.save({"coo": torch.eye(3), "q": torch.arange(3.0), "nt": torch.ones(5)}, tmp_path / "d.pt")
    kinds = {m["name"]: m["a"][1] for m in ck.diff(tmp_path / "a.pt", tmp_path / "d.pt")["shape_or_dtype_mismatch"]}
    assert kinds == {"coo": "sparse_coo", "q": "quantized", "nt": "nested"}
