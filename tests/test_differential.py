"""Differential tests: ckptools' own readers and writers against torch and the official safetensors.

For generated state dicts (every dtype both formats hold, 0-d and zero-size tensors, non-contiguous
tensors, views of one storage, tied names, unicode names; bare or nested beside plain values;
pickle protocols 2 and 3), every operation must give, bit for bit, what the official
implementation gives: the torch-free ``info``, ``load_state_dict``, conversion to safetensors (read
back by the official library), ``strip-module`` (read back by torch, other entries unchanged), and
conversion back to a torch file. CKPTOOLS_FUZZ_EXAMPLES examples per run (40; 3000 in `make fuzz`).
"""

from __future__ import annotations

import json
import os

import pytest
import safetensors
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptools as ck

EXAMPLES = int(os.environ.get("CKPTOOLS_FUZZ_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=os.environ.get("CI") == "true",  # CI replays the same examples; local runs draw new ones
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Every dtype both torch files and safetensors hold.
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint16, torch.uint32, torch.uint64]  # fmt: skip
NAME = st.text(st.characters(categories=("L", "N"), include_characters="._-é中"), min_size=1, max_size=10)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and _bits(a) == _bits(b)


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    names = draw(st.lists(NAME, min_size=1, max_size=6, unique=True))
    prefixed = draw(st.booleans())
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    previous: torch.Tensor | None = None
    for name in names:
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
        kind = draw(st.sampled_from(["fresh", "transposed", "view", "tied"]))
        numel = 1
        for d in shape:
            numel *= d
        raw = torch.randint(0, 256, (max(numel, 1) * torch.empty((), dtype=dtype).element_size(),), generator=g,
                            dtype=torch.uint8)  # fmt: skip
        if dtype == torch.bool:
            raw = raw % 2
        t = raw.view(dtype)[:numel].reshape(shape)
        if kind == "transposed" and t.dim() >= 2:
            t = t.transpose(0, 1)  # non-contiguous
        elif kind == "view" and numel > 1:
            t = t.reshape(-1)[1:]  # a view at an offset into a storage
        elif kind == "tied" and previous is not None:
            t = previous  # the same tensor under two names
        out[("module." if prefixed else "") + name] = t
        previous = t
    return out


@SETTINGS
@given(
    state=state_dicts(),
    nest=st.sampled_from([None, "model", "state_dict"]),
    extras=st.fixed_dictionaries({"step": st.integers(-(2**40), 2**40), "note": NAME, "lr": st.floats(0, 1)}),
    protocol=st.sampled_from([2, 3]),  # the protocols torch's safe loader reads
)
def test_every_operation_agrees_with_torch_and_safetensors(tmp_path_factory, state, nest, extras, protocol):
    tmp = tmp_path_factory.mktemp("diff")
    src = tmp / "s.pt"
    # Bare weights, or nested in a training checkpoint beside plain values (Lightning's
    # "state_dict", a script's "model").
    tree = state if nest is None else {nest: state, "meta": {"extras": [extras, (1, "x")]}, "step": extras["step"]}
    torch.save(tree, src, pickle_protocol=protocol)
    loaded = torch.load(src, weights_only=True)
    theirs = loaded if nest is None else loaded[nest]

    # info, torch-free: dtype, shape and bytes of every tensor as torch loads them
    prefix = "" if nest is None else nest + "."
    report = {t["name"].removeprefix(prefix): t for t in ck.inspect(src)["tensors"]}
    assert set(report) == set(theirs)
    for name, t in theirs.items():
        assert (report[name]["dtype"], report[name]["shape"]) == (str(t.dtype).removeprefix("torch."), list(t.shape))
        assert report[name]["bytes"] == t.numel() * t.element_size()

    # load_state_dict: every tensor bit for bit
    ours = ck.load_state_dict(src, strip=None)
    assert set(ours) == set(theirs) and all(_same(ours[k], theirs[k]) for k in theirs)

    # to safetensors, read back by the official library (tied names through ckptools' aliases)
    dst = tmp / "s.safetensors"
    ck.convert_to_safetensors(src, dst, strip=None)
    official = safetensors.torch.load_file(str(dst))
    with safetensors.safe_open(str(dst), "pt") as f:
        aliases = json.loads((f.metadata() or {}).get("ckptools.aliases", "{}"))
    assert not set(aliases) & set(official)  # an alias never names a stored tensor
    assert set(official) | set(aliases) == set(theirs)
    for name, t in theirs.items():
        assert _same(official[aliases.get(name, name)], t), name

    # strip-module, read back by torch: keys as ck.strip_prefix gives them, tensors unchanged
    renamed = tmp / "r.pt"
    ck.rename_checkpoint(src, renamed, ck.strip_prefix)
    whole = torch.load(renamed, weights_only=True)
    back = whole if nest is None else whole[nest]
    expected = ck.strip_prefix(theirs)
    assert list(back) == list(expected) and all(_same(back[k], expected[k]) for k in expected)
    if nest is not None:  # every other entry as it was
        assert {k: v for k, v in whole.items() if k != nest} == {k: v for k, v in loaded.items() if k != nest}

    # and back from safetensors to a torch file
    again = tmp / "a.pt"
    torch_file = ck.load_state_dict(dst, strip=None)
    ck.serialization.save_file(again, torch_file)
    final = torch.load(again, weights_only=True)
    assert set(final) == set(theirs) and all(_same(final[k], theirs[k]) for k in theirs)


def test_the_generator_covers_what_it_claims():
    # A guard against a strategy that silently stops producing the hard cases.
    seen = {"zero_size": False, "zero_dim": False, "non_contiguous": False, "tied": False}

    @settings(max_examples=200, derandomize=True, deadline=None)
    @given(state=state_dicts())
    def collect(state: dict[str, torch.Tensor]) -> None:
        values = list(state.values())
        seen["zero_size"] |= any(t.numel() == 0 for t in values)
        seen["zero_dim"] |= any(t.dim() == 0 for t in values)
        seen["non_contiguous"] |= any(not t.is_contiguous() for t in values)
        seen["tied"] |= len({id(t) for t in values}) < len(values)

    collect()
    assert all(seen.values()), seen


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _official_file(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    tensors = {"a": torch.randn(3, 4, generator=g), "b": torch.randint(0, 9, (5,), generator=g),
               "c": torch.randn(2, generator=g).half(), "é": torch.zeros(0)}  # fmt: skip
    return safetensors.torch.save(tensors, metadata={"format": "pt", "note": "x"})


@SETTINGS
@given(
    seed=st.integers(0, 3),
    edits=st.lists(st.tuples(st.integers(0, 400), st.binary(min_size=1, max_size=4)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 400)),
)
def test_a_mutated_file_ckptools_accepts_reads_as_the_official_library_reads_it(tmp_path_factory, seed, edits, cut):
    """ckptools may be stricter than the official reader, never different: whatever it accepts, the
    official library accepts too and gives the same tensors; whatever it refuses, it refuses with a
    CheckpointError."""
    data = bytearray(_official_file(seed))
    for at, chunk in edits:
        at %= len(data)
        data[at : at + len(chunk)] = chunk
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    path = tmp_path_factory.mktemp("mut") / "m.safetensors"
    path.write_bytes(bytes(data))
    try:
        ours = ck.load_state_dict(path, strip=None)
    except ck.CheckpointError:
        return  # refusing is allowed (the README lists where ckptools is stricter)
    try:
        theirs = safetensors.torch.load(bytes(data))
    except Exception as err:
        raise AssertionError(f"ckptools accepted a file the official reader refuses: {err}") from err
    assert set(ours) == set(theirs)
    assert all(_same(ours[k], theirs[k]) for k in theirs)
