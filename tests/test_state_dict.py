from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import ckptools as ck

pytestmark = pytest.mark.versions  # torch's state_dict metadata and its prefix rules


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))


def test_strip_prefix_matches_torch_including_metadata():
    wrapped = torch.nn.DataParallel(_net()).state_dict()
    before = copy.deepcopy(wrapped)
    ours = ck.strip_prefix(wrapped)
    theirs = copy.deepcopy(wrapped)
    consume_prefix_in_state_dict_if_present(theirs, "module.")
    assert type(ours) is OrderedDict
    assert list(ours) == list(theirs)
    assert ours._metadata == theirs._metadata
    assert "" in ours._metadata and "module" not in ours._metadata
    # The input is untouched and tensors are shared, not copied.
    assert list(wrapped) == list(before) and wrapped._metadata == before._metadata
    assert ours["0.weight"] is wrapped["module.0.weight"]


def test_strip_then_load_into_plain_model_uses_metadata():
    src = torch.nn.DataParallel(_net())
    dst = _net()
    dst.load_state_dict(ck.strip_prefix(src.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(src.module.state_dict().values(), dst.state_dict().values()))


def test_strip_only_once_and_leaves_other_keys():
    sd = {"module.module.w": 1, "head.b": 2, "modulex": 3}
    assert ck.strip_prefix(sd) == {"module.w": 1, "head.b": 2, "modulex": 3}
    assert ck.strip_prefix({"_orig_mod.w": 1}, "_orig_mod.") == {"w": 1}


def test_add_prefix_is_inverse_and_idempotent():
    plain = _net().state_dict()
    added = ck.add_prefix(plain)
    assert list(added) == ["module." + k for k in plain]
    assert ck.add_prefix(added) == added
    assert list(ck.add_prefix(added)._metadata) == list(added._metadata)
    # Metadata renamed like DataParallel's own state dict (minus DP's own root entry).
    wrapped_meta = torch.nn.DataParallel(_net()).state_dict()._metadata
    assert set(added._metadata) == set(wrapped_meta) - {""}
    back = ck.strip_prefix(added)
    assert list(back) == list(plain) and back._metadata == plain._metadata
    torch.nn.DataParallel(_net()).load_state_dict(added)


def test_transforms_reject_empty_prefix():
    with pytest.raises(ValueError, match="non-empty"):
        ck.strip_prefix({}, "")
    with pytest.raises(ValueError, match="non-empty"):
        ck.add_prefix({}, "")


def test_unwrap_model_nested_wrappers(gloo_group):
    net = _net()
    assert ck.unwrap_model(net) is net
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    assert ck.unwrap_model(ddp) is net
    compiled = torch.compile(ddp)
    assert ck.unwrap_model(compiled) is net
    assert ck.unwrap_model(torch.nn.DataParallel(torch.compile(net))) is net
    assert list(ck.unwrap_model(compiled).state_dict()) == list(net.state_dict())
    with pytest.raises(TypeError, match="nn.Module"):
        ck.unwrap_model({"a": 1})


def test_metadata_is_renamed_exactly_as_torch_consumes_a_prefix():
    # Orders in which renaming one key replaces another not yet visited (issue 14): "module.module"
    # becomes "module" before "module" becomes "".
    import copy
    from collections import OrderedDict

    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    orders = [
        ["", "module", "module.module", "module.module.0"],
        ["module.module", "module", ""],
        ["module.fc", "fc", "module"],
        ["fc", "module.fc", "module.module.fc"],
    ]
    for keys in orders:
        # Tensor names distinct once stripped (w0, w1, ...); the metadata's module paths collide.
        sd = OrderedDict((f"{k}.w{i}" if k else f"w{i}", i) for i, k in enumerate(keys))
        sd._metadata = OrderedDict((k, {"version": i}) for i, k in enumerate(keys))
        theirs = copy.deepcopy(sd)
        consume_prefix_in_state_dict_if_present(theirs, "module.")
        ours = ck.strip_prefix(sd, "module.")
        assert list(ours._metadata.items()) == list(theirs._metadata.items()), keys
        assert dict(ours) == dict(theirs), keys  # the same names and values (torch reorders: it pops and re-inserts)
        assert sd._metadata == OrderedDict((k, {"version": i}) for i, k in enumerate(keys))  # input untouched
        # Tensor names that collide once stripped: torch keeps one value silently, ckptools refuses.
        clash = OrderedDict((f"{k}.w" if k else "w", i) for i, k in enumerate(keys))
        with pytest.raises(ValueError, match=r"the same name .* one tensor would be lost"):
            ck.strip_prefix(clash, "module.")
