from __future__ import annotations

import pytest
import torch

import ckptools as ck


def test_resolve_map_location_on_cpu_machine(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert ck.resolve_map_location() == torch.device("cpu")
    assert ck.resolve_map_location(None) == torch.device("cpu")
    assert ck.resolve_map_location("cpu") == torch.device("cpu")
    assert ck.resolve_map_location(torch.device("cpu")) == torch.device("cpu")
    assert ck.resolve_map_location({"cuda:0": "cpu"}) == {"cuda:0": "cpu"}
    fn = lambda storage, loc: storage  # noqa: E731
    assert ck.resolve_map_location(fn) is fn


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1", torch.device("cuda", 0), {"cuda:0": "cuda:1"}])
def test_cuda_target_without_cuda_says_what_works(spec):
    with pytest.raises(ValueError, match='CUDA is not available here; use "cpu"'):
        ck.resolve_map_location(spec)


@pytest.mark.parametrize("spec", ["gpu0", 3, ["cpu"], {"cuda:0": "nowhere"}])
def test_bad_spec_is_a_value_error(spec):
    with pytest.raises(ValueError, match="auto"):
        ck.resolve_map_location(spec)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_is_this_ranks_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert ck.resolve_map_location("auto") == torch.device("cuda", 0)
    assert ck.resolve_map_location("cuda") == torch.device("cuda", 0)


def test_cuda_tagged_file_remaps_to_cpu(cuda_tagged_file):
    # Without remapping, torch refuses: the storages say cuda:1.
    with pytest.raises(ck.CheckpointFormatError, match="map_location='cpu'"):
        from ckptools.layouts.torch_io import load_file

        load_file(cuda_tagged_file, map_location=None)
    for spec in ("auto", "cpu", {"cuda:1": "cpu"}, lambda storage, loc: storage):
        sd = ck.load_state_dict(cuda_tagged_file, map_location=spec, key="model")
        assert sd["weight"].device.type == "cpu" and torch.equal(sd["weight"], torch.full((3, 3), 2.0))


def test_to_cpu_copies_and_keeps_ties():
    w = torch.randn(4, 4)
    view = w[1]
    nested = {"a": [w, (view, 3)], "tied": w, "p": torch.nn.Parameter(torch.ones(2)), "s": "x"}
    out = ck.to_cpu(nested)
    assert out["s"] == "x" and out["a"][1][1] == 3
    assert torch.equal(out["a"][0], w) and torch.equal(out["a"][1][0], view)
    # No storage shared with the input ...
    assert out["a"][0].untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    # ... but ties and views inside the input are ties and views in the copy.
    assert out["tied"].untyped_storage().data_ptr() == out["a"][0].untyped_storage().data_ptr()
    assert out["a"][1][0].untyped_storage().data_ptr() == out["a"][0].untyped_storage().data_ptr()
    assert isinstance(out["p"], torch.nn.Parameter)
    w.add_(1)
    assert not torch.equal(out["a"][0], w)


def test_to_cpu_keeps_state_dict_metadata_and_model_untouched():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ptrs = [p.data_ptr() for p in model.parameters()]
    snap = ck.to_cpu(model.state_dict())
    assert snap._metadata == model.state_dict()._metadata
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).load_state_dict(snap)
