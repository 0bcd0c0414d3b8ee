from __future__ import annotations

import inspect

import ckptools as ck

CONTRACT = {
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "KeyMismatchError",
    "ResumableDistributedSampler",
    "UnsafeCheckpointError",
    "add_prefix",
    "load",
    "load_state_dict",
    "resolve_map_location",
    "save",
    "strip_prefix",
    "to_cpu",
    "unwrap_model",
    "convert_to_safetensors",
}


def test_all_is_sorted_and_holds_the_contract():
    assert ck.__all__ == sorted(ck.__all__)
    assert set(ck.__all__) >= CONTRACT
    assert all(hasattr(ck, name) for name in ck.__all__)


def test_public_functions_are_typed_and_documented():
    for name in ck.__all__:
        obj = getattr(ck, name)
        assert obj.__doc__ and obj.__doc__.strip(), name
        if inspect.isfunction(obj):
            assert "Example" in obj.__doc__, name
            assert ">>>" in obj.__doc__, f"ck.{name} has no >>> example (test_docs runs them)"
            assert "return" in obj.__annotations__, name


def test_error_hierarchy():
    assert issubclass(ck.CheckpointNotFoundError, FileNotFoundError)
    for cls in (ck.CheckpointNotFoundError, ck.CheckpointFormatError, ck.UnsafeCheckpointError, ck.KeyMismatchError):
        assert issubclass(cls, ck.CheckpointError)
    err = ck.KeyMismatchError("model: missing keys [a]", missing=["a"])
    assert str(err) == "model: missing keys [a]" and err.missing == ["a"]
    assert str(ck.CheckpointNotFoundError("x.pt does not exist")) == "x.pt does not exist"
    # save's refusal is an unsafe-checkpoint error and, for code without ckptools, a TypeError.
    assert issubclass(ck.UnsafeStateError, ck.UnsafeCheckpointError) and issubclass(ck.UnsafeStateError, TypeError)
    assert issubclass(ck.CheckpointWarning, UserWarning)


def test_lazy_names_match_all():
    from ckptools import _LAZY

    eager = {n for n in ck.__all__ if n[0].isupper() and n.endswith(("Error", "Warning"))}
    assert set(_LAZY) | eager == set(ck.__all__)


def test_the_overview_names_every_public_name_and_dir_shows_only_them():
    import pathlib
    import re

    overview = (pathlib.Path(__file__).parent.parent / "docs" / "reference" / "index.md").read_text()
    named = set(re.findall(r"`([A-Za-z_]+)[(`]", overview)) | set(re.findall(r"\b([A-Z][A-Za-z]+Error)\b", overview))
    assert set(ck.__all__) - named == set(), "missing from the API overview (docs/reference/index.md)"
    shown = {n for n in dir(ck) if not n.startswith("__")}
    assert shown == set(ck.__all__), shown ^ set(ck.__all__)  # no Any, TYPE_CHECKING, importlib, ...
    assert "with no process group" in ck.save.__doc__.lower() and "folders are created" in ck.save.__doc__


def test_load_has_one_switch_for_trusted_code_and_the_old_spelling_warns(tmp_path):
    """Issue 45: ck.load took weights_only and trust_code for one switch; weights_only (torch's, the
    contract's) is it, and trust_code=True still loads, with a DeprecationWarning, until 0.5."""
    import pathlib

    import pytest
    import torch

    path = tmp_path / "c.pt"
    torch.save({"w": torch.ones(2), "where": pathlib.PurePosixPath("/data")}, path)  # needs a refused class
    with pytest.raises(ck.UnsafeCheckpointError):
        ck.load(path)
    assert ck.load(path, weights_only=False)["where"] == pathlib.PurePosixPath("/data")
    with pytest.warns(DeprecationWarning, match=r"trust_code=\.\.\.\) is deprecated .* weights_only=False"):
        assert ck.load(path, trust_code=True)["where"] == pathlib.PurePosixPath("/data")


def test_every_reader_takes_weights_only_and_trust_code_warns_at_the_callers_line(tmp_path):
    """Issue 66: one spelling of the reader's switch, torch's and ck.load's `weights_only`, on every reader;
    `trust_code=True` is `weights_only=False` with a DeprecationWarning naming this file's line, until 0.6.
    `ck.diff`'s compare-the-weights-alone is `weights=` (the CLI's --weights); its old `weights_only=` warns."""
    import pathlib
    import warnings

    import pytest
    import torch

    warnings.simplefilter("ignore", ck.CheckpointWarning)  # the exported folders have no config.json
    module = tmp_path / "module.pt"
    torch.save(torch.nn.Linear(2, 2), module)  # a whole pickled module: its weights need its classes
    weights = torch.load(module, weights_only=False).state_dict()

    def out(kw: dict, name: str) -> pathlib.Path:
        return tmp_path / f"{sorted(kw)[0]}-{name}"

    readers = {
        "load_state_dict": lambda **kw: ck.load_state_dict(module, **kw),
        "convert": lambda **kw: ck.convert(module, out(kw, "c.safetensors"), **kw),
        "convert_to_safetensors": lambda **kw: ck.convert_to_safetensors(module, out(kw, "s.safetensors"), **kw),
        "export_huggingface": lambda **kw: ck.export_huggingface(module, out(kw, "hf"), **kw),
        "open_checkpoint": lambda **kw: ck.open_checkpoint(module, **kw).weights(),
    }  # fmt: skip
    for name, read in readers.items():
        with pytest.raises(ck.UnsafeCheckpointError):
            read(weights_only=True)
        read(weights_only=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            read(trust_code=True)
        (warned,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert f"ck.{name}(trust_code=...) is deprecated and goes in 0.6: pass weights_only=False" in str(
            warned.message
        )
        assert warned.filename == __file__, (name, warned.filename)
    assert ck.load_state_dict(module, weights_only=False)["weight"].equal(weights["weight"])
    # inspect and verify: a refused class outside the weights is refused, read with weights_only=False
    path = tmp_path / "c.pt"
    torch.save({"w": torch.ones(2), "where": pathlib.PurePosixPath("/data")}, path)
    for reader in (ck.inspect, ck.verify, ck.verify_report):
        with pytest.raises(ck.UnsafeCheckpointError, match="pathlib.PurePosixPath"):
            reader(path)
        reader(path, weights_only=False)
        with pytest.warns(DeprecationWarning, match=r"\(trust_code=\.\.\.\) is deprecated .* weights_only=False"):
            reader(path, trust_code=True)
    assert "where" in ck.inspect(path, weights_only=False)["entries"]
    torch.save({"model": {"w": torch.ones(2)}, "where": pathlib.PurePosixPath("/a")}, path)
    torch.save({"model": {"w": torch.zeros(2)}, "where": pathlib.PurePosixPath("/b")}, tmp_path / "d.pt")
    assert ck.diff(path, tmp_path / "d.pt", weights=True, trust_code=True)["not_compared"] == {
        "where": "--weights compares the weights alone"
    }
    with pytest.warns(DeprecationWarning, match=r"pass weights=True"):
        old = ck.diff(path, tmp_path / "d.pt", weights_only=True, trust_code=True)
    assert old["not_compared"] == {"where": "--weights compares the weights alone"} and old["differ"]
