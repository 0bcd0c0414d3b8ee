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
