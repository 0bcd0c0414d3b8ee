"""Differential tests: ckptools' own readers and writers against torch and the official safetensors.

For generated state dicts (every dtype both formats hold, 0-d and zero-size tensors, non-contiguous
tensors, views of one storage, tied names, unicode names; bare or nested beside plain values;
pickle protocols 2 and 3) and generated safetensors files (metadata of any strings), every
operation must give, bit for bit, what the official implementation gives: the torch-free ``info``,
``load_state_dict``, conversion to safetensors (read back by the official library),
``strip-module`` and ``add-module`` (read back by torch, other entries unchanged), conversion back
to a torch file, and the same through the ``ckpt`` command line.

For files written by torch and by the official safetensors library and then damaged (bytes
overwritten, the end cut off): ckptools may refuse more than the official reader (docs/guarantees.md lists
where), but whatever it accepts the official reader accepts and reads the same, and every refusal
is a CheckpointError (exit status 2 on the command line, never a traceback).

CKPTOOLS_FUZZ_EXAMPLES examples per property (40; 3000 in `make fuzz`).
"""

from __future__ import annotations

import io
import json
import os

import _torch_can as torch_can
import pytest
import safetensors
import safetensors.torch
import torch
from _same import same_tensor
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import ckptools as ck
from ckptools.cli import app

runner = CliRunner()

EXAMPLES = int(os.environ.get("CKPTOOLS_FUZZ_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=os.environ.get("CI") == "true",  # CI replays the same examples; local runs draw new ones
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Every dtype both torch files and safetensors hold (that this torch can save: 2.4 cannot save uint16-64).
DTYPES = [getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16",
          "int8", "uint8", "bool", "complex64", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
          if torch_can.save(name)]  # fmt: skip
NAME = st.text(st.characters(categories=("L", "N"), include_characters="._-é中"), min_size=1, max_size=10)


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
    assert set(ours) == set(theirs) and all(same_tensor(ours[k], theirs[k]) for k in theirs)

    # to safetensors, read back by the official library (tied names through ckptools' aliases)
    dst = tmp / "s.safetensors"
    ck.convert_to_safetensors(src, dst, strip=None)
    official = safetensors.torch.load_file(str(dst))
    with safetensors.safe_open(str(dst), "pt") as f:
        aliases = json.loads((f.metadata() or {}).get("ckptools.aliases", "{}"))
    assert not set(aliases) & set(official)  # an alias never names a stored tensor
    assert set(official) | set(aliases) == set(theirs)
    for name, t in theirs.items():
        assert same_tensor(official[aliases.get(name, name)], t), name

    # strip-module and add-module, read back by torch: keys as ck.strip_prefix / ck.add_prefix give
    # them, tensors unchanged, every other entry as it was
    for transform in (ck.strip_prefix, ck.add_prefix):
        renamed = tmp / "r.pt"
        ck.rename_checkpoint(src, renamed, transform)
        _check_renamed(renamed, loaded, nest, transform)

    # the command line gives what the library gives
    assert _cli("info", src, "--json").exit_code == 0
    assert json.loads(_cli("info", src, "--json").output)["tensors"] == ck.inspect(src)["tensors"]
    assert _cli("strip-module", src, "-o", tmp / "c.pt").exit_code == 0
    _check_renamed(tmp / "c.pt", loaded, nest, ck.strip_prefix)
    assert _cli("convert", src, tmp / "c.safetensors", "--no-strip").exit_code == 0
    assert safetensors.torch.load_file(str(tmp / "c.safetensors")).keys() == official.keys()

    # and back from safetensors to a torch file
    again = tmp / "a.pt"
    torch_file = ck.load_state_dict(dst, strip=None)
    ck.layouts.torch_io.save_file(again, torch_file)
    final = torch.load(again, weights_only=True)
    assert set(final) == set(theirs) and all(same_tensor(final[k], theirs[k]) for k in theirs)


def _cli(*args: object):
    result = runner.invoke(app, [str(a) for a in args])
    # 0, 2 (a CheckpointError, one line on stderr) or verify's 1 (DAMAGED); never an exception
    allowed = (0, 1, 2) if args[0] == "verify" else (0, 2)
    assert result.exit_code in allowed, (args, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    assert len(result.output.strip().splitlines()) <= 1 or result.exit_code == 0, result.output
    return result


def _check_renamed(path, loaded, nest, transform) -> None:
    whole = torch.load(path, weights_only=True)
    back = whole if nest is None else whole[nest]
    expected = transform(loaded if nest is None else loaded[nest])
    assert list(back) == list(expected) and all(same_tensor(back[k], expected[k]) for k in expected)
    if nest is not None:  # every other entry as it was
        assert {k: v for k, v in whole.items() if k != nest} == {k: v for k, v in loaded.items() if k != nest}


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


pytestmark = [pytest.mark.versions, pytest.mark.filterwarnings("ignore::UserWarning")]
# versions: checked against torch.load and safetensors


def _official_file(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    tensors = {"a": torch.randn(3, 4, generator=g), "b": torch.randint(0, 9, (5,), generator=g),
               "c": torch.randn(2, generator=g).half(), "é": torch.zeros(0)}  # fmt: skip
    return safetensors.torch.save(tensors, metadata={"format": "pt", "note": "x"})


def _damage(reach: int, most: int) -> dict[str, st.SearchStrategy]:
    """Strategies for `_mutate`: up to ``most`` overwrites of 1-4 bytes and perhaps a cut, at
    positions drawn up to ``reach`` (taken modulo the file's length)."""
    chunk = st.tuples(st.integers(0, reach), st.binary(min_size=1, max_size=4))
    return {"edits": st.lists(chunk, min_size=1, max_size=most), "cut": st.one_of(st.none(), st.integers(0, reach))}


def _mutate(data: bytes, edits: list[tuple[int, bytes]], cut: int | None) -> bytes:
    out = bytearray(data)
    for at, chunk in edits:
        at %= len(out)
        out[at : at + len(chunk)] = chunk
    return bytes(out if cut is None else out[: cut % (len(out) + 1)])


@SETTINGS
@given(seed=st.integers(0, 3), **_damage(400, 4))
def test_a_mutated_file_ckptools_accepts_reads_as_the_official_library_reads_it(tmp_path_factory, seed, edits, cut):
    """ckptools may be stricter than the official reader, never different: whatever it accepts, the
    official library accepts too and gives the same tensors; whatever it refuses, it refuses with a
    CheckpointError."""
    data = _mutate(_official_file(seed), edits, cut)
    path = tmp_path_factory.mktemp("mut") / "m.safetensors"
    path.write_bytes(bytes(data))
    try:
        ours = ck.load_state_dict(path, strip=None)
    except ck.CheckpointError:
        return  # refusing is allowed (docs/guarantees.md lists where ckptools is stricter)
    try:
        theirs = safetensors.torch.load(bytes(data))
    except Exception as err:
        raise AssertionError(f"ckptools accepted a file the official reader refuses: {err}") from err
    assert set(ours) == set(theirs)
    assert all(same_tensor(ours[k], theirs[k]) for k in theirs)


def _official_torch_file(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    weights = {"module.a": torch.randn(3, 4, generator=g), "module.b": torch.randint(0, 9, (5,), generator=g),
               "c": torch.randn(2, generator=g).half(), "é": torch.zeros(0)}  # fmt: skip
    weights["tied"] = weights["module.a"]
    tree = {"model": weights, "step": seed, "name": "run"} if seed % 2 else weights
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    return buffer.getvalue()


# Files are about 2.4 KB; the zip directory (the last ~800 bytes) is hit as often as the data.
@SETTINGS
@given(seed=st.integers(0, 3), **_damage(4000, 3))
def test_a_mutated_torch_file_ckptools_accepts_reads_as_torch_reads_it(tmp_path_factory, seed, edits, cut):
    """Every torch-free operation (info, verify, load_state_dict, convert, strip/add-module, and
    the CLI) either refuses with a CheckpointError or agrees with torch.load(weights_only=True)."""
    data = _mutate(_official_torch_file(seed), edits, cut)
    tmp = tmp_path_factory.mktemp("mut")
    path = tmp / "m.pt"
    path.write_bytes(data)
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal: then ckptools must refuse too
        loaded = None
    nest = "model" if seed % 2 else None

    def accepted(operation: str) -> None:
        assert loaded is not None, f"ckptools' {operation} accepted a file torch.load refuses"
        assert isinstance(theirs, dict), f"ckptools' {operation} accepted a file torch reads as {theirs!r}"

    # What torch read (a damaged pickle may even read as something else entirely: torch does not
    # check CRC-32s); whatever ckptools accepts must be a dict of weights equal to it.
    theirs = loaded.get(nest) if nest is not None and isinstance(loaded, dict) else loaded
    try:
        report = ck.inspect(path)
    except ck.CheckpointError:
        pass
    else:
        accepted("info")
        prefix = "" if nest is None else nest + "."
        got = {t["name"].removeprefix(prefix): (t["dtype"], t["shape"]) for t in report["tensors"]}
        assert got == {k: (str(t.dtype).removeprefix("torch."), list(t.shape)) for k, t in theirs.items()}
    try:
        ck.verify(path)
    except ck.CheckpointError:
        verdict = "refuses"
    else:
        accepted("verify")
        verdict = "passes"
    try:
        ours = ck.load_state_dict(path, strip=None)
    except ck.CheckpointError:
        pass
    else:
        accepted("load_state_dict")
        assert set(ours) == set(theirs) and all(same_tensor(ours[k], theirs[k]) for k in theirs)
    try:
        ck.convert_to_safetensors(path, tmp / "o.safetensors", strip=None)
    except ck.CheckpointError:
        pass
    else:
        accepted("convert")
        official = safetensors.torch.load_file(str(tmp / "o.safetensors"))
        assert all(same_tensor(official[k], theirs[k]) for k in official)
    for n, transform in enumerate((ck.strip_prefix, ck.add_prefix)):
        try:
            ck.rename_checkpoint(path, tmp / f"r{n}.pt", transform)
        except ck.CheckpointError:
            continue
        accepted(transform.__name__)
        _check_renamed(tmp / f"r{n}.pt", loaded, nest, transform)
    for command in (["info", path, "--json"], ["verify", path], ["strip-module", path, "-o", tmp / "c.pt"]):
        if _cli(*command).exit_code == 0:
            accepted("ckpt " + command[0])
    event(f"torch.load {'reads' if theirs is not None else 'refuses'} it, ckptools' verify {verdict}")


@st.composite
def safetensors_files(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    state = {k: v.contiguous().clone() for k, v in draw(state_dicts()).items()}  # safetensors refuses ties
    keys = st.one_of(NAME, st.sampled_from(["format", "ckptools.aliases", "ckptools.crc32", "ckptools.scalars"]))
    values = st.one_of(st.text(max_size=12), st.sampled_from(["pt", "{}", "[]", '{"a": 1}', '{"x": "y"}', "null"]))
    metadata = draw(st.one_of(st.none(), st.dictionaries(keys, values, max_size=4)))
    return state, metadata


@SETTINGS
@given(case=safetensors_files())
def test_a_generated_safetensors_file_reads_as_the_official_library_reads_it(tmp_path_factory, case):
    """Files written by the official library, with any metadata (ckptools' own keys included, with
    values that may be anything): info gives the official metadata, load_state_dict and convert to
    a torch file give the official tensors, strip/add-module keep the metadata and the tensors.
    ckptools' own keys may be refused when they are malformed (a CheckpointError), never obeyed
    over a stored tensor."""
    state, metadata = case
    tmp = tmp_path_factory.mktemp("st")
    src = tmp / "s.safetensors"
    safetensors.torch.save_file(state, str(src), metadata=metadata)
    theirs = safetensors.torch.load_file(str(src))
    with safetensors.safe_open(str(src), "pt") as f:
        their_metadata = f.metadata() or {}
    own = any(k.startswith("ckptools.") for k in their_metadata)
    try:
        assert ck.inspect(src)["metadata"] == their_metadata
        ours = ck.load_state_dict(src, strip=None)
    except ck.CheckpointError:
        assert own  # only ckptools' own keys, malformed, may make ckptools refuse a valid file
        assert _cli("info", src, "--json").exit_code == 2
        return
    assert _cli("info", src, "--json").exit_code == 0
    assert set(theirs) <= set(ours) and all(same_tensor(ours[k], theirs[k]) for k in theirs)  # aliases only add names
    ck.layouts.torch_io.save_file(tmp / "a.pt", ours)
    back = torch.load(tmp / "a.pt", weights_only=True)
    assert all(same_tensor(back[k], theirs[k]) for k in theirs)
    for transform in (ck.strip_prefix, ck.add_prefix):
        try:
            ck.rename_checkpoint(src, tmp / "r.safetensors", transform)
        except ck.CheckpointError:
            assert own  # carried over to the output, ckptools' own keys are checked
            continue
        renamed = safetensors.torch.load_file(str(tmp / "r.safetensors"))
        expected = transform(theirs)
        assert set(renamed) == set(expected) and all(same_tensor(renamed[k], expected[k]) for k in expected)
        with safetensors.safe_open(str(tmp / "r.safetensors"), "pt") as f:
            kept = f.metadata() or {}
        assert {k: v for k, v in kept.items() if not k.startswith("ckptools.")} == {
            k: v for k, v in their_metadata.items() if not k.startswith("ckptools.")
        }
