"""Run every library reader on every file of a corpus, under an address-space limit.

Usage: python _bounded_readers.py CORPUS_DIR OUT_DIR HEADROOM_MIB

Prints one JSON object: {"results": [[file, reader, outcome, seconds, memory_error], ...]}.
``outcome`` is "ok" or the exception's class name. Address space is capped at what the
process uses after importing torch plus HEADROOM_MIB, so a reader that allocates what a file
*claims* (gigabytes in a file of a few bytes) fails with MemoryError, which is reported.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings


def vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def _memory_trouble(err: BaseException | None) -> bool:
    while err is not None:
        text = str(err)
        if isinstance(err, MemoryError) or "alloc" in text.lower() or "out of memory" in text.lower():
            return True
        err = err.__cause__ or err.__context__
    return False


def main() -> None:
    corpus, out_dir, headroom = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import torch  # loaded before measuring the baseline (and used at the end)

    import ckptools as ck
    from ckptools.codecs.pickles import loads
    from ckptools.codecs.safetensors import read_safetensors_header, rename_safetensors, verify_safetensors
    from ckptools.codecs.torchzip import TorchZip
    from ckptools.layouts.safetensors_file import load_safetensors
    from ckptools.layouts.torch_io import verify_torch_file
    from ckptools.state_dict import strip_prefix
    from ckptools.storage import open_local

    def torch_free_info(path: str) -> None:  # what `ckpt info` and `strip-module` read a .pt zip with
        with open_local(path) as f:
            loads(TorchZip(path, f).read_pickle(f), path)

    out = os.path.join(out_dir, "out.safetensors")
    both = {
        "load_state_dict": lambda p: ck.load_state_dict(p),
        "load_state_dict(verify=True)": lambda p: ck.load_state_dict(p, verify=True),
    }
    readers = {
        ".pt": {
            "load": lambda p: ck.load(p, restore_rng=False),
            "load(verify=True)": lambda p: ck.load(p, verify=True, restore_rng=False),
            "verify_torch_file": verify_torch_file,
            "convert_to_safetensors": lambda p: ck.convert_to_safetensors(p, out),
            "torchzip (ckpt info)": torch_free_info,
            "inspect (ckpt info)": ck.inspect,
            **both,
        },
        ".safetensors": {
            "read_safetensors_header": read_safetensors_header,
            "verify_safetensors": verify_safetensors,
            "load_safetensors": load_safetensors,
            "rename_safetensors": lambda p: rename_safetensors(p, out, lambda sd: strip_prefix(sd, "a.")),
            "inspect (ckpt info)": ck.inspect,
            **both,
        },
    }
    names = sorted(json.loads(sys.stdin.read()))
    # Every code path once on the good files first, so lazy imports are not charged to the limit.
    for ext, group in readers.items():
        for reader in group.values():
            reader(os.path.join(corpus, "valid" + ext))
    os.unlink(out)
    limit = vm_bytes() + headroom * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    results = []
    warnings.simplefilter("ignore")
    for name in names:
        path = os.path.join(corpus, name)
        for reader_name, reader in readers[os.path.splitext(name)[1]].items():
            started = time.monotonic()
            error: BaseException | None = None
            try:
                reader(path)
                outcome = "ok"
            except Exception as err:  # noqa: BLE001 - classified by the test
                error = err
                outcome = type(err).__name__
            results.append([name, reader_name, outcome, time.monotonic() - started, _memory_trouble(error)])
            if outcome == "ok" and os.path.exists(out):
                os.unlink(out)
    # What a file could change for the whole process (a pickle BUILD onto a global): unchanged, and saving works.
    import collections
    import io

    import torch._utils

    untouched = torch._utils._rebuild_tensor_v2.__module__ == "torch._utils" and callable(
        collections.Counter.most_common
    )
    torch.save({"w": torch.ones(2)}, io.BytesIO())
    print(json.dumps({"results": results, "untouched": untouched}))


if __name__ == "__main__":
    main()
